"""`moe_combine`: the Triton kernels for 16-bit CUDA tensors, the plain-torch reference everywhere else."""
from __future__ import annotations

import torch
import triton

from .kernels import _combine_bwd_kernel, _combine_fwd_kernel, launch
from .reference import SHARED_MODES, moe_combine_reference, shared_mode


def triton_supports(hidden: torch.Tensor, shared: torch.Tensor | None = None,
                    shared_logit: torch.Tensor | None = None) -> bool:
    """16-bit hidden on CUDA with the shared output and gate logit of its dtype (the routing weights may be
    wider: Kimi's router returns fp32; the kernels read them as fp32 either way). fp32 / fp64 runs keep the
    reference, whose arithmetic the CPU checks against transformers use."""
    same = all(t is None or t.dtype == hidden.dtype for t in (shared, shared_logit))
    return hidden.is_cuda and same and hidden.dtype in (torch.bfloat16, torch.float16)


class MoECombineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, position, weight, shared, shared_logit):
        mode = SHARED_MODES.index(shared_mode(shared, shared_logit))
        tokens, top_k = position.shape
        hidden_dim = hidden.shape[-1]
        hidden, position, weight = hidden.contiguous(), position.contiguous(), weight.contiguous()
        shared = shared.contiguous() if shared is not None else None
        logit = shared_logit.reshape(tokens).contiguous() if shared_logit is not None else None
        y = torch.empty(tokens, hidden_dim, device=hidden.device, dtype=hidden.dtype)
        block_h, warps = launch(hidden_dim)
        if tokens:
            _combine_fwd_kernel[(tokens,)](
                hidden, position, weight, shared if shared is not None else y, logit if logit is not None else y,
                y, hidden_dim, TOP_K=top_k, MODE=mode, BLOCK_H=block_h, num_warps=warps)
        ctx.save_for_backward(hidden, position, weight, shared, logit)
        ctx.mode, ctx.logit_shape = mode, shared_logit.shape if shared_logit is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        hidden, position, weight, shared, logit = ctx.saved_tensors
        tokens, top_k = position.shape
        hidden_dim = hidden.shape[-1]
        dy = dy.contiguous()
        # every sorted row belongs to exactly one (token, slot) and is written by it
        d_hidden = torch.empty_like(hidden)
        d_weight = torch.empty_like(weight)
        d_shared = torch.empty_like(shared) if shared is not None else None
        d_logit = torch.empty_like(logit) if logit is not None else None
        block_h, warps = launch(hidden_dim)
        if tokens:
            _combine_bwd_kernel[(tokens,)](
                dy, hidden, position, weight, shared if shared is not None else dy,
                logit if logit is not None else dy, d_hidden, d_weight,
                d_shared if d_shared is not None else dy, d_logit if d_logit is not None else dy, hidden_dim,
                TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), MODE=ctx.mode, BLOCK_H=block_h,
                num_warps=warps)
        if d_logit is not None:
            d_logit = d_logit.reshape(ctx.logit_shape)
        return d_hidden, None, d_weight, d_shared, d_logit


class MoEDispatchFunction(torch.autograd.Function):
    """x [T, H] -> its rows in expert order, x[token_of] [T*k, H]; backward dx_t = sum_j g[position_tj] in slot
    order (the unweighted combine pass): every token reads its k rows, nothing is sorted or scattered."""

    @staticmethod
    def forward(ctx, x, token_of, position):
        ctx.save_for_backward(position)
        return x.index_select(0, token_of)

    @staticmethod
    def backward(ctx, g):
        (position,) = ctx.saved_tensors
        tokens, top_k = position.shape
        hidden_dim = g.shape[-1]
        g = g.contiguous()
        dx = torch.empty(tokens, hidden_dim, device=g.device, dtype=g.dtype)
        block_h, warps = launch(hidden_dim)
        if tokens:
            _combine_fwd_kernel[(tokens,)](g, position, g, g, g, dx, hidden_dim, TOP_K=top_k,
                                           MODE=SHARED_MODES.index("none"), BLOCK_H=block_h, WEIGHTED=False,
                                           num_warps=warps)
        return dx, None, None


def moe_dispatch(x: torch.Tensor, token_of: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """x[token_of]: each token's row once per routed slot, sorted by expert (`runtime.moe.ExpertRouting`). On
    16-bit CUDA tensors its backward is the gather-sum above; elsewhere torch's indexing (the reference)."""
    if not triton_supports(x):
        return x[token_of]
    return MoEDispatchFunction.apply(x, token_of, position.contiguous())


def moe_combine(hidden: torch.Tensor, position: torch.Tensor, weight: torch.Tensor,
                shared: torch.Tensor | None = None, shared_logit: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H] = sum_j weight[t, j] hidden[position[t, j]] + the shared term (`reference` module docstring): the
    Triton kernels where `triton_supports` admits the inputs, `moe_combine_reference` otherwise."""
    if not triton_supports(hidden, shared, shared_logit):
        return moe_combine_reference(hidden, position, weight, shared, shared_logit)
    return MoECombineFunction.apply(hidden, position, weight, shared, shared_logit)
