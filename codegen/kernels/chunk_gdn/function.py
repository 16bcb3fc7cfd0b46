"""Autograd Function over the Triton kernels and the public `chunk_gated_delta_rule` wrapper.

Forward:  wy_fwd (gc, T, w, u)  ->  state_fwd (h, v_new, export bank)  ->  output_fwd (o)
Backward: state_bwd (dv_local, reverse scan with injected export gradients -> dh, dvn, dh0)
          -> chunk_bwd (dq, dk, dw, dgc; WY backward -> dk, dv, dbeta, dg)
Every kernel has a fixed launch configuration (no autotuning) and no atomics, so the same chunk with
the same entering state gives the same bits in any packing: tree mode reproduces trajectory mode.
"""
from __future__ import annotations

import torch

from ..interpreter_safe import interpreter_needs_fp32, interpreting
from .chunk_bwd import chunk_bwd
from .index import GDNIndex, prepare_gdn_index
from .inputs import validate_gdn_inputs
from .l2norm import l2norm_fused
from .reference import chunk_gated_delta_rule_reference
from .state_bwd import state_bwd
from .state_fwd import output_fwd, state_fwd
from .wy_fwd import wy_fwd

TRITON_CHUNK_SIZE = 64


def _group_sum(x: torch.Tensor, key_heads: int) -> torch.Tensor:
    """[R, HV, K] per value head -> [R, HK, K]: value head h reads key head h // (HV // HK)."""
    rows, hv, kd = x.shape
    if hv == key_heads:
        return x
    return x.view(rows, key_heads, hv // key_heads, kd).sum(2)


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale: float, index: GDNIndex):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        g, beta = g.contiguous(), beta.contiguous()
        h0 = initial_state.to(torch.float32).contiguous()
        gc, T, w, u = wy_fwd(k, v, g, beta, index)
        h, v_new, bank = state_fwd(k, w, u, gc, h0, index)
        o = output_fwd(q, k, v_new, gc, h, scale, index)
        exported = bank[index.export_slot]
        ctx.save_for_backward(q, k, v, beta, gc, T, w, v_new, h)
        ctx.scale, ctx.index = scale, index
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype, initial_state.dtype)
        return o, exported

    @staticmethod
    def backward(ctx, do, d_exported):
        q, k, v, beta, gc, T, w, v_new, h = ctx.saved_tensors
        index: GDNIndex = ctx.index
        hv, kd, vd = v.shape[1], k.shape[2], v.shape[2]
        do = torch.zeros_like(v) if do is None else do.to(v.dtype).contiguous()
        bank_grad = torch.zeros(index.num_slots, hv, kd, vd, device=q.device, dtype=torch.float32)
        if d_exported is not None and index.num_slots:
            d_exported = d_exported.to(torch.float32)
            if len(index.export_slot_host) == index.num_slots:  # every state requested once: a permutation
                bank_grad[index.export_slot] = d_exported
            else:  # duplicates summed in a fixed order (index_add_ may use atomics on CUDA)
                for e, slot in enumerate(index.export_slot_host):
                    bank_grad[slot] += d_exported[e]
        dh, dvn, dh0 = state_bwd(q, k, w, gc, do, bank_grad, ctx.scale, index, ctx.needs_input_grad[5])
        dq, dk, dv, dbeta, dg = chunk_bwd(q, k, v, beta, gc, T, v_new, h, dh, do, dvn, ctx.scale, index)
        q_dt, k_dt, v_dt, g_dt, beta_dt, h0_dt = ctx.dtypes
        hk = q.shape[1]
        return (_group_sum(dq, hk).to(q_dt), _group_sum(dk, hk).to(k_dt), dv.to(v_dt), dg.to(g_dt),
                dbeta.to(beta_dt), dh0.to(h0_dt), None, None)


def _use_triton(q: torch.Tensor) -> bool:
    return q.is_cuda or interpreting()


def _power_of_two(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


# On CUDA the Triton path runs only what passed on the H200 (`bench/gdn_shapes.py`, 2026-11-30): Triton 3.6
# miscompiles some Hopper configurations (GPU.md), and fp32 operands with 16-column heads made the WY
# backward access memory illegally there. Everything else takes the plain-torch reference.
CUDA_DTYPES = (torch.bfloat16, torch.float16)
CUDA_HEAD_DIMS = (64, 128)


def triton_supports(dtype: torch.dtype, key_dim: int, value_dim: int, *, cuda: bool = True) -> bool:
    """Whether the Triton kernels run inputs of `dtype` with these head sizes: on CUDA the validated
    configurations only, under the CPU interpreter any non-fp64 float with power-of-two heads >= 16."""
    if cuda:
        return dtype in CUDA_DTYPES and key_dim in CUDA_HEAD_DIMS and value_dim in CUDA_HEAD_DIMS
    return dtype != torch.float64 and _power_of_two(key_dim) and _power_of_two(value_dim)


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, export_seq=None,
                           export_offset=None, chunk_size=64, use_qk_l2norm=False, index: GDNIndex | None = None):
    """Chunkwise Gated DeltaNet (docs/INTERFACES.md section 4): returns (o [R, HV, V], exported [E, HV, K, V] fp32).

    Runs the Triton kernels on CUDA (or under TRITON_INTERPRET=1) and the plain-torch reference otherwise.
    `index` (from `prepare_gdn_index`) may be built once per microbatch round and shared by all layers; it is
    trusted to describe `cu_seqlens` and the exports (only their sizes are checked, so no device sync per call).
    """
    known = None if index is None else (index.seq_lengths, index.export_seq, index.export_offset)
    shapes = validate_gdn_inputs(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                 export_seq=export_seq, export_offset=export_offset, chunk_size=chunk_size,
                                 known=known)
    triton_ok = (_use_triton(q) and chunk_size == TRITON_CHUNK_SIZE and all(
        triton_supports(x.dtype, shapes.key_dim, shapes.value_dim, cuda=q.is_cuda) for x in (q, k, v)))
    if not triton_ok:
        return chunk_gated_delta_rule_reference(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens, export_seq=export_seq,
            export_offset=export_offset, chunk_size=chunk_size, use_qk_l2norm=use_qk_l2norm)
    if index is None:  # from the validated host values: cu_seqlens and the exports are not read back again
        bounds = [*shapes.seq_starts, shapes.rows]
        index = prepare_gdn_index(bounds, shapes.export_seq, shapes.export_offset, chunk_size, device=q.device)
    elif index.chunk_size != chunk_size:
        raise ValueError(f"chunk_gated_delta_rule: `index` was built for chunk_size {index.chunk_size}, not {chunk_size}")
    return run_triton(q, k, v, g, beta, scale=scale, initial_state=initial_state, index=index,
                      use_qk_l2norm=use_qk_l2norm)


def run_triton(q, k, v, g, beta, *, scale, initial_state, index: GDNIndex, use_qk_l2norm=False):
    """The Triton kernels on checked inputs, whatever `triton_supports` says (bench/gdn_shapes.py probes
    configurations with it)."""
    if any(map(interpreter_needs_fp32, (q, k, v, beta))):  # the interpreter's 16-bit dots are wrong: fp32
        o, exported = run_triton(q.float(), k.float(), v.float(), g, beta.float(), scale=scale,
                                 initial_state=initial_state, index=index, use_qk_l2norm=use_qk_l2norm)
        return o.to(v.dtype), exported
    if use_qk_l2norm:  # in fp32 as transformers and fla do, output in the input dtype
        q, k = l2norm_fused(q), l2norm_fused(k)
    return ChunkGatedDeltaRuleFunction.apply(q, k, v, g, beta, initial_state, float(scale), index)
