"""Plain-torch Kimi Delta Attention (KDA): the chunkwise algorithm and a token loop, GDN's contract.

KDA is the gated delta rule with a decay per key channel: g is [R, HV, K] (log decays <= 0), and per token

    S <- diag(exp(g_t)) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T (scale q_t)

The GDN scalar gate is the special case of g equal over K. Both functions here take the arguments and return
the outputs of `chunk_gdn.chunk_gated_delta_rule_reference` (packed varlen rows by `cu_seqlens`, chunks aligned
to each sequence start, one initial state per sequence, states exported at chunk-aligned offsets as ordinary
autograd outputs), so `chunk_gdn.plan_gated_delta_rule_reference(..., kernel=...)` runs a microbatch's rounds
(`TreeGDNPlan`) with them unchanged; `plan_kimi_delta_attention_reference` is that call.

The chunked form follows transformers' `chunk_kimi_delta_attention` operation by operation (per-channel
cumulative gates, decay tensor [C, C, K], forward substitution for the WY inverse), computing in fp64 for fp64
inputs and fp32 otherwise.
"""
from __future__ import annotations

import torch

from ..chunk_gdn.inputs import validate_gdn_inputs
from ..chunk_gdn.reference import (
    _chunk_row_index,
    _compute_dtype,
    _prepare_qk,
    _to_chunks,
    chunk_scan,
    plan_gated_delta_rule_reference,
    token_loop,
    unit_lower_inverse,
)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, written as transformers' KDA (and fla) write it."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def check_kda_gate(q, v, g, *, who: str) -> None:
    """g must be [R, HV, K]: one log decay per row, value head and key channel (`who` names the caller)."""
    if not isinstance(g, torch.Tensor) or g.dim() != 3 or g.shape[0] != v.shape[0] or g.shape[1] != v.shape[1] \
            or g.shape[2] != q.shape[-1]:
        shape = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
        raise ValueError(f"{who}: `g` has shape {shape}, expected "
                         f"[{v.shape[0]}, {v.shape[1]}, {q.shape[-1]}] (rows, value heads, key dim)")


def validate_kda_inputs(q, k, v, g, beta, **kwargs):
    """GDN's checks, with g [R, HV, K] (one log decay per key channel) instead of [R, HV]."""
    check_kda_gate(q, v, g, who="chunk_kimi_delta_attention")
    return validate_gdn_inputs(q, k, v, g[..., 0], beta, **kwargs)


def chunk_kimi_delta_attention_reference(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, export_seq=None,
                                         export_offset=None, chunk_size=64, use_qk_l2norm=False):
    """Chunkwise KDA; returns (o [R, HV, V] in v's dtype, exported [E, HV, K, V] fp32/fp64)."""
    shapes = validate_kda_inputs(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                 export_seq=export_seq, export_offset=export_offset, chunk_size=chunk_size)
    dtype = _compute_dtype(q)
    C = chunk_size
    q, k = _prepare_qk(q, k, shapes, scale, use_qk_l2norm, dtype, norm=l2norm)
    index, chunk_seq, chunk_pos = _chunk_row_index(shapes, C, q.device)
    n_chunks = index.shape[0]
    state = initial_state.to(dtype)
    if n_chunks == 0:
        return v.new_zeros(v.shape), state.new_zeros((0,) + state.shape[1:])

    # [NC, H, C, D] / [NC, H, C]; padding rows are zero (k = v = beta = 0 and g = 0 change nothing)
    q_c, k_c, v_c, g_c = (_to_chunks(x.to(dtype), index) for x in (q, k, v, g))
    beta_c = _to_chunks(beta.to(dtype), index)

    # Phase 1, per chunk, independent of the state (transformers' operations, per key channel).
    g_cum = g_c.cumsum(dim=-2)  # [NC, H, C, K]
    strictly_upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    # decay[i, j, :] = exp(gc_i - gc_j) for j <= i, 0 above the diagonal
    decay = (g_cum.unsqueeze(-2) - g_cum.unsqueeze(-3)).masked_fill(strictly_upper[..., None], float("-inf")).exp()
    k_beta = k_c * beta_c.unsqueeze(-1)
    v_beta = v_c * beta_c.unsqueeze(-1)
    ut_system = (k_beta.unsqueeze(-2) * k_c.unsqueeze(-3) * decay).sum(-1)
    intra_attn = (q_c.unsqueeze(-2) * k_c.unsqueeze(-3) * decay).sum(-1).masked_fill(strictly_upper, 0)
    wy = unit_lower_inverse(ut_system)
    new_values = wy @ v_beta
    k_cumdecay = wy @ (k_beta * g_cum.exp())
    q_decayed = q_c * g_cum.exp()
    k_to_end = k_c * (g_cum[..., -1:, :] - g_cum).exp()
    chunk_decay = g_cum[..., -1, :].exp()[..., :, None]  # [NC, H, K, 1]: scales the state's rows

    return chunk_scan(state, chunk_seq, chunk_pos, index, shapes, new_values=new_values, k_cumdecay=k_cumdecay,
                      q_decayed=q_decayed, intra_attn=intra_attn, k_to_end=k_to_end, chunk_decay=chunk_decay,
                      out_dtype=v.dtype)


def recurrent_kimi_delta_attention_reference(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, export_seq=None,
                                             export_offset=None, chunk_size=64, use_qk_l2norm=False):
    """Token-by-token loop of the same rule (the oracle of the chunked form); same signature and outputs."""
    shapes = validate_kda_inputs(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                 export_seq=export_seq, export_offset=export_offset, chunk_size=chunk_size)
    q, k = _prepare_qk(q, k, shapes, scale, use_qk_l2norm, _compute_dtype(q), norm=l2norm)
    return token_loop(q, k, v, g, beta, initial_state, shapes, chunk_size)


def plan_kimi_delta_attention_reference(q, k, v, g, beta, *, scale, plan, initial_states=None, use_qk_l2norm=False,
                                        state_dtype=None, kernel=chunk_kimi_delta_attention_reference):
    """KDA over a `TreeGDNPlan` (every round of a microbatch) in plain torch: GDN's plan runner with a KDA kernel,
    so replay, state hand-offs, exports and gradient routing are literally the same code for both rules."""
    return plan_gated_delta_rule_reference(q, k, v, g, beta, scale=scale, plan=plan, initial_states=initial_states,
                                           use_qk_l2norm=use_qk_l2norm, state_dtype=state_dtype, kernel=kernel)
