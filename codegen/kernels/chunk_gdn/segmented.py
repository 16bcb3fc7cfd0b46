"""Long sequences cut into segments whose state maps compose (DESIGN.md section 6, the idle-SM fix).

A round with few long sequences (a tree's shared prefix) runs the sequential state scan on only
HV x V/BV programs, and the scan is latency-bound per chunk. Here every sequence longer than
`segment_chunks` chunks is cut at chunk boundaries into segments, and three calls of the same kernel
run over all segments at once, each segment an independent sequence:

  A. from the zero state, exporting b_j, the state leaving segment j;
  B. with v = 0 and the identity as initial state (K x K "values"), exporting M_j, the segment's state
     map: with u = 0 the scan is S <- (exp(gl) I - k~^T w) S, so it multiplies the maps up;
  then, sequentially over segments (one batched matmul per position): S_{j+1} = M_j S_j + b_j, with
  S_0 the sequence's initial state;
  C. from S_j: the outputs and the requested exports.

Everything is differentiable through the kernel's export and initial-state gradients, so the backward
needs no new kernel. It costs about three times the token work of the cut sequences for scans
`segments` times shorter. The states entering segments 1.. are composed in another order than the
plain scan, so results agree with the uncut call to rounding, not bit for bit: tree == trajectory bit
equality does not hold in rounds that use it (an opt-in, see `TreeModel.gdn_segment_chunks`).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .function import chunk_gated_delta_rule
from .index import GDNIndex, GDNKernelConfig, prepare_gdn_index
from .inputs import check_exports


@dataclasses.dataclass(frozen=True)
class SegmentPlan:
    """Host-built layout of one call's segments (built once per round, shared by every layer)."""

    chunk_size: int
    cu_segments: torch.Tensor          # [S+1] int64: segment bounds in the packed rows (rows are not moved)
    inner_seq: tuple[int, ...]         # segments that have a successor (their end state and map are needed)
    inner_len: tuple[int, ...]
    step_select: tuple[torch.Tensor, ...]  # per position p >= 1: rows of position p-1's states continuing
    step_inner: tuple[torch.Tensor, ...]   # per position p >= 1: inner slot of each continuing segment's predecessor
    start_order: torch.Tensor          # [S]: row of cat(states by position) entering each segment
    export_seg: tuple[int, ...]        # the requested exports, in segment coordinates
    export_off: tuple[int, ...]
    maps_index: GDNIndex | None        # Triton launch indices (calls A/B, call C) when prepared for CUDA
    final_index: GDNIndex | None


def needs_segments(seq_lengths, segment_chunks: int, chunk_size: int) -> bool:
    return any(length > segment_chunks * chunk_size for length in seq_lengths)


def plan_segments(seq_lengths, export_seq=(), export_offset=(), *, segment_chunks: int, chunk_size: int = 64,
                  device=None, kernel_config: GDNKernelConfig | None = None) -> SegmentPlan:
    """Cut every sequence longer than `segment_chunks` chunks. `kernel_config`: also prepare the Triton
    launch indices (on `device`) so that no layer rebuilds them."""
    if not isinstance(segment_chunks, int) or segment_chunks < 1:
        raise ValueError(f"plan_segments: segment_chunks must be an int >= 1, got {segment_chunks!r}")
    seg_rows = segment_chunks * chunk_size
    bounds, first, count, lengths = [0], [], [], []
    for length in seq_lengths:
        first.append(len(lengths))
        pieces = [seg_rows] * (length // seg_rows) + ([length % seg_rows] if length % seg_rows else [])
        pieces = pieces or [0]  # an empty sequence stays one empty segment
        count.append(len(pieces))
        for piece in pieces:
            lengths.append(piece)
            bounds.append(bounds[-1] + piece)
    inner = [s for n, f in zip(count, first) for s in range(f, f + n - 1)]
    inner_slot = {s: i for i, s in enumerate(inner)}
    # states by position p: the sequences with more than p segments, in sequence order
    alive = [list(range(len(count)))]
    select, via = [], []
    for p in range(1, max(count, default=1)):
        prev = alive[-1]
        keep = [i for i, seq in enumerate(prev) if count[seq] > p]
        alive.append([prev[i] for i in keep])
        select.append(keep)
        via.append([inner_slot[first[prev[i]] + p - 1] for i in keep])
    position_start = np.cumsum([0] + [len(a) for a in alive])
    start_order = np.empty(len(lengths), dtype=np.int64)
    for p, seqs in enumerate(alive):
        for i, seq in enumerate(seqs):
            start_order[first[seq] + p] = position_start[p] + i
    seq_lengths = list(seq_lengths)
    # checked here, in the sequences' coordinates: once remapped, a bad export could look valid
    check_exports(export_seq, export_offset, seq_lengths, chunk_size, who="plan_segments")
    e_seg, e_off = [], []
    for seq, off in zip(export_seq, export_offset):
        seq, off = int(seq), int(off)
        piece = (off // chunk_size - 1) // segment_chunks  # the segment holding the boundary's chunk
        e_seg.append(first[int(seq)] + piece)
        e_off.append(int(off) - piece * seg_rows)

    def as_long(values):
        return torch.as_tensor(np.asarray(values, dtype=np.int64), device=device)

    cu = as_long(bounds)
    maps_index = final_index = None
    if kernel_config is not None:  # from the host bounds: no device read-back
        maps_index = prepare_gdn_index(bounds, inner, [lengths[s] for s in inner], chunk_size, device=device,
                                       config=kernel_config)
        final_index = prepare_gdn_index(bounds, e_seg, e_off, chunk_size, device=device, config=kernel_config)
    return SegmentPlan(chunk_size=chunk_size, cu_segments=cu, inner_seq=tuple(inner),
                       inner_len=tuple(lengths[s] for s in inner), step_select=tuple(map(as_long, select)),
                       step_inner=tuple(map(as_long, via)), start_order=as_long(start_order),
                       export_seg=tuple(e_seg), export_off=tuple(e_off), maps_index=maps_index,
                       final_index=final_index)


def segmented_gated_delta_rule(q, k, v, g, beta, *, scale, initial_state, plan: SegmentPlan,
                               use_qk_l2norm=False, kernel=chunk_gated_delta_rule):
    """`kernel`'s contract (docs/INTERFACES.md section 4) over `plan`'s segments: (o [R, HV, V], exported
    [E, HV, K, V] fp32) for the call the plan was built from. `kernel`: chunk_gated_delta_rule or its
    reference (the plan's Triton indices are passed to the former only)."""
    rows, heads, k_dim, v_dim = v.shape[0], v.shape[1], k.shape[2], v.shape[2]
    n_segments = plan.cu_segments.numel() - 1
    triton_kernel = kernel is chunk_gated_delta_rule

    def call(values, start, export_seq, export_offset, index):
        extra = {"index": index} if triton_kernel and index is not None else {}
        return kernel(q, k, values, g, beta, scale=scale, initial_state=start, cu_seqlens=plan.cu_segments,
                      export_seq=torch.as_tensor(export_seq, dtype=torch.long),
                      export_offset=torch.as_tensor(export_offset, dtype=torch.long),
                      chunk_size=plan.chunk_size, use_qk_l2norm=use_qk_l2norm, **extra)

    state = initial_state  # fp32 (fp64 for fp64 references): maps and states compose in its precision
    if plan.inner_seq:
        zero = state.new_zeros(n_segments, heads, k_dim, v_dim)
        _, ends = call(v, zero, plan.inner_seq, plan.inner_len, plan.maps_index)          # b_j
        eye = torch.eye(k_dim, device=v.device, dtype=state.dtype).expand(n_segments, heads, k_dim, k_dim)
        _, maps = call(v.new_zeros(rows, heads, k_dim), eye, plan.inner_seq, plan.inner_len, plan.maps_index)
        ends, maps = ends.to(state.dtype), maps.to(state.dtype)
        by_position = [state]
        for select, via in zip(plan.step_select, plan.step_inner):
            by_position.append(torch.matmul(maps[via], by_position[-1][select]) + ends[via])
        starts = torch.cat(by_position)[plan.start_order]
    else:
        starts = state
    return call(v, starts, plan.export_seg, plan.export_off, plan.final_index)
