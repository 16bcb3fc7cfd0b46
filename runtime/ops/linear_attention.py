"""Gated DeltaNet over a plan's rounds (DESIGN.md section 6, docs/INTERFACES.md sections 3-4).

With the Triton kernels on CUDA a tree index runs every round in one autograd Function
(`chunk_gdn/tree.py`), a trajectory-wise index one call without gathers. Otherwise (the plain-torch
reference, an explicit `kernel`, the segmented opt-in), per round: gather the packed rows
(`row_src`, replay rows included) from the compact q/k/v/g/beta, gather every sequence's initial
state from the bank of states exported by earlier rounds (zeros where `init_state == -1`), make one
varlen `chunk_gated_delta_rule` call that also exports the boundary states later rounds start from,
and keep only the own rows' outputs. Everything is an ordinary differentiable gather, so autograd
scatter-adds the replay rows' gradients back onto the ancestors' q/k/v/g/beta and routes
exported-state gradients into the kernel's backward.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from harts_compiler.codegen.index import MicrobatchIndex
from harts_compiler.codegen.kernels.chunk_gdn import (GDNKernelConfig, chunk_gated_delta_rule,
                                                      chunk_gated_delta_rule_reference, prepare_gdn_index)
from harts_compiler.codegen.kernels.chunk_gdn.function import TRITON_CHUNK_SIZE
from harts_compiler.codegen.kernels.chunk_gdn.segmented import (SegmentPlan, needs_segments, plan_segments,
                                                                 segmented_gated_delta_rule)
from harts_compiler.codegen.kernels.chunk_gdn.tree import (TreeGDNPlan, TreeRoundSpec, plan_tree_gdn,
                                                           tree_gated_delta_rule, tree_supported)

# rounds of at most this many sequences may be segmented (TreeModel.gdn_segment_chunks): from 8 sequences
# on, the scans of 16-32 heads already run >= 512 programs
SEGMENT_MAX_SEQUENCES = 8


@dataclasses.dataclass
class LinearRoundsPlan:
    """Per-forward gather indices derived once from the index and shared by every GDN layer."""

    init_slot: list[torch.Tensor]  # per round [N]: row of the stacked state list (0 = the zero state)
    restore: torch.Tensor  # [T]: row of cat(own outputs of all rounds) holding compact token t
    identity: bool  # one round whose packed rows are exactly the compact tokens in order (trajectory-wise)
    kernel_index: list | None  # Triton opted in on CUDA: per round the kernel's launch index, shared by all layers
    segments: list | None = None  # per round a SegmentPlan where long sequences are cut (opt-in), else None
    tree: TreeGDNPlan | None = None  # Triton on CUDA, a tree index: every round in one autograd Function


def _is_identity_round(index: MicrobatchIndex) -> torch.Tensor:
    """0-d bool on the index's device: a single round whose packed rows, own rows and own tokens are
    all 0..T-1 in order (the trajectory-wise index), so the rounds need no gather or scatter."""
    T = index.num_tokens
    if len(index.rounds) != 1 or not index.rounds[0].row_src.numel() == index.rounds[0].own_rows.numel() == T:
        return torch.zeros((), dtype=torch.bool, device=index.device)
    rnd = index.rounds[0]
    order = torch.arange(T, device=index.device)
    return (rnd.row_src == order).all() & (rnd.own_rows == order).all() & (rnd.own_dst == order).all()


def plan_linear_rounds(index: MicrobatchIndex, *, use_triton: bool = True, segment_chunks: int | None = None,
                       gdn_config: GDNKernelConfig | None = None) -> LinearRoundsPlan:
    """Bank ids -> rows of the list [zero state, exports of round 0, exports of round 1, ...].

    The slot of every bank id is known from the export sizes (shapes). One host transfer per forward
    both rejects a plan whose sequence starts from a state no earlier round exported and detects the
    trajectory-wise (identity) layout. `gdn_config`: the Triton kernels' launch configuration.
    """
    device = index.device
    slot_of_bank = torch.full((max(index.num_states, 1),), -1, dtype=torch.long, device=device)
    offset, available = 1, []
    for rnd in index.rounds:
        available.append(offset)  # slots [0, offset) exist when this round starts
        n_exports = rnd.export_bank.numel()
        if n_exports:
            slot_of_bank[rnd.export_bank] = torch.arange(offset, offset + n_exports, device=device)
        offset += n_exports
    init_slot = [torch.where(rnd.init_state >= 0, slot_of_bank[rnd.init_state.clamp(min=0)],
                             torch.zeros_like(rnd.init_state)) for rnd in index.rounds]
    own_dst = torch.cat([rnd.own_dst for rnd in index.rounds])
    restore = torch.empty_like(own_dst)
    restore[own_dst] = torch.arange(own_dst.numel(), device=device)
    # every per-round flag is reduced on the device and read back in ONE host transfer per forward
    late_flags = [((slots < 0) | (slots >= limit)).any() for slots, limit in zip(init_slot, available)]
    flags = torch.stack(late_flags + [_is_identity_round(index)]).tolist() if index.rounds else []
    late = [r for r, is_late in enumerate(flags[:-1]) if is_late]
    if late:
        raise ValueError(f"MicrobatchIndex.rounds[{late[0]}].init_state: a sequence starts from a bank state that "
                         "no earlier round exports")
    kernel_index = None
    identity = bool(flags and flags[-1])
    triton = use_triton and device.type == "cuda" and index.chunk_size == TRITON_CHUNK_SIZE
    if triton and not identity and not segment_chunks:
        return LinearRoundsPlan(init_slot=init_slot, restore=restore, identity=False, kernel_index=None,
                                tree=plan_tree_gdn(tree_round_specs(index), index.num_tokens,
                                                   chunk_size=index.chunk_size, device=device, config=gdn_config))
    if triton:
        kernel_index = [prepare_gdn_index(rnd.cu_seqlens, rnd.export_seq, rnd.export_offset, index.chunk_size,
                                          device=device, config=gdn_config) for rnd in index.rounds]
    segments = None
    if segment_chunks:
        segments = [_round_segments(rnd, None if kernel_index is None else kernel_index[r], segment_chunks,
                                    index.chunk_size, device) for r, rnd in enumerate(index.rounds)]
    return LinearRoundsPlan(init_slot=init_slot, restore=restore, identity=identity,
                            kernel_index=kernel_index, segments=segments)


def tree_round_specs(index: MicrobatchIndex) -> list[TreeRoundSpec]:
    """The index's rounds on the host, for `plan_tree_gdn` (one copy per microbatch, shared by all layers)."""
    fields = [f.name for f in dataclasses.fields(TreeRoundSpec)]
    return [TreeRoundSpec(**{name: getattr(rnd, name).cpu().numpy() for name in fields}) for rnd in index.rounds]


def _round_segments(rnd, kernel_index, segment_chunks: int, chunk_size: int, device) -> SegmentPlan | None:
    """A SegmentPlan for a round of few sequences of which one is longer than `segment_chunks` chunks."""
    if rnd.cu_seqlens.numel() - 1 > SEGMENT_MAX_SEQUENCES:  # a shape: no device read-back
        return None
    if kernel_index is not None:  # host copies already made for the launch index
        lengths, e_seq, e_off = kernel_index.seq_lengths, kernel_index.export_seq, kernel_index.export_offset
    else:
        lengths = torch.diff(rnd.cu_seqlens).tolist()
        e_seq, e_off = rnd.export_seq.tolist(), rnd.export_offset.tolist()
    if not needs_segments(lengths, segment_chunks, chunk_size):
        return None
    config = None if kernel_index is None else kernel_index.config
    return plan_segments(lengths, e_seq, e_off, segment_chunks=segment_chunks, chunk_size=chunk_size,
                         device=device, kernel_config=config)


def _default_kernel(q: torch.Tensor, plan: LinearRoundsPlan, round_id: int):
    """Triton kernels with the prepared launch index when opted in on CUDA; else the plain torch reference (the
    wrapper would run Triton's interpreter whenever TRITON_INTERPRET=1, far too slow for a model)."""
    triton = q.is_cuda and plan.kernel_index is not None  # bf16/fp16 on CUDA (TreeModel.triton_linear_attention)
    if plan.segments is not None and plan.segments[round_id] is not None:
        return functools.partial(_segmented_call, plan=plan.segments[round_id],
                                 kernel=chunk_gated_delta_rule if triton else chunk_gated_delta_rule_reference)
    if triton:
        return functools.partial(chunk_gated_delta_rule, index=plan.kernel_index[round_id])
    return chunk_gated_delta_rule_reference


def _segmented_call(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, export_seq, export_offset, chunk_size,
                    use_qk_l2norm, plan: SegmentPlan, kernel):
    """The kernel signature over a round's SegmentPlan (which already holds its bounds and exports)."""
    return segmented_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state, plan=plan,
                                      use_qk_l2norm=use_qk_l2norm, kernel=kernel)


def gated_delta_rule_rounds(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, index: MicrobatchIndex, plan: LinearRoundsPlan, *,
                            scale: float, state_dtype: torch.dtype, use_qk_l2norm: bool = True,
                            kernel=None) -> torch.Tensor:
    """Compact q, k [T, HK, K], v [T, HV, V], g, beta [T, HV] -> o [T, HV, V] (dtype of v).

    `kernel` defaults to the tree Function (or, per round, `chunk_gated_delta_rule`) when the plan opted
    in to Triton on CUDA and the kernels run these inputs, else to the plain torch reference; tests pass
    the recurrent reference here.
    """
    if kernel is None and plan.tree is not None and tree_supported(q, k, v):
        return tree_gated_delta_rule(q, k, v, g, beta, scale=scale, plan=plan.tree, use_qk_l2norm=use_qk_l2norm)
    heads, k_dim, v_dim = v.shape[1], k.shape[2], v.shape[2]
    states = [torch.zeros((1, heads, k_dim, v_dim), dtype=state_dtype, device=v.device)]
    outputs = []
    for round_id, (rnd, init_slot) in enumerate(zip(index.rounds, plan.init_slot)):
        call = kernel if kernel is not None else _default_kernel(q, plan, round_id)
        bank = torch.cat(states) if len(states) > 1 else states[0]
        if plan.identity:  # trajectory-wise index: no gather/scatter needed
            rows_q, rows_k, rows_v, rows_g, rows_beta = q, k, v, g, beta
        else:
            src = rnd.row_src
            rows_q, rows_k, rows_v, rows_g, rows_beta = q[src], k[src], v[src], g[src], beta[src]
        out, exported = call(rows_q, rows_k, rows_v, rows_g, rows_beta, scale=scale,
                             initial_state=bank[init_slot], cu_seqlens=rnd.cu_seqlens,
                             export_seq=rnd.export_seq, export_offset=rnd.export_offset,
                             chunk_size=index.chunk_size, use_qk_l2norm=use_qk_l2norm)
        states.append(exported.to(state_dtype))
        outputs.append(out if plan.identity else out[rnd.own_rows])
    if plan.identity:
        return outputs[0]
    return torch.cat(outputs)[plan.restore]
