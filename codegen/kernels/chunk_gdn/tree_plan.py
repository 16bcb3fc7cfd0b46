"""The launch plan of a tree microbatch's GDN rounds (tree.py runs it): every round's packed rows laid out as
one varlen index, the export bank, the scans' lanes and launches per round, the replay and bank-start groups
that the backward sums, and the row maps the kernels read through. Built once per microbatch on the host,
shared by every GDN layer; errors name the round and the field."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .function import TRITON_CHUNK_SIZE
from .inputs import check_exports
from .index import GDNIndex, GDNKernelConfig, PackedRows, affine_chunk_shifts, affine_row_shifts, prepare_gdn_index
from .lanes import assign_lanes, lane_runs


@dataclasses.dataclass(frozen=True)
class TreeRoundSpec:
    """One round as the planner describes it (host arrays; the fields of `codegen.index.LinearRound`)."""

    cu_seqlens: np.ndarray     # [N+1] packed rows per sequence, local to the round
    row_src: np.ndarray        # [R] compact token of each packed row (replay rows included)
    own_rows: np.ndarray       # [R_own] packed rows whose outputs are kept ...
    own_dst: np.ndarray        # ... and the compact tokens they are
    init_state: np.ndarray     # [N] bank id each sequence starts from, -1 = zeros
    export_seq: np.ndarray     # [E] sequence (in the round) of each exported state
    export_offset: np.ndarray  # [E] row offset (multiple of the chunk size) in that sequence
    export_bank: np.ndarray    # [E] bank id the state is stored under


@dataclasses.dataclass(frozen=True)
class _RoundLaunch:
    """The scans of one round's sequences [first_seq, first_seq + num_seqs) that belong to one lane."""
    first_seq: int
    num_seqs: int
    lane: int                      # CUDA stream (of `TreeGDNPlan.num_lanes`) the launch runs on
    round_seqs: int                # sequences of the whole round: what the launch configuration is chosen for
    init_row: torch.Tensor        # [N] row of the bank (with the zero state at row 0) each sequence starts from
    start_slots: torch.Tensor      # [U] bank slots this round's sequences start from (distinct)
    start_seqs: torch.Tensor       # [N'] those of the launch's sequences (0 = first_seq) that start from a
                                   # bank state, grouped by slot ...
    start_bounds: torch.Tensor     # [U+1] ... slot u's are start_seqs[start_bounds[u]:start_bounds[u + 1]]

    @property
    def start_counts(self) -> torch.Tensor:
        return self.start_bounds.diff()


@dataclasses.dataclass(frozen=True)
class TreeGDNPlan:
    """Launch tables of one microbatch, built once on the host and shared by every GDN layer."""

    num_tokens: int
    index: GDNIndex                # all rounds' sequences, one after another
    row_src: torch.Tensor          # [R] compact token of each packed row
    own_pick: torch.Tensor         # [T] packed row holding each compact token's kept output
    replay_dst: torch.Tensor       # [D] compact tokens that other packed rows replay (distinct)
    replay_rows: torch.Tensor      # [D'] the replaying rows, grouped by token, in row order ...
    replay_bounds: torch.Tensor    # [D+1] ... token d's are replay_rows[replay_bounds[d]:replay_bounds[d + 1]]
    rounds: tuple[_RoundLaunch, ...]  # in round order; a round of several lanes has one launch per lane run
    num_lanes: int = 1
    # packed rows == compact tokens, in order (no replay: every branch point on a chunk boundary). The
    # gathers into and out of the packed layout are then identities and are skipped: on GPU.md's anchor
    # trees they were 0.9 of the tree step's 4.9 ms (H200, 2026-11-30).
    identity_layout: bool = False
    rows: PackedRows | None = None  # packed <-> compact row maps for the kernels (tree_rows_in_kernels)
    @property
    def compact_io(self) -> bool:
        """Whether the kernels read inputs and do, and write o, on the compact tokens (no gathers)."""
        return self.identity_layout or self.rows is not None


def _groups(keys: np.ndarray, values: np.ndarray):
    """Group `values` by `keys`, order inside a group kept: (distinct keys [U], values grouped [N], counts [U])."""
    order = np.argsort(keys, kind="stable")
    distinct, counts = np.unique(keys[order], return_counts=True)
    return distinct, values[order], counts


def _checked_round(r: int, rnd: TreeRoundSpec, num_tokens: int, chunk_size: int):
    """One round's arrays as int64, checked on their own: (cu, row_src, own_rows, own_dst, export_seq,
    export_offset)."""
    fields = [f.name for f in dataclasses.fields(TreeRoundSpec)]
    for field in fields:
        if np.ndim(getattr(rnd, field)) != 1:
            raise ValueError(f"tree GDN plan: rounds[{r}].{field} must be 1-D")
    a = {field: np.asarray(getattr(rnd, field), dtype=np.int64) for field in fields}
    cu, src, own_rows, own_dst = a["cu_seqlens"], a["row_src"], a["own_rows"], a["own_dst"]
    if cu.size < 1 or cu[0] != 0 or cu[-1] != src.size or np.any(np.diff(cu) < 0):
        raise ValueError(f"tree GDN plan: rounds[{r}].cu_seqlens must rise from 0 to len(row_src)={src.size}")
    if src.size and (src.min() < 0 or src.max() >= num_tokens):
        raise ValueError(f"tree GDN plan: rounds[{r}].row_src holds a token outside [0, {num_tokens})")
    if own_rows.size and (own_rows.min() < 0 or own_rows.max() >= src.size):
        raise ValueError(f"tree GDN plan: rounds[{r}].own_rows holds a row outside the round")
    if own_rows.size != own_dst.size or not np.array_equal(src[own_rows], own_dst):
        raise ValueError(f"tree GDN plan: rounds[{r}].own_dst is not row_src[own_rows]")
    if np.unique(own_dst).size != own_dst.size:
        raise ValueError(f"tree GDN plan: rounds[{r}].own_dst keeps a token twice")
    if a["export_seq"].size != a["export_bank"].size:
        raise ValueError(f"tree GDN plan: rounds[{r}].export_seq and export_bank differ in length")
    check_exports(a["export_seq"], a["export_offset"], np.diff(cu).tolist(), chunk_size,
                  who=f"tree GDN plan: rounds[{r}]")
    return cu, src, own_rows, own_dst, a["export_seq"], a["export_offset"]


def plan_tree_gdn(rounds: list[TreeRoundSpec], num_tokens: int, *, chunk_size: int = 64, device=None,
                  config: GDNKernelConfig | None = None) -> TreeGDNPlan:
    """Lay `rounds` out as one varlen call and check the plan's invariants (errors name round and field)."""
    if chunk_size != TRITON_CHUNK_SIZE:
        raise ValueError(f"tree GDN plan: the Triton kernels have chunk_size {TRITON_CHUNK_SIZE} built in, "
                         f"got {chunk_size}")
    bounds, export_seq, export_offset, export_bank, row_src = [0], [], [], [], []
    own_pick = np.full(num_tokens, -1, dtype=np.int64)
    seq_base, row_base = 0, 0
    for r, rnd in enumerate(rounds):
        cu, src, own_rows, own_dst, e_seq, e_off = _checked_round(r, rnd, num_tokens, chunk_size)
        if np.any(own_pick[own_dst] >= 0):
            raise ValueError(f"tree GDN plan: rounds[{r}].own_dst keeps a token an earlier round keeps")
        own_pick[own_dst] = row_base + own_rows
        bounds.extend((row_base + cu[1:]).tolist())
        export_seq.extend((seq_base + e_seq).tolist())
        export_offset.extend(e_off.tolist())
        export_bank.extend(np.asarray(rnd.export_bank, dtype=np.int64).tolist())
        row_src.append(src)
        seq_base += cu.size - 1
        row_base += src.size
    if np.any(own_pick < 0):
        raise ValueError(f"tree GDN plan: token {int(np.argmax(own_pick < 0))} is kept by no round (own_dst)")
    index = prepare_gdn_index(bounds, export_seq, export_offset, chunk_size, device=device, config=config)
    slot_of_bank = {}
    for e, (bank, slot) in enumerate(zip(export_bank, index.export_slot_host)):
        if bank < 0 or slot_of_bank.setdefault(bank, slot) != slot:  # one bank id, one state
            raise ValueError(f"tree GDN plan: export_bank id {bank} (export {e} over all rounds) is negative or "
                             "already names another exported state")

    def as_long(a):
        return torch.as_tensor(np.ascontiguousarray(a, dtype=np.int64), device=device)

    exporter = dict(zip(export_bank, export_seq))  # bank id -> the sequence that exported it
    round_slots, parent, seq_base, exported = [], [], 0, set()
    for r, rnd in enumerate(rounds):
        n = len(rnd.cu_seqlens) - 1
        init = np.asarray(rnd.init_state, dtype=np.int64)
        if init.size != n or np.any(init < -1):
            raise ValueError(f"tree GDN plan: rounds[{r}].init_state must hold a bank id or -1 for each of its "
                             f"{n} sequences")
        late = [int(b) for b in init if b >= 0 and int(b) not in exported]
        if late:
            raise ValueError(f"tree GDN plan: rounds[{r}].init_state: bank id {late[0]} is exported by no "
                             "earlier round")
        round_slots.append(np.array([slot_of_bank[int(b)] if b >= 0 else -1 for b in init], dtype=np.int64))
        parent.extend(exporter[int(b)] if b >= 0 else -1 for b in init)
        exported.update(int(b) for b in rnd.export_bank)
        seq_base += n
    lane, num_lanes = assign_lanes([slots.size for slots in round_slots], np.diff(np.asarray(bounds)),
                                     np.asarray(parent, dtype=np.int64), index.config.tree_scan_lanes)
    launches, seq_base = [], 0
    for slots in round_slots:
        n = slots.size
        for start, stop in lane_runs(lane[seq_base:seq_base + n]):
            run_slots = slots[start:stop]
            starts = np.flatnonzero(run_slots >= 0)
            distinct, children, counts = _groups(run_slots[starts], starts)
            launches.append(_RoundLaunch(first_seq=seq_base + start, num_seqs=stop - start,
                                         lane=int(lane[seq_base + start]), round_seqs=n,
                                         init_row=as_long(run_slots + 1), start_slots=as_long(distinct),
                                         start_seqs=as_long(children), start_bounds=as_long(np.r_[0, counts.cumsum()])))
        seq_base += n
    src_all = np.concatenate(row_src) if row_src else np.zeros(0, np.int64)
    replay = np.setdiff1d(np.arange(src_all.size), own_pick, assume_unique=True)
    replay_dst, replay_rows, replay_counts = _groups(src_all[replay], replay)
    identity = src_all.size == num_tokens and np.array_equal(src_all, np.arange(num_tokens)) and np.array_equal(
        own_pick, np.arange(num_tokens))
    rows = None
    if index.config.tree_rows_in_kernels and not identity:
        row_own = np.empty(src_all.size, dtype=np.int64)
        row_own[own_pick] = np.arange(num_tokens)
        row_own[replay_rows] = -1 - np.arange(replay_rows.size)  # side slots grouped by token, as summed
        cfg, cu = index.config, np.asarray(bounds, dtype=np.int64)
        # per-chunk shifts (one pass over the rows), from which the scans' per-sequence shifts derive
        chunk_shift = (affine_chunk_shifts(cu, src_all, row_own, chunk_size)
                       if cfg.tree_affine_scan_rows or cfg.tree_affine_chunk_rows else None)
        shift = affine_row_shifts(cu, chunk_shift, chunk_size) if cfg.tree_affine_scan_rows else None
        chunk_shift = chunk_shift if cfg.tree_affine_chunk_rows else None
        rows = PackedRows(src=as_long(src_all), own=as_long(row_own), num_tokens=num_tokens,
                          num_replays=int(replay_rows.size), seq_shift=None if shift is None else as_long(shift),
                          chunk_shift=None if chunk_shift is None else as_long(chunk_shift))
    return TreeGDNPlan(num_tokens=num_tokens, index=index, row_src=as_long(src_all), own_pick=as_long(own_pick),
                       replay_dst=as_long(replay_dst), replay_rows=as_long(replay_rows),
                       replay_bounds=as_long(np.r_[0, replay_counts.cumsum()]), rounds=tuple(launches),
                       num_lanes=num_lanes,
                       identity_layout=identity, rows=rows)
