"""Forward, chunk-local part: gate cumsum and the WY representation of each chunk.

Per chunk (BT = 64 rows) and value head:
  gc  = in-chunk cumsum of g                                   [BT]     fp32
  A   = strictly_lower( (beta k) k^T * exp(gc_i - gc_j) )      [BT, BT]
  T   = (I + A)^-1                                             [BT, BT] fp32, kept for the backward
  w   = T (beta exp(gc) k),  u = T (beta v)                    [BT, K], [BT, V]
T is built from 16x16 diagonal blocks inverted by forward substitution and merged block by block,
so all dots are small and exact-ish in fp32 (the 64x64 inverse never runs on fp32 CUDA cores).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def unit_lower_inverse16(b_a):
    """(I + b_a)^-1 for a strictly lower [16, 16] fp32 block, by forward substitution over rows."""
    o_i = tl.arange(0, 16)
    b_x = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)
    for r in tl.static_range(1, 16):
        b_row = tl.sum(tl.where(o_i[:, None] == r, b_a, 0.0), 0)            # a[r, m], indexed by m
        b_new = tl.where(o_i == r, 1.0, 0.0) - tl.sum(b_row[:, None] * b_x, 0)
        b_x = tl.where(o_i[:, None] == r, b_new[None, :], b_x)
    return b_x


@triton.jit
def _dot32(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _load_block(k, beta, g, row0, row_end, blk, i_hk, i_h, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr):
    """Rows blk*16 .. +16 of the chunk: k [16, K], beta [16], g [16] (zeros past the sequence end)."""
    o_i = tl.arange(0, 16)
    o_k = tl.arange(0, K)
    rows = row0 + blk * 16 + o_i
    m_r = rows < row_end
    b_k = tl.load(k + rows[:, None] * (HK * K) + i_hk * K + o_k[None, :], mask=m_r[:, None], other=0.0)
    b_b = tl.load(beta + rows * HV + i_h, mask=m_r, other=0.0).to(tl.float32)
    b_g = tl.load(g + rows * HV + i_h, mask=m_r, other=0.0).to(tl.float32)
    return b_k, b_b, b_g


@triton.jit
def _a_block(b_ki, b_bi, b_gi, b_kj, b_gj, DIAG: tl.constexpr):
    """A block (i, j): (beta_i k_i) k_j^T * exp(gc_i - gc_j), strictly lower when on the diagonal."""
    o_i = tl.arange(0, 16)
    b_a = tl.dot((b_ki * b_bi[:, None]).to(b_ki.dtype), tl.trans(b_kj))
    if DIAG:
        m_a = o_i[:, None] > o_i[None, :]
    else:
        m_a = o_i[:, None] >= 0
    return tl.where(m_a, b_a * tl.exp(b_gi[:, None] - b_gj[None, :]), 0.0)


@triton.jit
def _store_t(T, row0, row_end, blk_i, blk_j, b_t, i_h, HV: tl.constexpr, BT: tl.constexpr):
    o_i = tl.arange(0, 16)
    rows = row0 + blk_i * 16 + o_i
    p = T + (rows[:, None] * HV + i_h) * BT + blk_j * 16 + o_i[None, :]
    tl.store(p, b_t, mask=(rows < row_end)[:, None])


@triton.jit
def _apply_row(b_t0, b_t1, b_t2, b_t3, b_x0, b_x1, b_x2, b_x3, NB: tl.constexpr):
    """sum_{j < NB} T_ij x_j for one block row i (T blocks fp32, x blocks in the input dtype)."""
    dt = b_x0.dtype
    b_y = tl.dot(b_t0.to(dt), b_x0)
    if NB > 1:
        b_y += tl.dot(b_t1.to(dt), b_x1)
    if NB > 2:
        b_y += tl.dot(b_t2.to(dt), b_x2)
    if NB > 3:
        b_y += tl.dot(b_t3.to(dt), b_x3)
    return b_y


@triton.jit
def _store_gc(gc, b_g, row0, row_end, blk, i_h, HV: tl.constexpr):
    rows = row0 + blk * 16 + tl.arange(0, 16)
    tl.store(gc + rows * HV + i_h, b_g, mask=rows < row_end)


@triton.jit
def _store_rows(ptr, b_y, row0, row_end, blk, i_h, HV: tl.constexpr, D: tl.constexpr):
    o_i = tl.arange(0, 16)
    o_d = tl.arange(0, D)
    rows = row0 + blk * 16 + o_i
    tl.store(ptr + (rows[:, None] * HV + i_h) * D + o_d[None, :], b_y.to(ptr.dtype.element_ty),
             mask=(rows < row_end)[:, None])


@triton.jit
def _wy_fwd_kernel(k, v, g, beta, gc, T, w, u, chunk_row_start, chunk_row_end,
                   HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // HK)
    row0 = tl.load(chunk_row_start + i_c)
    row_end = tl.load(chunk_row_end + i_c)
    o_i = tl.arange(0, 16)

    b_k0, b_b0, b_g0 = _load_block(k, beta, g, row0, row_end, 0, i_hk, i_h, HK, HV, K)
    b_k1, b_b1, b_g1 = _load_block(k, beta, g, row0, row_end, 1, i_hk, i_h, HK, HV, K)
    b_k2, b_b2, b_g2 = _load_block(k, beta, g, row0, row_end, 2, i_hk, i_h, HK, HV, K)
    b_k3, b_b3, b_g3 = _load_block(k, beta, g, row0, row_end, 3, i_hk, i_h, HK, HV, K)
    # in-chunk cumsum of the gate, 16 rows at a time (stored: every later kernel reads these values)
    b_g0 = tl.cumsum(b_g0, 0)
    b_g1 = tl.cumsum(b_g1, 0) + tl.sum(tl.where(o_i == 15, b_g0, 0.0))
    b_g2 = tl.cumsum(b_g2, 0) + tl.sum(tl.where(o_i == 15, b_g1, 0.0))
    b_g3 = tl.cumsum(b_g3, 0) + tl.sum(tl.where(o_i == 15, b_g2, 0.0))
    _store_gc(gc, b_g0, row0, row_end, 0, i_h, HV)
    _store_gc(gc, b_g1, row0, row_end, 1, i_h, HV)
    _store_gc(gc, b_g2, row0, row_end, 2, i_h, HV)
    _store_gc(gc, b_g3, row0, row_end, 3, i_h, HV)

    # diagonal blocks: forward substitution; off-diagonal: T_ij = -T_ii sum_{j<=m<i} A_im T_mj
    b_t00 = unit_lower_inverse16(_a_block(b_k0, b_b0, b_g0, b_k0, b_g0, True))
    b_t11 = unit_lower_inverse16(_a_block(b_k1, b_b1, b_g1, b_k1, b_g1, True))
    b_t22 = unit_lower_inverse16(_a_block(b_k2, b_b2, b_g2, b_k2, b_g2, True))
    b_t33 = unit_lower_inverse16(_a_block(b_k3, b_b3, b_g3, b_k3, b_g3, True))
    b_a10 = _a_block(b_k1, b_b1, b_g1, b_k0, b_g0, False)
    b_a20 = _a_block(b_k2, b_b2, b_g2, b_k0, b_g0, False)
    b_a21 = _a_block(b_k2, b_b2, b_g2, b_k1, b_g1, False)
    b_a30 = _a_block(b_k3, b_b3, b_g3, b_k0, b_g0, False)
    b_a31 = _a_block(b_k3, b_b3, b_g3, b_k1, b_g1, False)
    b_a32 = _a_block(b_k3, b_b3, b_g3, b_k2, b_g2, False)
    b_t10 = -_dot32(b_t11, _dot32(b_a10, b_t00))
    b_t21 = -_dot32(b_t22, _dot32(b_a21, b_t11))
    b_t20 = -_dot32(b_t22, _dot32(b_a20, b_t00) + _dot32(b_a21, b_t10))
    b_t32 = -_dot32(b_t33, _dot32(b_a32, b_t22))
    b_t31 = -_dot32(b_t33, _dot32(b_a31, b_t11) + _dot32(b_a32, b_t21))
    b_t30 = -_dot32(b_t33, _dot32(b_a30, b_t00) + _dot32(b_a31, b_t10) + _dot32(b_a32, b_t20))

    b_zero = tl.zeros([16, 16], dtype=tl.float32)
    _store_t(T, row0, row_end, 0, 0, b_t00, i_h, HV, BT)
    _store_t(T, row0, row_end, 0, 1, b_zero, i_h, HV, BT)
    _store_t(T, row0, row_end, 0, 2, b_zero, i_h, HV, BT)
    _store_t(T, row0, row_end, 0, 3, b_zero, i_h, HV, BT)
    _store_t(T, row0, row_end, 1, 0, b_t10, i_h, HV, BT)
    _store_t(T, row0, row_end, 1, 1, b_t11, i_h, HV, BT)
    _store_t(T, row0, row_end, 1, 2, b_zero, i_h, HV, BT)
    _store_t(T, row0, row_end, 1, 3, b_zero, i_h, HV, BT)
    _store_t(T, row0, row_end, 2, 0, b_t20, i_h, HV, BT)
    _store_t(T, row0, row_end, 2, 1, b_t21, i_h, HV, BT)
    _store_t(T, row0, row_end, 2, 2, b_t22, i_h, HV, BT)
    _store_t(T, row0, row_end, 2, 3, b_zero, i_h, HV, BT)
    _store_t(T, row0, row_end, 3, 0, b_t30, i_h, HV, BT)
    _store_t(T, row0, row_end, 3, 1, b_t31, i_h, HV, BT)
    _store_t(T, row0, row_end, 3, 2, b_t32, i_h, HV, BT)
    _store_t(T, row0, row_end, 3, 3, b_t33, i_h, HV, BT)

    # w = T (beta exp(gc) k)
    dt = b_k0.dtype
    b_x0 = (b_k0 * (b_b0 * tl.exp(b_g0))[:, None]).to(dt)
    b_x1 = (b_k1 * (b_b1 * tl.exp(b_g1))[:, None]).to(dt)
    b_x2 = (b_k2 * (b_b2 * tl.exp(b_g2))[:, None]).to(dt)
    b_x3 = (b_k3 * (b_b3 * tl.exp(b_g3))[:, None]).to(dt)
    _store_rows(w, _apply_row(b_t00, b_t00, b_t00, b_t00, b_x0, b_x0, b_x0, b_x0, 1), row0, row_end, 0, i_h, HV, K)
    _store_rows(w, _apply_row(b_t10, b_t11, b_t11, b_t11, b_x0, b_x1, b_x1, b_x1, 2), row0, row_end, 1, i_h, HV, K)
    _store_rows(w, _apply_row(b_t20, b_t21, b_t22, b_t22, b_x0, b_x1, b_x2, b_x2, 3), row0, row_end, 2, i_h, HV, K)
    _store_rows(w, _apply_row(b_t30, b_t31, b_t32, b_t33, b_x0, b_x1, b_x2, b_x3, 4), row0, row_end, 3, i_h, HV, K)

    # u = T (beta v)
    o_v = tl.arange(0, V)
    rows = row0 + o_i
    b_y0 = (tl.load(v + (rows[:, None] * HV + i_h) * V + o_v[None, :], mask=(rows < row_end)[:, None], other=0.0)
            * b_b0[:, None]).to(v.dtype.element_ty)
    rows = row0 + 16 + o_i
    b_y1 = (tl.load(v + (rows[:, None] * HV + i_h) * V + o_v[None, :], mask=(rows < row_end)[:, None], other=0.0)
            * b_b1[:, None]).to(v.dtype.element_ty)
    rows = row0 + 32 + o_i
    b_y2 = (tl.load(v + (rows[:, None] * HV + i_h) * V + o_v[None, :], mask=(rows < row_end)[:, None], other=0.0)
            * b_b2[:, None]).to(v.dtype.element_ty)
    rows = row0 + 48 + o_i
    b_y3 = (tl.load(v + (rows[:, None] * HV + i_h) * V + o_v[None, :], mask=(rows < row_end)[:, None], other=0.0)
            * b_b3[:, None]).to(v.dtype.element_ty)
    _store_rows(u, _apply_row(b_t00, b_t00, b_t00, b_t00, b_y0, b_y0, b_y0, b_y0, 1), row0, row_end, 0, i_h, HV, V)
    _store_rows(u, _apply_row(b_t10, b_t11, b_t11, b_t11, b_y0, b_y1, b_y1, b_y1, 2), row0, row_end, 1, i_h, HV, V)
    _store_rows(u, _apply_row(b_t20, b_t21, b_t22, b_t22, b_y0, b_y1, b_y2, b_y2, 3), row0, row_end, 2, i_h, HV, V)
    _store_rows(u, _apply_row(b_t30, b_t31, b_t32, b_t33, b_y0, b_y1, b_y2, b_y3, 4), row0, row_end, 3, i_h, HV, V)


def wy_fwd(k, v, g, beta, index, *, num_warps: int = 4):
    """Returns gc [R, HV] fp32, T [R, HV, BT] fp32, w [R, HV, K] (k's dtype), u [R, HV, V] (v's dtype)."""
    rows, hk, kd = k.shape
    hv, vd = v.shape[1], v.shape[2]
    BT = index.chunk_size
    if BT != 64:
        raise ValueError(f"chunk_gated_delta_rule: the Triton path has chunk_size 64 built in, got {BT}")
    gc = torch.empty(rows, hv, device=k.device, dtype=torch.float32)
    T = torch.empty(rows, hv, BT, device=k.device, dtype=torch.float32)
    w = torch.empty(rows, hv, kd, device=k.device, dtype=k.dtype)
    u = torch.empty(rows, hv, vd, device=k.device, dtype=v.dtype)
    if index.num_chunks:
        _wy_fwd_kernel[(index.num_chunks, hv)](
            k, v, g, beta, gc, T, w, u, index.chunk_row_start, index.chunk_row_end,
            HK=hk, HV=hv, K=kd, V=vd, BT=BT, num_warps=num_warps)
    return gc, T, w, u
