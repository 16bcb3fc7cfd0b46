"""Gated DeltaNet over a plan's rounds (DESIGN.md section 6, docs/INTERFACES.md sections 3-4).

Per round: gather the packed rows (`row_src`, replay rows included) from the compact q/k/v/g/beta,
gather every sequence's initial state from the bank of states exported by earlier rounds (zeros
where `init_state == -1`), make one varlen `chunk_gated_delta_rule` call that also exports the
boundary states later rounds start from, and keep only the own rows' outputs. Everything is an
ordinary differentiable gather, so autograd scatter-adds the replay rows' gradients back onto the
ancestors' q/k/v/g/beta and routes exported-state gradients into the kernel's backward.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from harts_compiler.codegen.index import MicrobatchIndex
from harts_compiler.codegen.kernels.chunk_gdn import (chunk_gated_delta_rule, chunk_gated_delta_rule_reference,
                                                      prepare_gdn_index)
from harts_compiler.codegen.kernels.chunk_gdn.function import TRITON_CHUNK_SIZE


@dataclasses.dataclass
class LinearRoundsPlan:
    """Per-forward gather indices derived once from the index and shared by every GDN layer."""

    init_slot: list[torch.Tensor]  # per round [N]: row of the stacked state list (0 = the zero state)
    restore: torch.Tensor  # [T]: row of cat(own outputs of all rounds) holding compact token t
    identity_rows: list[bool]  # per round: packed rows are exactly the compact tokens in order
    kernel_index: list | None  # Triton opted in on CUDA: per round the kernel's launch index, shared by all layers


def plan_linear_rounds(index: MicrobatchIndex, *, use_triton: bool = True) -> LinearRoundsPlan:
    """Bank ids -> rows of the list [zero state, exports of round 0, exports of round 1, ...].

    The slot of every bank id is known from the export sizes (shapes). One host check per forward
    rejects a plan whose sequence starts from a state no earlier round exported.
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
    late = [r for r, (slots, limit) in enumerate(zip(init_slot, available))
            if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= limit)]
    if late:
        raise ValueError(f"MicrobatchIndex.rounds[{late[0]}].init_state: a sequence starts from a bank state that "
                         "no earlier round exports")
    own_dst = torch.cat([rnd.own_dst for rnd in index.rounds])
    restore = torch.empty_like(own_dst)
    restore[own_dst] = torch.arange(own_dst.numel(), device=device)
    T = index.num_tokens
    identity_rows = [rnd.row_src.numel() == T and rnd.own_rows.numel() == T and len(index.rounds) == 1
                     and bool(torch.equal(rnd.row_src.cpu(), torch.arange(T)))
                     and bool(torch.equal(rnd.own_rows.cpu(), torch.arange(T)))
                     and bool(torch.equal(rnd.own_dst.cpu(), torch.arange(T))) for rnd in index.rounds]
    kernel_index = None
    if use_triton and device.type == "cuda" and index.chunk_size == TRITON_CHUNK_SIZE:
        kernel_index = [prepare_gdn_index(rnd.cu_seqlens, rnd.export_seq, rnd.export_offset, index.chunk_size,
                                          device=device) for rnd in index.rounds]
    return LinearRoundsPlan(init_slot=init_slot, restore=restore, identity_rows=identity_rows,
                            kernel_index=kernel_index)


def _default_kernel(q: torch.Tensor, plan: LinearRoundsPlan, round_id: int):
    """Triton kernels with the prepared launch index when opted in on CUDA; else the plain torch reference (the
    wrapper would run Triton's interpreter whenever TRITON_INTERPRET=1, far too slow for a model)."""
    if q.is_cuda and plan.kernel_index is not None:  # bf16/fp16 on CUDA (TreeModel.triton_linear_attention)
        return functools.partial(chunk_gated_delta_rule, index=plan.kernel_index[round_id])
    return chunk_gated_delta_rule_reference


def gated_delta_rule_rounds(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, index: MicrobatchIndex, plan: LinearRoundsPlan, *,
                            scale: float, state_dtype: torch.dtype, use_qk_l2norm: bool = True,
                            kernel=None) -> torch.Tensor:
    """Compact q, k [T, HK, K], v [T, HV, V], g, beta [T, HV] -> o [T, HV, V] (dtype of v).

    `kernel` defaults to `chunk_gated_delta_rule` when the plan opted in to Triton on CUDA, else to its
    plain torch reference; tests pass the recurrent reference here.
    """
    heads, k_dim, v_dim = v.shape[1], k.shape[2], v.shape[2]
    states = [torch.zeros((1, heads, k_dim, v_dim), dtype=state_dtype, device=v.device)]
    outputs = []
    for round_id, (rnd, init_slot, identity) in enumerate(zip(index.rounds, plan.init_slot, plan.identity_rows)):
        call = kernel if kernel is not None else _default_kernel(q, plan, round_id)
        bank = torch.cat(states) if len(states) > 1 else states[0]
        if identity:  # trajectory-wise index: no gather/scatter needed
            rows_q, rows_k, rows_v, rows_g, rows_beta = q, k, v, g, beta
        else:
            src = rnd.row_src
            rows_q, rows_k, rows_v, rows_g, rows_beta = q[src], k[src], v[src], g[src], beta[src]
        out, exported = call(rows_q, rows_k, rows_v, rows_g, rows_beta, scale=scale,
                             initial_state=bank[init_slot], cu_seqlens=rnd.cu_seqlens,
                             export_seq=rnd.export_seq, export_offset=rnd.export_offset,
                             chunk_size=index.chunk_size, use_qk_l2norm=use_qk_l2norm)
        states.append(exported.to(state_dtype))
        outputs.append(out if identity else out[rnd.own_rows])
    if len(outputs) == 1 and plan.identity_rows[0]:
        return outputs[0]
    return torch.cat(outputs)[plan.restore]
