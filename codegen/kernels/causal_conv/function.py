"""Triton tree-aware short causal conv: forward, and a deterministic backward (no atomics).

Forward, per [BT rows, BC channels] tile: acc = sum_j w[:, j] x[pred[i, j]] + w[:, W-1] x[i] in fp32, taps
in order j = 0 .. W-2 then the token itself (one fixed order, so tree and trajectory rows with the same
taps give the same bits); y = act(acc) in weight's dtype.
Backward: gpre = dy * act'(acc) (recomputed); dweight from per-tile partial sums reduced in a fixed order;
dx[m] = gpre[m] w[:, W-1] + sum over the rows i that read m at tap j of gpre[i] w[:, j], walking a
successor list sorted by (m, i, j) that `prepare_conv_index` builds once per microbatch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from ..interpreter_safe import interpreting
from ..upload import to_device
from .reference import check_conv_inputs, tree_causal_conv_reference

BLOCK_T, BLOCK_C = 32, 64


@dataclass(frozen=True)
class ConvIndex:
    """Who reads whom: successors of every token, sorted by (token, reading row, tap). Host numpy arrays
    until uploaded with the launch plan (`upload.to_device`)."""
    succ_ptr: np.ndarray     # [T+1] int64
    succ_flat: np.ndarray    # [S] int64, i * (W-1) + j: row i reads token m at tap j
    block_degree: np.ndarray  # [cdiv(T, BLOCK_T)] int64: most successors of a token in each block of BLOCK_T rows
    rows: int
    taps: int                # W - 1
    max_degree: int          # most successors of one token

    @property
    def succ_row(self):
        return self.succ_flat // self.taps

    @property
    def succ_tap(self):
        return self.succ_flat % self.taps


def prepare_conv_index(conv_pred) -> ConvIndex:
    """Successor lists of `conv_pred` [T, W-1] (host array; built once per microbatch). O(T W log T)."""
    pred_table = np.asarray(conv_pred.cpu() if hasattr(conv_pred, "cpu") else conv_pred, dtype=np.int64)
    rows, taps = pred_table.shape
    pred = pred_table.reshape(-1)
    flat = np.arange(pred.size, dtype=np.int64)
    valid = pred >= 0
    src, flat = pred[valid], flat[valid]
    order = np.argsort(src * (rows * taps + 1) + flat, kind="stable")  # by (token, flat = i * taps + j)
    counts = np.bincount(src, minlength=rows)
    ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    # the dx kernel's loop bound per row block: a branch token read by a hundred children would otherwise make
    # every block of the microbatch walk a hundred masked successors
    blocks = -(-rows // BLOCK_T)
    padded = np.zeros(blocks * BLOCK_T, np.int64)
    padded[:rows] = counts
    return ConvIndex(succ_ptr=ptr, succ_flat=flat[order], block_degree=padded.reshape(blocks, BLOCK_T).max(1),
                     rows=rows, taps=taps, max_degree=int(counts.max()) if rows else 0)


@triton.jit
def _conv_pre(x, w, pred, rows, cols, m_r, m_c, Ch, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """fp32 pre-activation of a [BT, BC] tile."""
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W - 1):
        p = tl.load(pred + rows * (W - 1) + j, mask=m_r, other=-1).to(tl.int64)
        b_x = tl.load(x + p[:, None] * Ch + cols[None, :], mask=(p >= 0)[:, None] & m_c[None, :], other=0.0)
        b_w = tl.load(w + cols * W + j, mask=m_c, other=0.0).to(tl.float32)
        acc += b_x.to(tl.float32) * b_w[None, :]
    b_x = tl.load(x + rows[:, None] * Ch + cols[None, :], mask=m_r[:, None] & m_c[None, :], other=0.0)
    b_w = tl.load(w + cols * W + (W - 1), mask=m_c, other=0.0).to(tl.float32)
    return acc + b_x.to(tl.float32) * b_w[None, :]


@triton.jit
def _conv_fwd_kernel(x, w, pred, y, T, Ch, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                     SILU: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    m_r, m_c = rows < T, cols < Ch
    acc = _conv_pre(x, w, pred, rows, cols, m_r, m_c, Ch, W, BT, BC)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + rows[:, None] * Ch + cols[None, :], acc.to(y.dtype.element_ty), mask=m_r[:, None] & m_c[None, :])


@triton.jit
def _conv_bwd_pre_kernel(x, w, pred, dy, gpre, dw_part, T, Ch, W: tl.constexpr, BT: tl.constexpr,
                         BC: tl.constexpr, SILU: tl.constexpr):
    """gpre = dy * act'(pre) [T, Ch] fp32, and this tile's dweight partial [Ch, W]."""
    i_t = tl.program_id(0)
    rows = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    m_r, m_c = rows < T, cols < Ch
    m = m_r[:, None] & m_c[None, :]
    b_g = tl.load(dy + rows[:, None] * Ch + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if SILU:
        pre = _conv_pre(x, w, pred, rows, cols, m_r, m_c, Ch, W, BT, BC)
        sig = tl.sigmoid(pre)
        b_g = b_g * sig * (1.0 + pre * (1.0 - sig))
    tl.store(gpre + rows[:, None] * Ch + cols[None, :], b_g, mask=m)
    p_dw = dw_part + i_t.to(tl.int64) * Ch * W + cols * W
    for j in tl.static_range(W - 1):
        p = tl.load(pred + rows * (W - 1) + j, mask=m_r, other=-1).to(tl.int64)
        b_x = tl.load(x + p[:, None] * Ch + cols[None, :], mask=(p >= 0)[:, None] & m_c[None, :], other=0.0)
        tl.store(p_dw + j, tl.sum(b_g * b_x.to(tl.float32), 0), mask=m_c)
    b_x = tl.load(x + rows[:, None] * Ch + cols[None, :], mask=m, other=0.0)
    tl.store(p_dw + (W - 1), tl.sum(b_g * b_x.to(tl.float32), 0), mask=m_c)


@triton.jit
def _conv_dx_successor(w, gpre, succ_flat, acc, start, end, s, cols, m_c, Ch, W: tl.constexpr):
    """Add the s-th successor (row i reading this token at tap j) of every row of the tile."""
    # [BT, 1] row vectors throughout: 1-D ones here failed Triton 3.6's layout pass for sm_90
    e = start + s
    m_e = e < end
    flat = tl.load(succ_flat + e, mask=m_e, other=0)
    i = flat // (W - 1)
    j = flat % (W - 1)
    b_g = tl.load(gpre + i * Ch + cols[None, :], mask=m_e & m_c[None, :], other=0.0)
    b_wj = tl.load(w + cols[None, :] * W + j, mask=m_e & m_c[None, :], other=0.0)
    return acc + b_g * b_wj.to(tl.float32)


@triton.jit
def _conv_bwd_dx_kernel(w, gpre, succ_ptr, succ_flat, block_degree, dx, T, Ch, W: tl.constexpr,
                        BT: tl.constexpr, BC: tl.constexpr, INTERPRET: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    m_r, m_c = rows < T, cols < Ch
    m = m_r[:, None] & m_c[None, :]
    b_w = tl.load(w + cols * W + (W - 1), mask=m_c, other=0.0).to(tl.float32)
    acc = tl.load(gpre + rows[:, None] * Ch + cols[None, :], mask=m, other=0.0) * b_w[None, :]
    start = tl.load(succ_ptr + rows[:, None], mask=m_r[:, None], other=0)
    end = tl.load(succ_ptr + rows[:, None] + 1, mask=m_r[:, None], other=0)
    max_deg = tl.load(block_degree + tl.program_id(0))
    if INTERPRET:  # the CPU interpreter cannot take a runtime bound in range() (numpy >= 2.4)
        s = max_deg * 0
        while s < max_deg:
            acc = _conv_dx_successor(w, gpre, succ_flat, acc, start, end, s, cols, m_c, Ch, W)
            s += 1
    else:  # and Triton 3.6 fails to compile this while loop for sm_90 (layout conversion pass)
        for s in range(0, max_deg):
            acc = _conv_dx_successor(w, gpre, succ_flat, acc, start, end, s, cols, m_c, Ch, W)
    tl.store(dx + rows[:, None] * Ch + cols[None, :], acc.to(dx.dtype.element_ty), mask=m)


class TreeCausalConvFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, conv_pred, silu: bool, index: ConvIndex | None):
        x, weight, conv_pred = x.contiguous(), weight.contiguous(), conv_pred.contiguous()
        rows, ch = x.shape
        width = weight.shape[1]
        y = torch.empty(rows, ch, device=x.device, dtype=weight.dtype)
        grid = (triton.cdiv(rows, BLOCK_T), triton.cdiv(ch, BLOCK_C))
        if rows:
            _conv_fwd_kernel[grid](x, weight, conv_pred, y, rows, ch, W=width, BT=BLOCK_T, BC=BLOCK_C, SILU=silu)
        ctx.save_for_backward(x, weight, conv_pred)
        ctx.silu, ctx.index = silu, index
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, conv_pred = ctx.saved_tensors
        rows, ch = x.shape
        width = weight.shape[1]
        index = ctx.index
        grid = (triton.cdiv(rows, BLOCK_T), triton.cdiv(ch, BLOCK_C))
        gpre = torch.empty(rows, ch, device=x.device, dtype=torch.float32)
        dw_part = torch.empty(grid[0], ch, width, device=x.device, dtype=torch.float32)
        dx = torch.empty_like(x)
        if rows:
            _conv_bwd_pre_kernel[grid](x, weight, conv_pred, dy.contiguous(), gpre, dw_part, rows, ch, W=width,
                                       BT=BLOCK_T, BC=BLOCK_C, SILU=ctx.silu)
            _conv_bwd_dx_kernel[grid](weight, gpre, index.succ_ptr, index.succ_flat, index.block_degree, dx, rows,
                                      ch, W=width, BT=BLOCK_T, BC=BLOCK_C,
                                      INTERPRET=interpreting())
        dweight = dw_part.sum(0).to(weight.dtype) if rows else torch.zeros_like(weight)
        return dx, dweight, None, None, None


def tree_causal_conv(x: torch.Tensor, weight: torch.Tensor, conv_pred: torch.Tensor, activation: str | None = "silu",
                     *, index: ConvIndex | None = None) -> torch.Tensor:
    """Tree-aware short causal conv (docs/INTERFACES.md section 4): Triton on CUDA or under TRITON_INTERPRET=1,
    the plain-torch reference otherwise. `index`: `prepare_conv_index(conv_pred)` uploaded to x's device (a
    model's launch plan carries it); built here from a host copy of `conv_pred` when not given."""
    check_conv_inputs(x, weight, conv_pred, activation)
    if not (x.is_cuda or interpreting()) or weight.dtype == torch.float64:
        return tree_causal_conv_reference(x, weight, conv_pred, activation)
    if index is None:
        index = to_device(prepare_conv_index(conv_pred), x.device)
    return TreeCausalConvFunction.apply(x, weight, conv_pred, activation == "silu", index)
