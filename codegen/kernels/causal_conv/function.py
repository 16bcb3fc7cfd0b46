"""Triton tree-aware short causal conv: forward, and a deterministic backward (no atomics).

The input comes as column parts (a GDN layer's q, k and v projections; strided rows are read in place), the
output as the same parts, each contiguous: the linear-attention kernels read them without a copy. A piece of a
split tree adds carried input rows after its own (`tail`: they are read as taps, their outputs are not
computed) and rows after each output part (`appended`: its carried replay rows, which the rounds read after
the own rows), so neither needs a concatenation of the whole layer.

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
from .reference import check_conv_inputs, tree_causal_conv_parts_reference

# Launch tiles (4 warps; 8 were slower for every tile at the bench GDN shape on the H200):
# the forward streams rows best 128 columns wide; the backward's two kernels prefer taller tiles, which also halve
# dweight's partials. BLOCK_T is also the successor index's row block (the dx kernel's tile).
FWD_BLOCK_T, FWD_BLOCK_C = 32, 128
BLOCK_T, BLOCK_C = 64, 32


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
def _load_rows(x, sx, tail, st, p, cols, T, m_c, HAS_TAIL: tl.constexpr):
    """Rows p [BT, 1] of the conceptual input [own rows; tail rows] (-1: zeros): own rows from x (row stride sx),
    rows p >= T from the carried tail (row stride st)."""
    # [BT, 1] row vectors: a 1-D select here failed Triton 3.6's layout pass for sm_90
    own = (p >= 0) & (p < T)
    b = tl.load(x + p * sx + cols[None, :], mask=own & m_c[None, :], other=0.0).to(tl.float32)
    if HAS_TAIL:  # a constexpr: microbatches without carried rows keep the one load (105 registers, not 162)
        carried = p >= T
        q = tl.where(carried, p - T, 0)
        b += tl.load(tail + q * st + cols[None, :], mask=carried & m_c[None, :], other=0.0).to(tl.float32)
    return b


@triton.jit
def _conv_pre(x, sx, tail, st, w, pred, rows, cols, m_r, m_c, T, W: tl.constexpr, BT: tl.constexpr,
              BC: tl.constexpr, HAS_TAIL: tl.constexpr):
    """fp32 pre-activation of a [BT, BC] tile of own rows."""
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W - 1):
        p = tl.load(pred + rows[:, None] * (W - 1) + j, mask=m_r[:, None], other=-1).to(tl.int64)
        b_w = tl.load(w + cols * W + j, mask=m_c, other=0.0).to(tl.float32)
        acc += _load_rows(x, sx, tail, st, p, cols, T, m_c, HAS_TAIL) * b_w[None, :]
    b_x = tl.load(x + rows[:, None] * sx + cols[None, :], mask=m_r[:, None] & m_c[None, :], other=0.0)
    b_w = tl.load(w + cols * W + (W - 1), mask=m_c, other=0.0).to(tl.float32)
    return acc + b_x.to(tl.float32) * b_w[None, :]


@triton.jit
def _conv_fwd_kernel(x, sx, tail, st, w, pred, y, T, Ch, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                     SILU: tl.constexpr, HAS_TAIL: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    m_r, m_c = rows < T, cols < Ch
    acc = _conv_pre(x, sx, tail, st, w, pred, rows, cols, m_r, m_c, T, W, BT, BC, HAS_TAIL)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + rows[:, None] * Ch + cols[None, :], acc.to(y.dtype.element_ty), mask=m_r[:, None] & m_c[None, :])


@triton.jit
def _conv_bwd_pre_kernel(x, sx, tail, st, w, pred, dy, gpre, dw_part, T, Ch, W: tl.constexpr, BT: tl.constexpr,
                         BC: tl.constexpr, SILU: tl.constexpr, HAS_TAIL: tl.constexpr):
    """gpre = dy * act'(pre) [T, Ch] fp32 over the own rows, and this tile's dweight partial [Ch, W]."""
    i_t = tl.program_id(0)
    rows = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    m_r, m_c = rows < T, cols < Ch
    m = m_r[:, None] & m_c[None, :]
    b_g = tl.load(dy + rows[:, None] * Ch + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if SILU:
        pre = _conv_pre(x, sx, tail, st, w, pred, rows, cols, m_r, m_c, T, W, BT, BC, HAS_TAIL)
        sig = tl.sigmoid(pre)
        b_g = b_g * sig * (1.0 + pre * (1.0 - sig))
    tl.store(gpre + rows[:, None] * Ch + cols[None, :], b_g, mask=m)
    p_dw = dw_part + i_t.to(tl.int64) * Ch * W + cols * W
    for j in tl.static_range(W - 1):
        p = tl.load(pred + rows[:, None] * (W - 1) + j, mask=m_r[:, None], other=-1).to(tl.int64)
        tl.store(p_dw + j, tl.sum(b_g * _load_rows(x, sx, tail, st, p, cols, T, m_c, HAS_TAIL), 0), mask=m_c)
    b_x = tl.load(x + rows[:, None] * sx + cols[None, :], mask=m, other=0.0)
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
def _conv_bwd_dx_kernel(w, gpre, succ_ptr, succ_flat, block_degree, dx, d_tail, st, T, rows_total, Ch,
                        W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, INTERPRET: tl.constexpr,
                        HAS_TAIL: tl.constexpr):
    """dx of the own rows [T, Ch] and d_tail of the carried rows (rows T.. of the successor lists), which have
    no output of their own: only their readers' taps."""
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    m_r, m_c = rows < rows_total, cols < Ch
    own = rows[:, None] < T  # [BT, 1] row vectors, as in _load_rows
    b_w = tl.load(w + cols * W + (W - 1), mask=m_c, other=0.0).to(tl.float32)
    acc = tl.load(gpre + rows[:, None] * Ch + cols[None, :], mask=own & m_c[None, :], other=0.0)
    acc = acc * b_w[None, :]
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
    tl.store(dx + rows[:, None] * Ch + cols[None, :], acc.to(dx.dtype.element_ty), mask=own & m_c[None, :])
    if HAS_TAIL:
        carried = (rows[:, None] >= T) & m_r[:, None]
        q = tl.where(carried, rows[:, None] - T, 0)
        tl.store(d_tail + q * st + cols[None, :], acc.to(d_tail.dtype.element_ty), mask=carried & m_c[None, :])


def _row_stride(x: torch.Tensor) -> torch.Tensor:
    """x with unit column stride (a column slice of a wider matrix stays a view)."""
    return x if x.stride(1) == 1 or x.shape[1] <= 1 else x.contiguous()


class TreeCausalConvFunction(torch.autograd.Function):
    """Inputs: weight, conv_pred, silu, index, the tail (or None), the number of parts, then the parts and the rows
    appended to each output part (or Nones). Returns the output parts."""

    @staticmethod
    def forward(ctx, weight, conv_pred, silu: bool, index: ConvIndex | None, tail, count: int, *tensors):
        parts, appended = [_row_stride(x) for x in tensors[:count]], tensors[count:]
        weight, conv_pred = weight.contiguous(), conv_pred.contiguous()
        rows, width = parts[0].shape[0], weight.shape[1]
        tail_rows = tail if tail is not None else weight.new_empty(0, weight.shape[0])
        outs, lo = [], 0
        for x, extra in zip(parts, appended):
            ch = x.shape[1]
            y = torch.empty(rows + (extra.shape[0] if extra is not None else 0), ch, device=x.device,
                            dtype=weight.dtype)
            if rows and ch:
                grid = (triton.cdiv(rows, FWD_BLOCK_T), triton.cdiv(ch, FWD_BLOCK_C))
                _conv_fwd_kernel[grid](x, x.stride(0), tail_rows[:, lo:lo + ch], tail_rows.stride(0),
                                       weight[lo:lo + ch], conv_pred, y, rows, ch, W=width, BT=FWD_BLOCK_T,
                                       BC=FWD_BLOCK_C, SILU=silu, HAS_TAIL=tail is not None)
            if extra is not None:
                y[rows:] = extra
            outs.append(y)
            lo += ch
        ctx.save_for_backward(weight, conv_pred, tail_rows, *parts)
        ctx.silu, ctx.index, ctx.has_tail = silu, index, tail is not None
        ctx.appended = [extra.shape[0] if extra is not None else None for extra in appended]  # rows per part
        return tuple(outs)

    @staticmethod
    def backward(ctx, *douts):
        weight, conv_pred, tail_rows, *parts = ctx.saved_tensors
        rows, width = parts[0].shape[0], weight.shape[1]
        index = ctx.index
        total = index.rows  # own + carried rows
        d_tail = torch.empty_like(tail_rows) if ctx.has_tail else None
        dparts, dweights, dappended, lo = [], [], [], 0
        for x, dy, extra_rows in zip(parts, douts, ctx.appended):
            ch = x.shape[1]
            if dy is None:  # an output nothing read
                dy = torch.zeros(rows + (extra_rows or 0), ch, device=x.device, dtype=weight.dtype)
            dappended.append(dy[rows:].clone() if extra_rows is not None else None)  # a copy: the carried rows only
            dy = dy[:rows].contiguous()
            blocks = triton.cdiv(rows, BLOCK_T)
            gpre = torch.empty(rows, ch, device=x.device, dtype=torch.float32)
            dw_part = torch.empty(blocks, ch, width, device=x.device, dtype=torch.float32)
            dx = torch.empty(rows, ch, device=x.device, dtype=x.dtype)
            d_tail_part = d_tail[:, lo:lo + ch] if d_tail is not None else dx
            w_part = weight[lo:lo + ch]
            if rows and ch:
                _conv_bwd_pre_kernel[(blocks, triton.cdiv(ch, BLOCK_C))](
                    x, x.stride(0), tail_rows[:, lo:lo + ch], tail_rows.stride(0), w_part, conv_pred, dy, gpre,
                    dw_part, rows, ch, W=width, BT=BLOCK_T, BC=BLOCK_C, SILU=ctx.silu, HAS_TAIL=ctx.has_tail)
            if total and ch:
                _conv_bwd_dx_kernel[(triton.cdiv(total, BLOCK_T), triton.cdiv(ch, BLOCK_C))](
                    w_part, gpre, index.succ_ptr, index.succ_flat, index.block_degree, dx, d_tail_part,
                    d_tail_part.stride(0), rows, total,
                    ch, W=width, BT=BLOCK_T, BC=BLOCK_C, INTERPRET=interpreting(), HAS_TAIL=ctx.has_tail)
            dparts.append(dx)
            dweights.append(dw_part.sum(0) if rows else torch.zeros(ch, width, device=x.device))
            lo += ch
        dweight = torch.cat(dweights).to(weight.dtype)
        return (dweight, None, None, None, d_tail, None, *dparts, *dappended)


def tree_causal_conv(x, weight: torch.Tensor, conv_pred: torch.Tensor, activation: str | None = "silu", *,
                     index: ConvIndex | None = None, tail: torch.Tensor | None = None, appended=None):
    """Tree-aware short causal conv (docs/INTERFACES.md section 4): Triton on CUDA or under TRITON_INTERPRET=1,
    the plain-torch reference otherwise. `x`: [T, Ch], or a list of column parts [T, Ch_i] (then the output is
    the tuple of parts). `tail` [C, Ch]: carried input rows after the own rows (conv_pred has T + C rows and
    indexes them); `appended`: per part, rows to put after its output rows (or None). `index`:
    `prepare_conv_index(conv_pred)` uploaded to x's device (a model's launch plan carries it); built here from a
    host copy of `conv_pred` when not given."""
    single = isinstance(x, torch.Tensor)
    parts = [x] if single else list(x)
    appended = [None] * len(parts) if appended is None else list(appended)
    check_conv_inputs(parts, weight, conv_pred, activation, tail, appended)
    device = parts[0].device
    if not (device.type == "cuda" or interpreting()) or weight.dtype == torch.float64:
        outs = tree_causal_conv_parts_reference(parts, weight, conv_pred, activation, tail, appended)
    else:
        if index is None:
            index = to_device(prepare_conv_index(conv_pred), device)
        outs = TreeCausalConvFunction.apply(weight, conv_pred, activation == "silu", index, tail, len(parts), *parts,
                                            *appended)
    return outs[0] if single else tuple(outs)
