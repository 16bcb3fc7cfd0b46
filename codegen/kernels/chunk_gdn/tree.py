"""Every round of a tree microbatch in one autograd Function (DESIGN.md section 6).

The rounds of a plan differ only in their sequential part: a sequence of round r starts from a state
that an earlier round exported. Everything else is chunk-local. So the rounds' packed rows are laid
one after another in a single varlen layout, and

  forward:  gather the packed rows from the compact tokens (one gather per input; but see below)
            wy_fwd over every chunk of every round                      (2 launches)
            per round: the initial states from the export bank, state_fwd over its sequences
            output_fwd over every chunk                                 (1 launch)
            keep each compact token's own row                           (1 gather)
  backward: dv_local over every chunk; per round in reverse: the reverse scan (the exported states'
            gradients injected), then its initial-state gradients summed into the bank slots they
            came from; chunk_bwd over every chunk; packed-row gradients back onto compact tokens.
  With `GDNKernelConfig.tree_overlap_rounds` the chunk-parallel kernels run one launch per round instead,
  beside the other rounds' scans (TreeGatedDeltaRuleFunction).

The gathers move whole q/k/v-sized tensors (134 MB each at 32k rows, H=16, K=128, bf16): on the H200
they were 0.9 of a 4.9 ms step. Two ways around them: a plan whose packed rows are the compact tokens in
order skips them (identity_layout); and with `GDNKernelConfig.tree_rows_in_kernels` (the default) the
kernels read inputs and do, and write o and the kept gradients, through the plan's row maps
(index.PackedRows), so only the replayed rows' gradients are summed afterwards (agentic batch of
bench/gdn.py: 11.64 vs 12.31 ms on the H200).

A round's sequences of independent trees (no state hand-off between them) scan on their own CUDA
streams ("lanes", `GDNKernelConfig.tree_scan_lanes`): with round-major launches a tree's branches waited
for the longest root of the microbatch, not for their own (agentic batch: 10.24 vs 10.50 ms).

Each chunk runs the same kernel code with the same entering state as in a trajectory-wise call, so the
outputs equal trajectory-wise outputs bit for bit (the alignment rule of DESIGN.md section 6).
Against one chunk_gated_delta_rule call per round with autograd gathers between them, this removes
per layer and round 5 gathers, their sort-based scatter-add backward, and 6 launches of the
chunk-parallel kernels. Sums over duplicates (a bank state that several sequences start from, a
row that several sequences replay) are taken in a fixed order: results are deterministic.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..interpreter_safe import interpreter_needs_fp32, interpreting
from .chunk_bwd import chunk_bwd, chunk_bwd_buffers
from .function import TRITON_CHUNK_SIZE, _group_sum, triton_supports
from .inputs import check_exports, validate_gdn_tensors
from .index import GDNIndex, GDNKernelConfig, PackedRows, affine_row_shifts, prepare_gdn_index
from .l2norm import l2norm_fused
from .lanes import LaneStreams, assign_lanes, lane_runs
from .segment_add import segment_add
from .state_bwd import dv_local_bwd, state_bwd_scan
from .state_fwd import output_fwd, state_fwd
from .wy_fwd import wy_buffers, wy_fwd


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
    round_id: int                  # the round the sequences belong to
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
    # chunks [c0, c1) of each round in the index (rounds are laid out one after another)
    round_chunks: tuple[tuple[int, int], ...] = ()

    def chunk_phases(self) -> tuple[tuple[int, int], ...]:
        """Chunk ranges the chunk-parallel kernels run one launch each: every round's own with
        tree_overlap_rounds (on CUDA they overlap other rounds' scans; the interpreter runs them in program
        order, which tests the per-round launches), else all chunks at once."""
        overlap = self.index.config.tree_overlap_rounds and len(self.round_chunks) > 1
        return self.round_chunks if overlap else ((0, self.index.num_chunks),)

    def scan_streams(self, overlap: bool) -> LaneStreams:
        cfg = self.index.config
        return LaneStreams(self.num_lanes, self.row_src.device, side_only=overlap,
                           high_priority=overlap and cfg.tree_scan_high_priority)

    def launches_by_round(self) -> list[list[_RoundLaunch]]:
        by_round = [[] for _ in range(max((launch.round_id for launch in self.rounds), default=-1) + 1)]
        for launch in self.rounds:
            by_round[launch.round_id].append(launch)
        return by_round

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
    for r, slots in enumerate(round_slots):
        n = slots.size
        for start, stop in lane_runs(lane[seq_base:seq_base + n]):
            run_slots = slots[start:stop]
            starts = np.flatnonzero(run_slots >= 0)
            distinct, children, counts = _groups(run_slots[starts], starts)
            launches.append(_RoundLaunch(first_seq=seq_base + start, num_seqs=stop - start,
                                         lane=int(lane[seq_base + start]), round_id=r, round_seqs=n,
                                         init_row=as_long(run_slots + 1), start_slots=as_long(distinct),
                                         start_seqs=as_long(children), start_bounds=as_long(np.r_[0, counts.cumsum()])))
        seq_base += n
    seq_chunks = np.r_[0, np.cumsum((np.diff(np.asarray(bounds)) + chunk_size - 1) // chunk_size)]
    round_seq = np.r_[0, np.cumsum([slots.size for slots in round_slots])].astype(np.int64)
    round_chunks = tuple((int(seq_chunks[a]), int(seq_chunks[b])) for a, b in zip(round_seq[:-1], round_seq[1:]))
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
        shift = (affine_row_shifts(np.asarray(bounds, dtype=np.int64), src_all, row_own, chunk_size)
                 if index.config.tree_affine_scan_rows else None)
        rows = PackedRows(src=as_long(src_all), own=as_long(row_own), num_tokens=num_tokens,
                          num_replays=int(replay_rows.size), seq_shift=None if shift is None else as_long(shift))
    return TreeGDNPlan(num_tokens=num_tokens, index=index, row_src=as_long(src_all), own_pick=as_long(own_pick),
                       replay_dst=as_long(replay_dst), replay_rows=as_long(replay_rows),
                       replay_bounds=as_long(np.r_[0, replay_counts.cumsum()]), rounds=tuple(launches),
                       num_lanes=num_lanes,
                       identity_layout=identity, rows=rows, round_chunks=round_chunks)


class TreeGatedDeltaRuleFunction(torch.autograd.Function):
    """With more than one chunk phase (TreeGDNPlan.chunk_phases: tree_overlap_rounds) the chunk-parallel
    kernels run one launch per round on the main stream and, on CUDA, the scans on side streams (lanes):

      forward:  main  wy(round 0) | wy(rounds 1..) | out(round 0) after its scans | out(round 1) ...
                lanes             | scans round 0  | scans round 1 (after wy(rounds 1..)) ...
      backward: main  dv_local(last) | dv_local(the rest) | chunk_bwd(last) after its scans | ...
                lanes                | scans last round   | scans round last-1 (after dv_local) ...

    so a round's scans, a serial chain over its longest sequence, overlap other rounds' chunk-parallel work
    instead of leaving the GPU mostly idle. The host issues each round's scans before the main-stream work
    that should run beside them: a kernel starts on the device as soon as it is issued, so work issued
    first would take the SMs before the scans arrive (the H200 timeline showed just that). Each chunk runs
    the same kernel code on the same inputs in any order: the results are those of one launch over every
    chunk, bit for bit. (On the H200 this measured no faster: GDNKernelConfig.tree_overlap_rounds.)"""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale: float, plan: TreeGDNPlan):
        index, rows = plan.index, plan.rows
        if plan.compact_io:  # the kernels assume dense rows; the runtime's v is a split view of one projection
            q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        else:  # the gathers write dense copies
            q, k, v, g, beta = (x.index_select(0, plan.row_src) for x in (q, k, v, g, beta))
        hv, kd, vd = v.shape[1], k.shape[2], v.shape[2]
        phases = plan.chunk_phases()
        overlap = len(phases) > 1
        gc, T, w, u = wy = wy_fwd(k, v, g, beta, index, rows, chunks=phases[0], out=wy_buffers(k, v, index, rows))
        h = torch.empty(index.num_chunks, hv, kd, vd, device=k.device, dtype=k.dtype)
        v_new = torch.empty_like(u)
        o = torch.empty_like(v_new) if rows is None else v_new.new_empty(rows.num_tokens, hv, vd)
        bank = torch.zeros(1 + index.num_slots, hv, kd, vd, device=k.device, dtype=torch.float32)  # row 0: zeros
        with plan.scan_streams(overlap) as lanes:
            wy_done, scanned = None, []
            for r, launches in enumerate(plan.launches_by_round()):
                for rnd in launches:
                    with lanes.on(rnd.lane):
                        if r:
                            lanes.wait(rnd.lane, wy_done)
                        state_fwd(k, w, u, gc, bank.index_select(0, rnd.init_row), index,
                                  seqs=(rnd.first_seq, rnd.num_seqs), out=(h, v_new, bank[1:]), rows=rows,
                                  launch_seqs=rnd.round_seqs)
                scanned.append(lanes.mark(rnd.lane for rnd in launches) if overlap else [])
                # main-stream work issued after the scans, so that their programs reach the SMs first
                if overlap and r == 0:  # the later rounds' WY while round 0 scans
                    wy_fwd(k, v, g, beta, index, rows, chunks=(phases[1][0], index.num_chunks), out=wy)
                    wy_done = lanes.mark_main()
                elif overlap:  # the previous round's outputs while this round scans
                    lanes.main_waits(scanned[r - 1])
                    output_fwd(q, k, v_new, gc, h, scale, index, rows, chunks=phases[r - 1], out=o)
            if overlap:
                lanes.main_waits(scanned[-1])
                output_fwd(q, k, v_new, gc, h, scale, index, rows, chunks=phases[-1], out=o)
        if not overlap:
            output_fwd(q, k, v_new, gc, h, scale, index, rows, out=o)
        ctx.save_for_backward(q, k, v, beta, gc, T, w, v_new, h)
        ctx.scale, ctx.plan = scale, plan
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
        return o if plan.compact_io else o.index_select(0, plan.own_pick)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, beta, gc, T, w, v_new, h = ctx.saved_tensors
        plan: TreeGDNPlan = ctx.plan
        index, rows = plan.index, plan.rows
        hv, kd, vd = v.shape[1], k.shape[2], v.shape[2]
        if plan.compact_io:
            do = d_out.to(v.dtype).contiguous()
        else:  # replayed outputs are dropped
            do = torch.zeros_like(v_new).index_copy_(0, plan.own_pick, d_out.to(v.dtype))
        phases = plan.chunk_phases()
        overlap = len(phases) > 1
        dv_local = torch.empty(gc.shape[0], hv, vd, device=q.device, dtype=torch.float32)
        dv_local_bwd(q, k, gc, do, ctx.scale, index, rows, chunks=phases[-1], out=dv_local)
        dh = torch.empty(index.num_chunks, hv, kd, vd, device=q.device, dtype=k.dtype)
        dvn = torch.empty_like(v_new)
        bank_grad = torch.zeros(index.num_slots, hv, kd, vd, device=q.device, dtype=torch.float32)
        buffers = chunk_bwd_buffers(q, k, v, gc, index, rows)
        by_round = plan.launches_by_round()
        with plan.scan_streams(overlap) as lanes:
            local_done, scanned, last = None, {}, len(by_round) - 1
            for r in reversed(range(len(by_round))):  # a round's exports are read only by later rounds (same lane)
                for rnd in by_round[r]:
                    with lanes.on(rnd.lane):
                        if r < last:
                            lanes.wait(rnd.lane, local_done)
                        dh0 = state_bwd_scan(q, k, w, gc, do, dv_local, bank_grad, ctx.scale, index, dh, dvn,
                                             seqs=(rnd.first_seq, rnd.num_seqs), rows=rows,
                                             launch_seqs=rnd.round_seqs)
                        if rnd.start_slots.numel():  # distinct slots of this lane's own states, summed in order
                            segment_add(bank_grad, rnd.start_slots, dh0, rnd.start_bounds, rnd.start_seqs)
                scanned[r] = lanes.mark(rnd.lane for rnd in by_round[r]) if overlap else []
                # main-stream work issued after the scans, so that their programs reach the SMs first
                if overlap and r == last:  # the earlier rounds' dv_local while the last round scans
                    dv_local_bwd(q, k, gc, do, ctx.scale, index, rows, chunks=(0, phases[-1][0]), out=dv_local)
                    local_done = lanes.mark_main()
                elif overlap:  # the next round's chunk-parallel backward while this round scans
                    lanes.main_waits(scanned[r + 1])
                    chunk_bwd(q, k, v, beta, gc, T, v_new, h, dh, do, dvn, ctx.scale, index, rows,
                              chunks=phases[r + 1], buffers=buffers)
            if overlap:
                lanes.main_waits(scanned[0])
                chunk_bwd(q, k, v, beta, gc, T, v_new, h, dh, do, dvn, ctx.scale, index, rows, chunks=phases[0],
                          buffers=buffers)
        dq, dk, dv, dbeta, dg, *side = chunk_bwd(q, k, v, beta, gc, T, v_new, h, dh, do, dvn, ctx.scale, index, rows,
                                                 chunks=(0, 0) if overlap else None,  # overlap: all ran above
                                                 buffers=buffers)
        names = ("q", "k", "v", "g", "beta")  # the order of ctx.dtypes and of the returned gradients
        per_token = dict(zip(names, (dq, dk, dv, dg, dbeta)))  # compact with row maps, else per packed row
        replayed = dict(zip(("k", "v", "beta", "g"), side[0])) if side else per_token  # side: by replay slot
        hk = q.shape[1]
        compact = []
        for name, dtype in zip(names, ctx.dtypes):
            per_key_head = name in ("q", "k")
            grad = _group_sum(per_token[name], hk) if per_key_head else per_token[name]
            if not plan.compact_io:
                grad = grad.index_select(0, plan.own_pick)
            # own row + the replays' sum, in fp32, rounded once; a replayed row's dq is exactly 0 (its do is 0).
            # Side slots are the replayed rows grouped by token; without them the replays are packed rows.
            if plan.replay_dst.numel() and name != "q":
                groups = replayed[name].shape[1] // hk if per_key_head else 1
                segment_add(grad, plan.replay_dst, replayed[name], plan.replay_bounds,
                            None if side else plan.replay_rows, groups=groups)
            compact.append(grad.to(dtype))
        return (*compact, None, None)


def tree_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `tree_gated_delta_rule` runs these inputs (else: one call per round, which falls back)."""
    return (q.is_cuda or interpreting()) and all(
        triton_supports(x.dtype, k.shape[2], v.shape[2], cuda=x.is_cuda) for x in (q, k, v))


def tree_gated_delta_rule(q, k, v, g, beta, *, scale: float, plan: TreeGDNPlan, use_qk_l2norm: bool = False):
    """Compact q, k [T, HK, K], v [T, HV, V], g, beta [T, HV] -> o [T, HV, V]: every round of `plan` run
    with the Triton kernels (CUDA, or the CPU interpreter) in one autograd Function."""
    rows = validate_gdn_tensors(q, k, v, g, beta, who="tree_gated_delta_rule")[0]
    if rows != plan.num_tokens:
        raise ValueError(f"tree_gated_delta_rule: `q` has {rows} rows, the plan was built for {plan.num_tokens} tokens")
    if not tree_supported(q, k, v):
        raise ValueError(f"tree_gated_delta_rule: the Triton kernels do not run {q.dtype} with K={k.shape[2]}, "
                         f"V={v.shape[2]} on {q.device.type} (they need CUDA or TRITON_INTERPRET=1, and "
                         "function.triton_supports); use one call per round with the reference")
    if plan.row_src.device != q.device:
        raise ValueError(f"tree_gated_delta_rule: the plan lives on {plan.row_src.device}, the inputs on {q.device}")
    if any(map(interpreter_needs_fp32, (q, k, v, beta))):  # the interpreter's 16-bit dots are wrong: fp32
        return tree_gated_delta_rule(q.float(), k.float(), v.float(), g, beta.float(), scale=scale, plan=plan,
                                     use_qk_l2norm=use_qk_l2norm).to(v.dtype)
    if use_qk_l2norm:  # on compact tokens: each once, and the replays gather the normalised rows
        q, k = l2norm_fused(q), l2norm_fused(k)
    return TreeGatedDeltaRuleFunction.apply(q, k, v, g, beta, float(scale), plan)
