"""Forward, chunk-local part: per-channel gate cumsum, the chunk's two decayed attention matrices, the WY
inverse, and the operands of the state scan.

Per chunk (BT = 64 rows) and value head, with gc = in-chunk cumsum of g [BT, K] (fp32) and
E_ij[d] = exp(gc_i[d] - gc_j[d]):
  Akk = strictly_lower( beta_i sum_d k_i[d] k_j[d] E_ij[d] )      [BT, BT]
  Aqk = lower( sum_d q_i[d] k_j[d] E_ij[d] )  (diagonal included)  [BT, BT] fp32, for o and dv_local
  T   = (I + Akk)^-1                                              [BT, BT] fp32, kept for the backward
  w   = T (beta exp(gc) k),  u = T (beta v),  kg = exp(gl - gc) k   (gl: gc of the chunk's last row)
Four kernels. The first fills the diagonal 16x16 blocks of Akk (before beta) and Aqk, one program per row and
group of heads: row i walks j = i, i - 1, ... down to its block's first row, carrying the exponent
gc_i - gc_j = g_i + ... + g_(j+1) as a running sum of gates (<= 0 exactly, so no factor exceeds 1 and no clamp is
needed), each entry one [heads, K] product summed over K. Inside a (chunk, head) program this serial walk
would be most of the kernel's time; spread over rows it is one short loop per program. The second builds the
off-diagonal blocks by dots split at a reference row (blocks.py), reads the diagonal ones back, and stores gc,
Aqk and Akk (beta applied) in T's place; the third inverts Akk in place at one warp with GDN's 16x16 forward
substitution and block merge (wy_fwd); the fourth computes w, u and kg from T.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_gdn.gates import LOG2E, _chunk_rows, _chunk_shift, _exp_gate_gap, _input_rows
from ..chunk_gdn.index import chunk_shift_table, row_tables
from ..chunk_gdn.wy_fwd import _inverse_unit_lower16, _merge_inverse, _store_inverse
from ..interpreter_safe import interpreting
from .blocks import (_block_betas, _block_tiles, _chunk_blocks, _from_ref, _head_group, _load_block, _store_block,
                     _to_ref)


@triton.jit
def _strict(b_a, b_beta):
    """beta_i times a diagonal block's strictly lower part."""
    o_i = tl.arange(0, 16)
    return tl.where(o_i[:, None] > o_i[None, :], b_a * b_beta[:, None], 0.0)


@triton.jit
def _off_pair(b_kn, b_qn, b_kj, b_gcj, b_ref, b_akk, b_aqk):
    """Block (I, J)'s (Akk, Aqk) accumulators plus their dots over these BK columns: b_kn, b_qn are block I's
    k and q taken to the reference row (`_to_ref`), block J's k comes from it here."""
    b_kr = tl.trans(_from_ref(b_kj, b_gcj, b_ref))
    return b_akk + tl.dot(b_kn, b_kr), b_aqk + tl.dot(b_qn, b_kr)


@triton.jit
def _diag_entry(k, g, row_src, b_q, b_k, b_s, b_aqk, b_akk, row, jj, o_hk, o_hv, o_k, HK: tl.constexpr,
                HV: tl.constexpr, K: tl.constexpr, GATHER: tl.constexpr):
    """Entry (i, j = row) of the diagonal block for every head of the program, put in column jj of the row's
    [BH, 16] tiles; returns them and the running exponent carried on to row j - 1 (plus g_j, in log2 units)."""
    src = _input_rows(row_src, row, row >= 0, 0, GATHER).to(tl.int64)  # a row of the walk: inside the sequence
    k_j = tl.load(k + src * (HK * K) + o_hk[:, None] * K + o_k[None, :]).to(tl.float32)  # o_hv clamped: no mask
    kj_e = k_j * tl.exp2(b_s)
    at = tl.arange(0, 16)[None, :] == jj
    b_aqk = tl.where(at, tl.sum(b_q * kj_e, 1)[:, None], b_aqk)
    b_akk = tl.where(at, tl.sum(b_k * kj_e, 1)[:, None], b_akk)
    g_j = tl.load(g + (src * HV + o_hv[:, None]) * K + o_k[None, :])
    return b_s + g_j * LOG2E, b_aqk, b_akk


@triton.jit
def _diag_fwd_kernel(q, k, g, T, Aqk, chunk_row_start, chunk_row_end, row_src, HK: tl.constexpr, HV: tl.constexpr,
                     K: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, GATHER: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """Row i's entries j <= i of its diagonal block: Akk (before beta) into T, Aqk into Aqk, at columns
    16 (i // 16) + (j mod 16); entries j > i are left unwritten (the next kernel loads them as 0)."""
    i_t, i_hg = tl.program_id(0), tl.program_id(1)
    i_c, t = i_t // BT, i_t % BT
    row0 = tl.load(chunk_row_start + i_c)
    row = row0 + t
    count = tl.where(row < tl.load(chunk_row_end + i_c), t % 16 + 1, 0)  # j = row, row - 1, ... (0: padding)
    o_hv, m_h, o_hk = _head_group(i_hg, BH, HV, HK)
    o_k = tl.arange(0, K)
    src = _input_rows(row_src, row, count > 0, 0, GATHER).to(tl.int64)
    p_qk = src * (HK * K) + o_hk[:, None] * K + o_k[None, :]
    m_qk = m_h[:, None] & (o_k[None, :] * 0 + count > 0)
    b_q = tl.load(q + p_qk, mask=m_qk, other=0.0).to(tl.float32)
    b_k = tl.load(k + p_qk, mask=m_qk, other=0.0).to(tl.float32)
    b_s = tl.zeros([BH, K], dtype=tl.float32)
    b_aqk = tl.zeros([BH, 16], dtype=tl.float32)
    b_akk = tl.zeros([BH, 16], dtype=tl.float32)
    # the row's entries stay in registers and leave in one store each: stored per step, each value crossed
    # the warps through shared memory behind barriers
    if INTERPRET:
        jj = 0
        while jj < count:
            b_s, b_aqk, b_akk = _diag_entry(k, g, row_src, b_q, b_k, b_s, b_aqk, b_akk, row - jj, t % 16 - jj,
                                            o_hk, o_hv, o_k, HK, HV, K, GATHER)
            jj += 1
    else:
        for jj in range(0, count):
            b_s, b_aqk, b_akk = _diag_entry(k, g, row_src, b_q, b_k, b_s, b_aqk, b_akk, row - jj, t % 16 - jj,
                                            o_hk, o_hv, o_k, HK, HV, K, GATHER)
    o_c = tl.arange(0, 16)
    out = (row.to(tl.int64) * HV + o_hv[:, None]) * BT + (t // 16) * 16 + o_c[None, :]
    m_out = m_h[:, None] & (o_c[None, :] < count)
    tl.store(Aqk + out, b_aqk, mask=m_out)
    tl.store(T + out, b_akk, mask=m_out)


@triton.jit
def _intra_fwd_chunk(q, k, g, beta, gc, T, Aqk, chunk_row_start, chunk_row_end, row_src, shift, HK: tl.constexpr,
                     HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, GATHER: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // HK)
    row0, row_end, r0, m0, s0, r1, m1, s1, r2, m2, s2, r3, m3, s3 = _chunk_blocks(
        chunk_row_start, chunk_row_end, row_src, i_c, shift, GATHER)
    a10 = tl.zeros([16, 16], dtype=tl.float32)  # off-diagonal Akk blocks (before beta)
    a20 = tl.zeros([16, 16], dtype=tl.float32)
    a21 = tl.zeros([16, 16], dtype=tl.float32)
    a30 = tl.zeros([16, 16], dtype=tl.float32)
    a31 = tl.zeros([16, 16], dtype=tl.float32)
    a32 = tl.zeros([16, 16], dtype=tl.float32)
    p10 = tl.zeros([16, 16], dtype=tl.float32)  # off-diagonal Aqk blocks
    p20 = tl.zeros([16, 16], dtype=tl.float32)
    p21 = tl.zeros([16, 16], dtype=tl.float32)
    p30 = tl.zeros([16, 16], dtype=tl.float32)
    p31 = tl.zeros([16, 16], dtype=tl.float32)
    p32 = tl.zeros([16, 16], dtype=tl.float32)
    for i_k in range(0, K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        # gc: each block's column cumsum continues from the rows before it (padding rows add g = 0)
        g0, g1, g2, g3 = _block_tiles(g, s0, m0, s1, m1, s2, m2, s3, m3, HV * K, i_h * K, o_k)
        gc0 = tl.cumsum(g0, 0)
        c1 = tl.sum(g0, 0)
        gc1 = c1[None, :] + tl.cumsum(g1, 0)
        c2 = c1 + tl.sum(g1, 0)
        gc2 = c2[None, :] + tl.cumsum(g2, 0)
        c3 = c2 + tl.sum(g2, 0)
        gc3 = c3[None, :] + tl.cumsum(g3, 0)
        p_gc = gc + i_h * K + o_k[None, :]
        tl.store(p_gc + r0[:, None].to(tl.int64) * (HV * K), gc0, mask=m0[:, None])
        tl.store(p_gc + r1[:, None].to(tl.int64) * (HV * K), gc1, mask=m1[:, None])
        tl.store(p_gc + r2[:, None].to(tl.int64) * (HV * K), gc2, mask=m2[:, None])
        tl.store(p_gc + r3[:, None].to(tl.int64) * (HV * K), gc3, mask=m3[:, None])
        k0, k1, k2, k3 = _block_tiles(k, s0, m0, s1, m1, s2, m2, s3, m3, HK * K, i_hk * K, o_k)
        q0, q1, q2, q3 = _block_tiles(q, s0, m0, s1, m1, s2, m2, s3, m3, HK * K, i_hk * K, o_k)
        # off-diagonal blocks (I, J), I > J, split at c_I, the gate sum of the rows before block I (gc of row
        # 16 I - 1 up to rounding: a gap rounding leaves above 0 by eps gets exp(-eps) for exp(eps), both ~1)
        kn, qn = _to_ref(k1, gc1, c1), _to_ref(q1, gc1, c1)
        a10, p10 = _off_pair(kn, qn, k0, gc0, c1, a10, p10)
        kn, qn = _to_ref(k2, gc2, c2), _to_ref(q2, gc2, c2)
        a20, p20 = _off_pair(kn, qn, k0, gc0, c2, a20, p20)
        a21, p21 = _off_pair(kn, qn, k1, gc1, c2, a21, p21)
        kn, qn = _to_ref(k3, gc3, c3), _to_ref(q3, gc3, c3)
        a30, p30 = _off_pair(kn, qn, k0, gc0, c3, a30, p30)
        a31, p31 = _off_pair(kn, qn, k1, gc1, c3, a31, p31)
        a32, p32 = _off_pair(kn, qn, k2, gc2, c3, a32, p32)

    b0, b1, b2, b3 = _block_betas(beta, s0, m0, s1, m1, s2, m2, s3, m3, i_h, HV)
    # the diagonal blocks, from _diag_fwd_kernel: entries j <= i, the others were never written (read before
    # this program overwrites them)
    a00, p00 = _load_block(T, r0, m0, i_h, 0, HV, BT, True), _load_block(Aqk, r0, m0, i_h, 0, HV, BT, True)
    a11, p11 = _load_block(T, r1, m1, i_h, 16, HV, BT, True), _load_block(Aqk, r1, m1, i_h, 16, HV, BT, True)
    a22, p22 = _load_block(T, r2, m2, i_h, 32, HV, BT, True), _load_block(Aqk, r2, m2, i_h, 32, HV, BT, True)
    a33, p33 = _load_block(T, r3, m3, i_h, 48, HV, BT, True), _load_block(Aqk, r3, m3, i_h, 48, HV, BT, True)
    # Akk with beta, its ten lower blocks, for _solve_kernel to invert in place
    _store_block(T, r0, m0, i_h, 0, _strict(a00, b0), HV, BT)
    _store_block(T, r1, m1, i_h, 0, a10 * b1[:, None], HV, BT)
    _store_block(T, r1, m1, i_h, 16, _strict(a11, b1), HV, BT)
    _store_block(T, r2, m2, i_h, 0, a20 * b2[:, None], HV, BT)
    _store_block(T, r2, m2, i_h, 16, a21 * b2[:, None], HV, BT)
    _store_block(T, r2, m2, i_h, 32, _strict(a22, b2), HV, BT)
    _store_block(T, r3, m3, i_h, 0, a30 * b3[:, None], HV, BT)
    _store_block(T, r3, m3, i_h, 16, a31 * b3[:, None], HV, BT)
    _store_block(T, r3, m3, i_h, 32, a32 * b3[:, None], HV, BT)
    _store_block(T, r3, m3, i_h, 48, _strict(a33, b3), HV, BT)
    _store_inverse(Aqk, row0, row_end, i_h, p00, p10, p11, p20, p21, p22, p30, p31, p32, p33, HV, BT)


@triton.jit
def _intra_fwd_kernel(q, k, g, beta, gc, T, Aqk, chunk_row_start, chunk_row_end, row_src, chunk_shift,
                      HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                      GATHER: tl.constexpr):
    """Chunks without replayed rows run the plain-row code at row + their shift, the others through the row
    maps (GATHER) or on plain rows (GDN's dispatch)."""
    shift, affine = _chunk_shift(chunk_shift, tl.program_id(0), GATHER)
    if affine:
        _intra_fwd_chunk(q, k, g, beta, gc, T, Aqk, chunk_row_start, chunk_row_end, row_src, shift, HK, HV, K, BT,
                         BK, False)
    else:
        _intra_fwd_chunk(q, k, g, beta, gc, T, Aqk, chunk_row_start, chunk_row_end, row_src, 0, HK, HV, K, BT, BK,
                         GATHER)


@triton.jit
def _solve_kernel(T, chunk_row_start, chunk_row_end, HV: tl.constexpr, BT: tl.constexpr):
    """T = (I + Akk)^-1 in place, one program per chunk and head: the ten lower 16x16 blocks of Akk (beta applied,
    from _intra_fwd_kernel) in, GDN's forward substitution and block merge, all 16 blocks of T out. A kernel of
    its own because the substitution's row sums cross warps at the chunk kernel's 4 warps (a barrier and
    shuffles per step) and stay inside one warp here."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    row0 = tl.load(chunk_row_start + i_c)
    row_end = tl.load(chunk_row_end + i_c)
    r0 = row0 + tl.arange(0, 16)
    r1, r2, r3 = r0 + 16, r0 + 32, r0 + 48
    m0, m1, m2, m3 = r0 < row_end, r1 < row_end, r2 < row_end, r3 < row_end
    t00 = _inverse_unit_lower16(_load_block(T, r0, m0, i_h, 0, HV, BT))
    t11 = _inverse_unit_lower16(_load_block(T, r1, m1, i_h, 16, HV, BT))
    t22 = _inverse_unit_lower16(_load_block(T, r2, m2, i_h, 32, HV, BT))
    t33 = _inverse_unit_lower16(_load_block(T, r3, m3, i_h, 48, HV, BT))
    t10, t20, t21, t30, t31, t32 = _merge_inverse(
        t00, t11, t22, t33, _load_block(T, r1, m1, i_h, 0, HV, BT), _load_block(T, r2, m2, i_h, 0, HV, BT),
        _load_block(T, r2, m2, i_h, 16, HV, BT), _load_block(T, r3, m3, i_h, 0, HV, BT),
        _load_block(T, r3, m3, i_h, 16, HV, BT), _load_block(T, r3, m3, i_h, 32, HV, BT))
    _store_inverse(T, row0, row_end, i_h, t00, t10, t11, t20, t21, t22, t30, t31, t32, t33, HV, BT)


@triton.jit
def _wu_chunk(k, v, beta, gc, T, w, u, kg, chunk_row_start, chunk_row_end, row_src, shift, HK: tl.constexpr,
              HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, GATHER: tl.constexpr):
    """w = T (beta exp(gc) k), kg = exp(gl - gc) k [BT, K]; u = T (beta v) [BT, V], BK / BV columns a step."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // HK)
    row0, row_end, rows, m_t = _chunk_rows(chunk_row_start, chunk_row_end, i_c, BT)
    src = _input_rows(row_src, rows, m_t, shift, GATHER)
    rows64 = rows.to(tl.int64)
    o_t = tl.arange(0, BT)
    dt = k.dtype.element_ty
    # T rounds to the inputs' dtype once, for every dot (GDN's wy_fwd)
    b_t = tl.load(T + (rows64[:, None] * HV + i_h) * BT + o_t[None, :], mask=m_t[:, None], other=0.0).to(dt)
    b_b = tl.load(beta + src * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
    last = (row_end - 1).to(tl.int64)
    for i_k in range(0, K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_k = tl.load(k + src[:, None].to(tl.int64) * (HK * K) + i_hk * K + o_k[None, :], mask=m_t[:, None],
                      other=0.0).to(tl.float32)
        p_gc = gc + (rows64[:, None] * HV + i_h) * K + o_k[None, :]
        b_gc = tl.load(p_gc, mask=m_t[:, None], other=0.0)
        b_gl = tl.load(gc + (last * HV + i_h) * K + o_k)
        b_w = tl.dot(b_t, (b_k * tl.exp2(b_gc * LOG2E) * b_b[:, None]).to(dt))
        p_out = (rows64[:, None] * HV + i_h) * K + o_k[None, :]
        tl.store(w + p_out, b_w.to(w.dtype.element_ty), mask=m_t[:, None])
        b_kg = b_k * _exp_gate_gap(b_gl[None, :] - b_gc)
        tl.store(kg + p_out, b_kg.to(kg.dtype.element_ty), mask=m_t[:, None])
    for i_v in range(0, V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        b_v = tl.load(v + (src[:, None].to(tl.int64) * HV + i_h) * V + o_v[None, :], mask=m_t[:, None], other=0.0)
        b_u = tl.dot(b_t.to(b_v.dtype), (b_v * b_b[:, None]).to(b_v.dtype))
        tl.store(u + (rows64[:, None] * HV + i_h) * V + o_v[None, :], b_u.to(u.dtype.element_ty), mask=m_t[:, None])


@triton.jit
def _wu_kernel(k, v, beta, gc, T, w, u, kg, chunk_row_start, chunk_row_end, row_src, chunk_shift, HK: tl.constexpr,
               HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, GATHER: tl.constexpr):
    shift, affine = _chunk_shift(chunk_shift, tl.program_id(0), GATHER)
    if affine:
        _wu_chunk(k, v, beta, gc, T, w, u, kg, chunk_row_start, chunk_row_end, row_src, shift, HK, HV, K, V, BT, BK,
                  BV, False)
    else:
        _wu_chunk(k, v, beta, gc, T, w, u, kg, chunk_row_start, chunk_row_end, row_src, 0, HK, HV, K, V, BT, BK, BV,
                  GATHER)


def intra_fwd(q, k, v, g, beta, index, config, rows=None):
    """gc [R, HV, K] fp32, T and Aqk [R, HV, BT] fp32, w and kg [R, HV, K] (k's dtype), u [R, HV, V] (v's dtype)
    over the R packed rows of `index`; with `rows` (index.PackedRows) q, k, v, g, beta are compact and read
    through `rows.src`. `config`: KDAKernelConfig."""
    _, hk, kd = k.shape
    hv, vd = v.shape[1], v.shape[2]
    n_rows = rows.src.numel() if rows is not None else k.shape[0]
    BT = index.chunk_size
    dev = k.device
    gc = torch.empty(n_rows, hv, kd, device=dev, dtype=torch.float32)
    T = torch.empty(n_rows, hv, BT, device=dev, dtype=torch.float32)
    Aqk = torch.empty_like(T)
    w = torch.empty(n_rows, hv, kd, device=dev, dtype=k.dtype)
    kg = torch.empty_like(w)
    u = torch.empty(n_rows, hv, vd, device=dev, dtype=v.dtype)
    if not index.num_chunks:
        return gc, T, Aqk, w, u, kg
    grid = (index.num_chunks, hv)
    tables = (index.chunk_row_start, index.chunk_row_end, row_tables(index, rows)[0], chunk_shift_table(index, rows))
    gather = rows is not None
    heads = config.diag_heads
    _diag_fwd_kernel[(index.num_chunks * BT, triton.cdiv(hv, heads))](
        q, k, g, T, Aqk, *tables[:3], HK=hk, HV=hv, K=kd, BT=BT, BH=heads, GATHER=gather, INTERPRET=interpreting(),
        num_warps=config.diag_warps)
    _intra_fwd_kernel[grid](q, k, g, beta, gc, T, Aqk, *tables, HK=hk, HV=hv, K=kd, BT=BT,
                            BK=min(config.intra_block_k, kd), GATHER=gather, num_warps=config.intra_fwd_warps)
    _solve_kernel[grid](T, index.chunk_row_start, index.chunk_row_end, HV=hv, BT=BT, num_warps=config.solve_warps)
    _wu_kernel[grid](k, v, beta, gc, T, w, u, kg, *tables, HK=hk, HV=hv, K=kd, V=vd, BT=BT, BK=min(64, kd),
                     BV=min(64, vd), GATHER=gather, num_warps=config.wu_warps)
    return gc, T, Aqk, w, u, kg
