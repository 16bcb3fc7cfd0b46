"""Fused l2 normalisation of q/k rows (x / sqrt(sum x^2 + 1e-6), in fp32, output in x's dtype).

One read and one write per pass instead of the ~6 elementwise passes of the torch expression,
which cost as much as the chunk kernels' own traffic at 32k tokens.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

EPS = 1e-6
BLOCK_ROWS = 16  # rows per program: [16, 128] fp32 tiles at 4 warps


@triton.jit
def _l2norm_fwd_kernel(x, y, rstd, n_rows, eps, D: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, D)
    m_r = rows < n_rows
    b_x = tl.load(x + rows[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.0).to(tl.float32)
    b_r = 1.0 / tl.sqrt(tl.sum(b_x * b_x, 1) + eps)
    tl.store(y + rows[:, None] * D + o_d[None, :], (b_x * b_r[:, None]).to(y.dtype.element_ty), mask=m_r[:, None])
    tl.store(rstd + rows, b_r, mask=m_r)


@triton.jit
def _l2norm_bwd_kernel(x, dy, rstd, dx, n_rows, D: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, D)
    m_r = rows < n_rows
    b_x = tl.load(x + rows[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.0).to(tl.float32)
    b_dy = tl.load(dy + rows[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.0).to(tl.float32)
    b_r = tl.load(rstd + rows, mask=m_r, other=0.0)
    b_y = b_x * b_r[:, None]
    b_dx = b_r[:, None] * (b_dy - b_y * tl.sum(b_dy * b_y, 1)[:, None])
    tl.store(dx + rows[:, None] * D + o_d[None, :], b_dx.to(dx.dtype.element_ty), mask=m_r[:, None])


def l2norm_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y = x / sqrt(sum x^2 + eps) in x's dtype, rstd [rows] fp32) over the last dim (a power of two)."""
    x = x.contiguous()
    d = x.shape[-1]
    n_rows = x.numel() // d
    y = torch.empty_like(x)
    rstd = torch.empty(n_rows, device=x.device, dtype=torch.float32)
    if n_rows:
        _l2norm_fwd_kernel[(triton.cdiv(n_rows, BLOCK_ROWS),)](x, y, rstd, n_rows, EPS, D=d, BR=BLOCK_ROWS)
    return y, rstd


def l2norm_rows_backward(x: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dx in x's dtype from dy of any dtype (an fp32 dy is used as it is, not rounded to x's dtype first)."""
    d = x.shape[-1]
    n_rows = x.numel() // d
    dx = torch.empty_like(x)
    if n_rows:
        _l2norm_bwd_kernel[(triton.cdiv(n_rows, BLOCK_ROWS),)](x, dy.contiguous(), rstd, dx, n_rows, D=d,
                                                                BR=BLOCK_ROWS)
    return dx


class L2NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        y, rstd = l2norm_rows(x)
        ctx.save_for_backward(x, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        return l2norm_rows_backward(*ctx.saved_tensors, dy)


def l2norm_fused(x: torch.Tensor) -> torch.Tensor:
    """Differentiable row l2 norm over the last dim (a power of two) with Triton kernels."""
    return L2NormFunction.apply(x)


def normalize_qk(q: torch.Tensor, k: torch.Tensor, enabled: bool):
    """Inside a chunk Function's forward: (q, k normalised when `enabled`, what the backward needs: raw q, its
    rstd, raw k, its rstd; `tree.input_gradients` takes it).
    Normalising inside the Function rather than through L2NormFunction keeps dq, dk in fp32 from the chunk
    kernels through the l2 norm's backward (autograd would round them to q's dtype between the two), as fla's
    in-kernel l2norm does."""
    if not enabled:
        return q, k, ()
    (q_n, q_rstd), (k_n, k_rstd) = l2norm_rows(q), l2norm_rows(k)
    return q_n, k_n, (q, q_rstd, k, k_rstd)  # the callers pass q, k contiguous
