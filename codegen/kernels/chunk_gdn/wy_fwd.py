"""Forward, chunk-local part: gate cumsum and the WY representation of each chunk.

Per chunk (BT = 64 rows) and value head:
  gc  = in-chunk cumsum of g                                   [BT]     fp32
  A   = strictly_lower( (beta k) k^T * exp(gc_i - gc_j) )      [BT, BT]
  T   = (I + A)^-1                                             [BT, BT], kept for the backward
  w   = T (beta exp(gc) k),  u = T (beta v)                    [BT, K], [BT, V]
Two kernels. The first accumulates A's ten lower 16x16 blocks over column blocks of k, inverts the four
diagonal blocks by forward substitution and merges the rest in fp32, all in registers (fla 0.6.0 fuses
its kkt and solve stages the same way), and stores T. The second computes w and u from T.
On the H200 (61k tokens, H=16, K=V=128, bf16) the pair takes 0.79 ms against 1.44 ms for the single
kernel it replaced, which parked A in global memory and held [64, K] tiles of k and k^T at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gates import LOG2E, _chunk_rows, _chunk_shift, _exp_gate_gap, _input_rows
from .index import chunk_shift_table, row_tables


@triton.jit
def _dot32(a, b):
    # three tf32 products on the tensor cores: about fp32's accuracy (T is stored in bf16) at a fraction of the
    # instructions of an "ieee" dot, which runs on the FMA units and spilled at one warp
    return tl.dot(a, b, input_precision="tf32x3")


@triton.jit
def _store_t(T, row0, row_end, blk_i, blk_j, b_t, i_h, HV: tl.constexpr, BT: tl.constexpr):
    o_i = tl.arange(0, 16)
    rows = row0 + blk_i * 16 + o_i
    p = T + (rows[:, None] * HV + i_h) * BT + blk_j * 16 + o_i[None, :]
    tl.store(p, b_t.to(T.dtype.element_ty), mask=(rows < row_end)[:, None])


@triton.jit
def _merge_inverse(b_t00, b_t11, b_t22, b_t33, b_a10, b_a20, b_a21, b_a30, b_a31, b_a32):
    """Off-diagonal 16x16 blocks of T = (I + A)^-1 from the diagonal inverses T_ii and A's blocks below the
    diagonal, in fp32: T_ij = -T_ii sum_{j<=m<i} A_im T_mj, i > j. Returns (t10, t20, t21, t30, t31, t32)."""
    b_t10 = -_dot32(b_t11, _dot32(b_a10, b_t00))
    b_t21 = -_dot32(b_t22, _dot32(b_a21, b_t11))
    b_t20 = -_dot32(b_t22, _dot32(b_a20, b_t00) + _dot32(b_a21, b_t10))
    b_t32 = -_dot32(b_t33, _dot32(b_a32, b_t22))
    b_t31 = -_dot32(b_t33, _dot32(b_a31, b_t11) + _dot32(b_a32, b_t21))
    b_t30 = -_dot32(b_t33, _dot32(b_a30, b_t00) + _dot32(b_a31, b_t10) + _dot32(b_a32, b_t20))
    return b_t10, b_t20, b_t21, b_t30, b_t31, b_t32


@triton.jit
def _store_inverse(T, row0, row_end, i_h, b_t00, b_t10, b_t11, b_t20, b_t21, b_t22, b_t30, b_t31, b_t32, b_t33,
                   HV: tl.constexpr, BT: tl.constexpr):
    """The ten lower blocks of T and zeros above the diagonal (T is allocated uninitialised)."""
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


@triton.jit
def _sub_block(g, beta, gc, row_src, shift, row0, row_end, sub, b_carry, i_h, HV: tl.constexpr,
               GATHER: tl.constexpr):
    """Rows sub*16 .. sub*16+15 of a chunk: their gate cumsum continuing from `b_carry` (the sum of the rows
    before them), stored. Returns (gc [16] fp32, beta [16] fp32, mask of valid rows, their input rows, carry
    after these rows)."""
    rows = row0 + sub * 16 + tl.arange(0, 16)
    m = rows < row_end
    src = _input_rows(row_src, rows, m, shift, GATHER)
    b_g = tl.load(g + src * HV + i_h, mask=m, other=0.0).to(tl.float32)
    b_gc = b_carry + tl.cumsum(b_g, 0)
    tl.store(gc + rows * HV + i_h, b_gc, mask=m)
    b_b = tl.load(beta + src * HV + i_h, mask=m, other=0.0).to(tl.float32)
    return b_gc, b_b, m, src, b_carry + tl.sum(b_g, 0)


@triton.jit
def _inverse_unit_lower16(b_a):
    """(I + A)^-1 of a strictly lower [16, 16] fp32 block held in registers, by forward substitution:
    x_r = e_r - sum_{j<r} A[r, j] x_j."""
    o_i = tl.arange(0, 16)
    b_x = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)
    for r in tl.static_range(1, 16):
        b_row = tl.sum(tl.where(o_i[:, None] == r, b_a, 0.0), 0)           # A[r, :], zero from column r on
        b_new = tl.where(o_i == r, 1.0, 0.0) - tl.sum(b_row[:, None] * b_x, 0)
        b_x = tl.where(o_i[:, None] == r, b_new[None, :], b_x)
    return b_x


@triton.jit
def _decay_block(b_a, b_gci, b_gcj, b_bi, DIAG: tl.constexpr):
    """Block (i, j) of A from its k_i k_j^T block: times exp(gc_i - gc_j) and beta_i, strictly lower if DIAG."""
    b_a = b_a * _exp_gate_gap(b_gci[:, None] - b_gcj[None, :]) * b_bi[:, None]
    if DIAG:
        o_i = tl.arange(0, 16)
        b_a = tl.where(o_i[:, None] > o_i[None, :], b_a, 0.0)
    return b_a


@triton.jit
def _wy_kkt_solve_chunk(k, g, beta, gc, T, chunk_row_start, chunk_row_end, row_src, i_c, i_h, shift, HK: tl.constexpr,
                        HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, GATHER: tl.constexpr):
    """gc = in-chunk cumsum of g; T = (I + A)^-1, A = strictly_lower((beta k) k^T exp(gc_i - gc_j)), with A's
    ten lower [16, 16] blocks accumulated over BK columns of k at a time and inverted in registers."""
    i_hk = i_h // (HV // HK)
    row0 = tl.load(chunk_row_start + i_c)
    row_end = tl.load(chunk_row_end + i_c)
    b_gc0, b_b0, m0, s0, b_carry = _sub_block(g, beta, gc, row_src, shift, row0, row_end, 0, 0.0, i_h, HV, GATHER)
    b_gc1, b_b1, m1, s1, b_carry = _sub_block(g, beta, gc, row_src, shift, row0, row_end, 1, b_carry, i_h, HV, GATHER)
    b_gc2, b_b2, m2, s2, b_carry = _sub_block(g, beta, gc, row_src, shift, row0, row_end, 2, b_carry, i_h, HV, GATHER)
    b_gc3, b_b3, m3, s3, b_carry = _sub_block(g, beta, gc, row_src, shift, row0, row_end, 3, b_carry, i_h, HV, GATHER)

    b_a00 = tl.zeros([16, 16], dtype=tl.float32)
    b_a10 = tl.zeros([16, 16], dtype=tl.float32)
    b_a11 = tl.zeros([16, 16], dtype=tl.float32)
    b_a20 = tl.zeros([16, 16], dtype=tl.float32)
    b_a21 = tl.zeros([16, 16], dtype=tl.float32)
    b_a22 = tl.zeros([16, 16], dtype=tl.float32)
    b_a30 = tl.zeros([16, 16], dtype=tl.float32)
    b_a31 = tl.zeros([16, 16], dtype=tl.float32)
    b_a32 = tl.zeros([16, 16], dtype=tl.float32)
    b_a33 = tl.zeros([16, 16], dtype=tl.float32)
    p_k = k + i_hk * K
    for i_k in range(0, K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_k0 = tl.load(p_k + s0[:, None] * (HK * K) + o_k[None, :], mask=m0[:, None], other=0.0)  # [16, BK]
        b_k1 = tl.load(p_k + s1[:, None] * (HK * K) + o_k[None, :], mask=m1[:, None], other=0.0)
        b_k2 = tl.load(p_k + s2[:, None] * (HK * K) + o_k[None, :], mask=m2[:, None], other=0.0)
        b_k3 = tl.load(p_k + s3[:, None] * (HK * K) + o_k[None, :], mask=m3[:, None], other=0.0)
        b_kt0, b_kt1, b_kt2 = tl.trans(b_k0), tl.trans(b_k1), tl.trans(b_k2)  # loaded tiles, not accumulators
        b_a00 = tl.dot(b_k0, b_kt0, b_a00)
        b_a10 = tl.dot(b_k1, b_kt0, b_a10)
        b_a11 = tl.dot(b_k1, b_kt1, b_a11)
        b_a20 = tl.dot(b_k2, b_kt0, b_a20)
        b_a21 = tl.dot(b_k2, b_kt1, b_a21)
        b_a22 = tl.dot(b_k2, b_kt2, b_a22)
        b_a30 = tl.dot(b_k3, b_kt0, b_a30)
        b_a31 = tl.dot(b_k3, b_kt1, b_a31)
        b_a32 = tl.dot(b_k3, b_kt2, b_a32)
        b_a33 = tl.dot(b_k3, tl.trans(b_k3), b_a33)

    b_t00 = _inverse_unit_lower16(_decay_block(b_a00, b_gc0, b_gc0, b_b0, True))
    b_t11 = _inverse_unit_lower16(_decay_block(b_a11, b_gc1, b_gc1, b_b1, True))
    b_t22 = _inverse_unit_lower16(_decay_block(b_a22, b_gc2, b_gc2, b_b2, True))
    b_t33 = _inverse_unit_lower16(_decay_block(b_a33, b_gc3, b_gc3, b_b3, True))
    b_t10, b_t20, b_t21, b_t30, b_t31, b_t32 = _merge_inverse(
        b_t00, b_t11, b_t22, b_t33,
        _decay_block(b_a10, b_gc1, b_gc0, b_b1, False), _decay_block(b_a20, b_gc2, b_gc0, b_b2, False),
        _decay_block(b_a21, b_gc2, b_gc1, b_b2, False), _decay_block(b_a30, b_gc3, b_gc0, b_b3, False),
        _decay_block(b_a31, b_gc3, b_gc1, b_b3, False), _decay_block(b_a32, b_gc3, b_gc2, b_b3, False))
    _store_inverse(T, row0, row_end, i_h, b_t00, b_t10, b_t11, b_t20, b_t21, b_t22, b_t30, b_t31, b_t32, b_t33,
                   HV, BT)


@triton.jit
def _wy_kkt_solve_kernel(k, g, beta, gc, T, chunk_row_start, chunk_row_end, row_src, chunk_shift, HK: tl.constexpr,
                         HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, GATHER: tl.constexpr):
    """Chunks without replayed rows run the plain-row code at row + their shift, the others
    through the row maps (GATHER) or on plain rows."""
    i_c, i_h = tl.program_id(0) // HV, tl.program_id(0) % HV
    shift, affine = _chunk_shift(chunk_shift, i_c, GATHER)
    if affine:
        _wy_kkt_solve_chunk(k, g, beta, gc, T, chunk_row_start, chunk_row_end, row_src, i_c, i_h, shift, HK, HV, K,
            BT, BK, False)
    else:
        _wy_kkt_solve_chunk(k, g, beta, gc, T, chunk_row_start, chunk_row_end, row_src, i_c, i_h, 0, HK, HV, K, BT,
            BK, GATHER)


@triton.jit
def _wy_wu_chunk(k, v, beta, gc, T, w, u, chunk_row_start, chunk_row_end, row_src, i_c, i_h, shift, HK: tl.constexpr,
                 HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, GATHER: tl.constexpr):
    """w = T (beta exp(gc) k) [BT, K], u = (T diag(beta)) v [BT, V], BK / BV columns at a time."""
    i_hk = i_h // (HV // HK)
    row0, row_end, rows, m_t = _chunk_rows(chunk_row_start, chunk_row_end, i_c, BT)
    src = _input_rows(row_src, rows, m_t, shift, GATHER)
    o_t = tl.arange(0, BT)
    dt = k.dtype.element_ty
    # T rounds to the inputs' dtype once, for both dots
    b_t = tl.load(T + (rows[:, None] * HV + i_h) * BT + o_t[None, :], mask=m_t[:, None], other=0.0).to(dt)
    b_b = tl.load(beta + src * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_kscale = b_b * tl.exp2(tl.load(gc + rows * HV + i_h, mask=m_t, other=0.0) * LOG2E)
    # u = (T diag(beta)) v, not T (beta v): v enters the dot as given and the rounding falls on T diag(beta), whose
    # diagonal (beta_i) is exact and whose other entries are small; rounding beta v raised o's error by about 10%
    b_tb = (b_t.to(tl.float32) * b_b[None, :]).to(v.dtype.element_ty)
    for i_k in tl.range(0, K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_k = tl.load(k + src[:, None] * (HK * K) + i_hk * K + o_k[None, :], mask=m_t[:, None], other=0.0)
        b_w = tl.dot(b_t, (b_k * b_kscale[:, None]).to(dt))
        tl.store(w + (rows[:, None] * HV + i_h) * K + o_k[None, :], b_w.to(w.dtype.element_ty), mask=m_t[:, None])
    for i_v in tl.range(0, V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        b_v = tl.load(v + (src[:, None] * HV + i_h) * V + o_v[None, :], mask=m_t[:, None], other=0.0)
        b_u = tl.dot(b_tb, b_v)
        tl.store(u + (rows[:, None] * HV + i_h) * V + o_v[None, :], b_u.to(u.dtype.element_ty), mask=m_t[:, None])


@triton.jit
def _wy_wu_kernel(k, v, beta, gc, T, w, u, chunk_row_start, chunk_row_end, row_src, chunk_shift, HK: tl.constexpr,
                  HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, GATHER: tl.constexpr):
    """Chunks without replayed rows run the plain-row code at row + their shift, the others
    through the row maps (GATHER) or on plain rows."""
    i_c, i_h = tl.program_id(0) // HV, tl.program_id(0) % HV
    shift, affine = _chunk_shift(chunk_shift, i_c, GATHER)
    if affine:
        _wy_wu_chunk(k, v, beta, gc, T, w, u, chunk_row_start, chunk_row_end, row_src, i_c, i_h, shift, HK, HV, K, V,
            BT, BK, BV, False)
    else:
        _wy_wu_chunk(k, v, beta, gc, T, w, u, chunk_row_start, chunk_row_end, row_src, i_c, i_h, 0, HK, HV, K, V, BT,
            BK, BV, GATHER)


def wy_fwd(k, v, g, beta, index, rows=None):
    """Returns gc [R, HV] fp32, T [R, HV, BT] fp32, w [R, HV, K] (k's dtype), u [R, HV, V] (v's dtype) over the
    R packed rows of `index`, with the launch configuration of `index.config` (wy_kkt_warps, wy_kkt_block_k,
    wy_wu_warps). `rows` (index.PackedRows): k, v, g, beta are compact and read through `rows.src`."""
    cfg = index.config
    _, hk, kd = k.shape
    hv, vd = v.shape[1], v.shape[2]
    n_rows = rows.src.numel() if rows is not None else k.shape[0]
    BT = index.chunk_size
    if BT != 64:
        raise ValueError(f"chunk_gated_delta_rule: the Triton path has chunk_size 64 built in, got {BT}")
    gc = torch.empty(n_rows, hv, device=k.device, dtype=torch.float32)
    # T in the inputs' dtype: every dot that reads it (here and in the WY backward) rounds it to that dtype first,
    # so storing it rounded gives the same bits at half the traffic
    T = torch.empty(n_rows, hv, BT, device=k.device, dtype=k.dtype)
    w = torch.empty(n_rows, hv, kd, device=k.device, dtype=k.dtype)
    u = torch.empty(n_rows, hv, vd, device=k.device, dtype=v.dtype)
    if not index.num_chunks:
        return gc, T, w, u
    # one program per (chunk, value head), the heads of a chunk adjacent: a key head's k rows, read by each of its
    # value heads, are then still in L2 for the second
    grid = (index.num_chunks * hv,)
    shifts = chunk_shift_table(index, rows)
    tables = (index.chunk_row_start, index.chunk_row_end, row_tables(index, rows)[0], shifts)
    gather = rows is not None
    _wy_kkt_solve_kernel[grid](k, g, beta, gc, T, *tables, HK=hk, HV=hv, K=kd, BT=BT,
                               BK=min(cfg.wy_kkt_block_k, kd), GATHER=gather,
                               num_warps=cfg.wy_kkt_warps)
    _wy_wu_kernel[grid](k, v, beta, gc, T, w, u, *tables, HK=hk, HV=hv, K=kd, V=vd, BT=BT, BK=min(64, kd),
                        BV=min(64, vd), GATHER=gather, num_warps=cfg.wy_wu_warps)
    return gc, T, w, u
