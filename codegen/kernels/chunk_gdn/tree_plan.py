"""The launch plan of a microbatch's GDN rounds (tree.py runs it), built once on the host.

Every round's packed rows are laid out as one varlen index; per round, the scans' launches (one per lane
run), the bank rows their sequences start from and the bank-start groups the backward sums; the replay
groups; the row maps the kernels read through. A trajectory-wise batch is the same plan with one round
whose packed rows are the compact tokens in order (`identity_layout`: no maps).

State bank: the forward keeps one fp32 bank [1 + num_slots + num_initial, HV, K, V]: row 0 the zero state,
then the states exported by the rounds (slots), then the caller's initial states (`num_initial`, the
single-call API's `initial_state`). In the backward, grad-bank row g is bank row 1 + g.

Rounds are any objects with the fields of `codegen.index.LinearRound` (numpy arrays); the plan checks
every invariant the kernels rely on once, here, with errors naming the round and the field.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .config import GDNKernelConfig
from .index import GDNIndex, PackedRows, affine_chunk_shifts, affine_row_shifts, longest_first, prepare_gdn_index
from .inputs import check_exports
from .lanes import assign_lanes, lane_runs

CHUNK_SIZE = 64  # the chunk the Triton kernels are written for (BT = 64 rows: four 16-row wgmma blocks)
ROUND_FIELDS = ("cu_seqlens", "row_src", "own_rows", "own_dst", "init_state", "export_seq", "export_offset",
                "export_bank")


@dataclasses.dataclass(frozen=True)
class RoundLaunch:
    """The scans of one round's sequences [first_seq, first_seq + num_seqs) that belong to one lane."""
    first_seq: int
    num_seqs: int
    lane: int                      # CUDA stream (of `TreeGDNPlan.num_lanes`) the launch runs on
    round_seqs: int                # sequences of the whole round: what the launch configuration is chosen for
    init_row: np.ndarray           # [num_seqs] bank row each sequence starts from (0 = the zero state)
    start_slots: np.ndarray        # [U] distinct grad-bank rows this launch's sequences start from
    start_seqs: np.ndarray         # [N'] those of the launch's sequences (0 = first_seq) that start from a
                                   # bank state, grouped by slot ...
    start_bounds: np.ndarray       # [U+1] ... slot u's are start_seqs[start_bounds[u]:start_bounds[u + 1]]
    init_host: tuple[int, ...]     # init_row as ints (the reference path's control flow)
    scan_order: np.ndarray         # [num_seqs] the launch's sequences (0 = first_seq) longest first
    chunks: tuple[int, int]        # the launch's chunks [first, end) of the index
    packed_rows: tuple[int, int]   # and their packed rows [first, end)
    longest_chunks: int            # chunks of its longest sequence


@dataclasses.dataclass(frozen=True)
class TreeGDNPlan:
    """Launch tables of one microbatch, shared by every GDN layer."""

    num_tokens: int
    index: GDNIndex                # all rounds' sequences, one after another
    own_pick: np.ndarray           # [T] packed row holding each compact token's kept output
    replay_dst: np.ndarray         # [D] compact tokens that other packed rows replay (distinct)
    replay_bounds: np.ndarray      # [D+1] token d's replays are side slots replay_bounds[d]:replay_bounds[d + 1]
    launches: tuple[RoundLaunch, ...]  # in round order; a round of several lanes has one launch per lane run
    num_lanes: int
    num_initial: int               # caller-given initial states (bank rows 1 + num_slots + j)
    output_slots: np.ndarray       # [E_out] slot of each exported state returned to the caller
    output_slots_host: tuple[int, ...]
    row_src: np.ndarray            # [R] compact token of each packed row (the reference path's gathers)
    # packed rows == compact tokens in order (trajectory-wise, or no replay anywhere): no maps, no gathers
    identity_layout: bool
    rows: PackedRows | None        # the row maps, None with identity_layout


def _groups(keys: np.ndarray, values: np.ndarray):
    """Group `values` by `keys`, order inside a group kept: (distinct keys [U], values grouped [N], counts [U])."""
    order = np.argsort(keys, kind="stable")
    distinct, counts = np.unique(keys[order], return_counts=True)
    return distinct, values[order], counts


def _checked_round(r: int, rnd, num_tokens: int, chunk_size: int, num_initial: int) -> dict:
    """One round's arrays as int64, checked on their own."""
    a = {}
    for field in ROUND_FIELDS:
        value = np.asarray(getattr(rnd, field))
        if value.ndim != 1:
            raise ValueError(f"GDN plan: rounds[{r}].{field} must be 1-D")
        a[field] = value.astype(np.int64, copy=False)
    cu, src, own_rows, own_dst = a["cu_seqlens"], a["row_src"], a["own_rows"], a["own_dst"]
    if cu.size < 1 or cu[0] != 0 or cu[-1] != src.size or np.any(np.diff(cu) < 0):
        raise ValueError(f"GDN plan: rounds[{r}].cu_seqlens must rise from 0 to len(row_src)={src.size}")
    if src.size and (src.min() < 0 or src.max() >= num_tokens):
        raise ValueError(f"GDN plan: rounds[{r}].row_src holds a token outside [0, {num_tokens})")
    if own_rows.size and (own_rows.min() < 0 or own_rows.max() >= src.size):
        raise ValueError(f"GDN plan: rounds[{r}].own_rows holds a row outside the round")
    if own_rows.size != own_dst.size or not np.array_equal(src[own_rows], own_dst):
        raise ValueError(f"GDN plan: rounds[{r}].own_dst is not row_src[own_rows]")
    if np.unique(own_rows).size != own_rows.size:
        raise ValueError(f"GDN plan: rounds[{r}].own_rows keeps a row twice")
    if a["export_seq"].size != a["export_bank"].size:
        raise ValueError(f"GDN plan: rounds[{r}].export_seq and export_bank differ in length")
    if a["init_state"].size != cu.size - 1 or np.any(a["init_state"] < -1 - num_initial):
        raise ValueError(f"GDN plan: rounds[{r}].init_state must hold a bank id, -1 (zeros) or -2-j (the "
                         f"caller's state j < {num_initial}) for each of its {cu.size - 1} sequences")
    check_exports(a["export_seq"], a["export_offset"], np.diff(cu).tolist(), chunk_size,
                  who=f"GDN plan: rounds[{r}]")
    return a


def plan_tree_gdn(rounds, num_tokens: int, *, chunk_size: int = CHUNK_SIZE,
                  config: GDNKernelConfig | None = None, num_initial: int = 0, output_banks=()) -> TreeGDNPlan:
    """Lay `rounds` out as one varlen index and check the plan's invariants (errors name round and field).
    Any chunk size (the plain-torch reference runs them all; the Triton kernels need CHUNK_SIZE).
    `num_initial`: states the caller passes in (a sequence with init_state -2-j starts from state j);
    `output_banks`: bank ids of exported states returned to the caller (a piece's carried states).
    O(rows + chunks + sequences log sequences)."""
    checked = [_checked_round(r, rnd, num_tokens, chunk_size, num_initial) for r, rnd in enumerate(rounds)]
    bounds, export_seq, export_offset, export_bank, row_src = [0], [], [], [], []
    own_pick = np.full(num_tokens, -1, dtype=np.int64)
    seq_base, row_base = 0, 0
    for r, a in enumerate(checked):
        if np.any(own_pick[a["own_dst"]] >= 0):
            raise ValueError(f"GDN plan: rounds[{r}].own_dst keeps a token that this or an earlier round keeps")
        own_pick[a["own_dst"]] = row_base + a["own_rows"]
        bounds.extend((row_base + a["cu_seqlens"][1:]).tolist())
        export_seq.extend((seq_base + a["export_seq"]).tolist())
        export_offset.extend(a["export_offset"].tolist())
        export_bank.extend(a["export_bank"].tolist())
        row_src.append(a["row_src"])
        seq_base += a["cu_seqlens"].size - 1
        row_base += a["row_src"].size
    if np.any(own_pick < 0):
        raise ValueError(f"GDN plan: token {int(np.argmax(own_pick < 0))} is kept by no round (own_dst)")
    index = prepare_gdn_index(bounds, export_seq, export_offset, chunk_size, config=config)
    slot_of_bank = {}
    for e, (bank, slot) in enumerate(zip(export_bank, index.export_slot_host)):
        if bank < 0 or slot_of_bank.setdefault(bank, slot) != slot:  # one bank id, one state
            raise ValueError(f"GDN plan: export_bank id {bank} (export {e} over all rounds) is negative or "
                             "already names another exported state")
    exporter = dict(zip(export_bank, export_seq))  # bank id -> the sequence that exported it
    round_slots, parent, exported = [], [], set()
    for r, (rnd, a) in enumerate(zip(rounds, checked)):
        late = [int(b) for b in a["init_state"] if b >= 0 and int(b) not in exported]
        if late:
            raise ValueError(f"GDN plan: rounds[{r}].init_state: bank id {late[0]} is exported by no earlier round")
        round_slots.append(np.array([slot_of_bank[int(b)] if b >= 0 else
                                     (-1 if b == -1 else index.num_slots + (-2 - int(b))) for b in a["init_state"]],
                                    np.int64))
        parent.extend(exporter[int(b)] if b >= 0 else -1 for b in a["init_state"])
        exported.update(int(b) for b in a["export_bank"])
    missing = [int(b) for b in output_banks if int(b) not in slot_of_bank]
    if missing:
        raise ValueError(f"GDN plan: output bank id {missing[0]} is exported by no round")
    src_all = np.concatenate(row_src) if row_src else np.zeros(0, np.int64)
    return _assemble(num_tokens, index, own_pick, src_all, round_slots, np.asarray(parent, np.int64),
                     num_initial=num_initial,
                     output_slots=np.asarray([slot_of_bank[int(b)] for b in output_banks], np.int64))


def plan_single_call(seq_lengths, export_seq=(), export_offset=(), *, chunk_size: int = CHUNK_SIZE,
                     config: GDNKernelConfig | None = None) -> TreeGDNPlan:
    """The plan of one packed varlen call (the fla-style signature of `chunk_gated_delta_rule`): one round,
    packed rows = tokens, sequence i starting from the caller's initial state i, the requested states
    returned to the caller."""
    lengths = np.asarray(seq_lengths, dtype=np.int64)
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    index = prepare_gdn_index(bounds, export_seq, export_offset, chunk_size, config=config)
    rows = int(bounds[-1])
    n = lengths.size
    initial_slots = index.num_slots + np.arange(n, dtype=np.int64)  # grad-bank rows of the caller's states
    return _assemble(rows, index, np.arange(rows, dtype=np.int64), np.arange(rows, dtype=np.int64),
                     [initial_slots], np.full(n, -1, np.int64), num_initial=n,
                     output_slots=np.asarray(index.export_slot_host, np.int64))


def _assemble(num_tokens, index: GDNIndex, own_pick, src_all, round_slots, parent, *, num_initial,
              output_slots) -> TreeGDNPlan:
    """Lanes, launches, replay groups and row maps of a laid-out plan. `round_slots`: per round, the grad-bank
    row each sequence starts from (-1 = the zero state)."""
    lane, num_lanes = assign_lanes([slots.size for slots in round_slots], np.diff(index.cu_seqlens), parent,
                                   index.config.tree_scan_lanes)
    launches, seq_base = [], 0
    chunks_per_seq = np.diff(index.seq_chunk_start)
    for slots in round_slots:
        n = slots.size
        for start, stop in lane_runs(lane[seq_base:seq_base + n]):
            run_slots = slots[start:stop]
            starts = np.flatnonzero(run_slots >= 0)
            distinct, children, counts = _groups(run_slots[starts], starts)
            launches.append(RoundLaunch(
                first_seq=seq_base + start, num_seqs=stop - start, lane=int(lane[seq_base + start]), round_seqs=n,
                init_row=run_slots + 1, start_slots=distinct.astype(np.int64), start_seqs=children.astype(np.int64),
                start_bounds=np.r_[0, counts.cumsum()].astype(np.int64), init_host=tuple((run_slots + 1).tolist()),
                scan_order=longest_first(chunks_per_seq[seq_base + start:seq_base + stop]),
                chunks=(int(index.seq_chunk_start[seq_base + start]), int(index.seq_chunk_start[seq_base + stop])),
                packed_rows=(int(index.cu_seqlens[seq_base + start]), int(index.cu_seqlens[seq_base + stop])),
                longest_chunks=int(chunks_per_seq[seq_base + start:seq_base + stop].max(initial=0))))
        seq_base += n
    replay = np.setdiff1d(np.arange(src_all.size), own_pick, assume_unique=True)
    replay_dst, replay_rows, replay_counts = _groups(src_all[replay], replay)
    identity = src_all.size == num_tokens and np.array_equal(src_all, np.arange(num_tokens)) and np.array_equal(
        own_pick, np.arange(num_tokens))
    rows = None
    if not identity:
        row_own = np.empty(src_all.size, dtype=np.int64)
        row_own[own_pick] = np.arange(num_tokens)
        row_own[replay_rows] = -1 - np.arange(replay_rows.size)  # side slots grouped by token, as summed
        chunk_shift = affine_chunk_shifts(index.cu_seqlens, src_all, row_own, index.chunk_size)
        rows = PackedRows(src=src_all, own=row_own, num_tokens=num_tokens, num_replays=int(replay_rows.size),
                          seq_shift=affine_row_shifts(index.cu_seqlens, chunk_shift, index.chunk_size),
                          chunk_shift=chunk_shift)
    return TreeGDNPlan(num_tokens=num_tokens, index=index, own_pick=own_pick, replay_dst=replay_dst.astype(np.int64),
                       replay_bounds=np.r_[0, replay_counts.cumsum()].astype(np.int64), launches=tuple(launches),
                       num_lanes=num_lanes, num_initial=num_initial, output_slots=output_slots,
                       output_slots_host=tuple(int(s) for s in output_slots), row_src=src_all,
                       identity_layout=bool(identity), rows=rows)
