"""Fused l2 normalisation of q/k rows (x / sqrt(sum x^2 + 1e-6), in fp32, output in x's dtype).

One read and one write per pass instead of the ~6 elementwise passes of the torch expression,
which cost as much as the chunk kernels' own traffic at 32k tokens.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..scaled16 import ScaledRows, _load_scaled, kernel_pointers

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
def _dy_row(dy, dy_inv, r, o_d, m_r, D: tl.constexpr, SCALED: tl.constexpr, NB: tl.constexpr):
    """[BR, D] fp32: rows r of dy (block-scaled fp16 with NB blocks a row, inverses dy_inv, when SCALED:
    scaled16.py)."""
    if SCALED:
        if NB == 1:  # one inverse a row, broadcast over it
            return _load_scaled(dy, dy_inv, r[:, None] * D + o_d[None, :], r[:, None], m_r)
        return _load_scaled(dy, dy_inv, r[:, None] * D + o_d[None, :], r[:, None] * NB + (o_d // (D // NB))[None, :],
                            m_r)
    return tl.load(dy + r[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.0).to(tl.float32)


@triton.jit
def _group_rows(dy, dy_inv, rows, o_d, m_r, D: tl.constexpr, G: tl.constexpr, SCALED: tl.constexpr,
                NB: tl.constexpr):
    """[BR, D] fp32: the sum of the G consecutive rows of dy that belong to each of `rows` (value heads h * G + g of
    key head h), added in the order g = 0..G-1."""
    b_dy = _dy_row(dy, dy_inv, rows * G, o_d, m_r, D, SCALED, NB)
    for g in tl.static_range(1, G):
        b_dy += _dy_row(dy, dy_inv, rows * G + g, o_d, m_r, D, SCALED, NB)
    return b_dy


@triton.jit
def _l2norm_bwd_kernel(x, dy, dy_inv, rstd, dx, n_rows, D: tl.constexpr, BR: tl.constexpr, G: tl.constexpr,
                       SCALED: tl.constexpr, NB: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, D)
    m_r = rows < n_rows
    b_x = tl.load(x + rows[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.0).to(tl.float32)
    b_dy = _group_rows(dy, dy_inv, rows, o_d, m_r, D, G, SCALED, NB)
    b_r = tl.load(rstd + rows, mask=m_r, other=0.0)
    b_y = b_x * b_r[:, None]
    b_dx = b_r[:, None] * (b_dy - b_y * tl.sum(b_dy * b_y, 1)[:, None])
    tl.store(dx + rows[:, None] * D + o_d[None, :], b_dx.to(dx.dtype.element_ty), mask=m_r[:, None])


@triton.jit
def _group_sum_kernel(dy, dy_inv, out, n_rows, D: tl.constexpr, BR: tl.constexpr, G: tl.constexpr,
                      SCALED: tl.constexpr, NB: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, D)
    m_r = rows < n_rows
    tl.store(out + rows[:, None] * D + o_d[None, :], _group_rows(dy, dy_inv, rows, o_d, m_r, D, G, SCALED, NB),
             mask=m_r[:, None])


def _dy_pointers(dy) -> dict:
    """The kernels' dy arguments (values, inverses, SCALED, NB) of a gradient given as a tensor or as
    scaled16.ScaledRows."""
    scaled = isinstance(dy, ScaledRows)
    values, inverses = (x.contiguous() for x in kernel_pointers(dy))
    return dict(dy=values, dy_inv=inverses, SCALED=scaled, NB=dy.blocks if scaled else 1)


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


def l2norm_rows_backward(x: torch.Tensor, rstd: torch.Tensor, dy, groups: int = 1) -> torch.Tensor:
    """dx in x's dtype from dy of any dtype (an fp32 dy is used as it is, not rounded to x's dtype first) or
    block-scaled fp16 (scaled16.ScaledRows). With `groups` G, dy holds G rows per row of x (x [T, HK, D],
    dy [T, HK * G, D]: the value heads that read each key head), summed in fp32 in the kernel, in the order of
    `group_sum`."""
    d = x.shape[-1]
    n_rows = x.numel() // d
    dx = torch.empty_like(x)
    if n_rows:
        _l2norm_bwd_kernel[(triton.cdiv(n_rows, BLOCK_ROWS),)](x=x, rstd=rstd, dx=dx, n_rows=n_rows, D=d,
                                                                BR=BLOCK_ROWS, G=groups, **_dy_pointers(dy))
    return dx


def group_sum(dy, groups: int) -> torch.Tensor:
    """[T, HK * G, D] (a tensor or scaled16.ScaledRows) -> [T, HK, D] fp32, each key head's G value-head rows added
    in the order g = 0..G-1 (one read of dy: torch's sum over that strided middle dim ran at about a tenth of the
    bandwidth); a tensor dy itself when G == 1."""
    if groups == 1 and not isinstance(dy, ScaledRows):
        return dy
    pointers = _dy_pointers(dy)
    rows, heads, d = pointers["dy"].shape
    out = torch.empty(rows, heads // groups, d, device=pointers["dy"].device, dtype=torch.float32)
    n_rows = out.numel() // d
    if n_rows:
        _group_sum_kernel[(triton.cdiv(n_rows, BLOCK_ROWS),)](out=out, n_rows=n_rows, D=d, BR=BLOCK_ROWS, G=groups,
                                                               **pointers)
    return out


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
    Normalising inside the Function rather than through L2NormFunction keeps dq, dk finer than q's dtype (fp32,
    or block-scaled fp16) from the chunk kernels through the l2 norm's backward (autograd would round them to q's
    dtype between the two), as fla's in-kernel l2norm does."""
    if not enabled:
        return q, k, ()
    (q_n, q_rstd), (k_n, k_rstd) = l2norm_rows(q), l2norm_rows(k)
    return q_n, k_n, (q, q_rstd, k, k_rstd)  # the callers pass q, k contiguous
