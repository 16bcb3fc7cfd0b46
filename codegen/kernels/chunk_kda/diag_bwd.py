"""Backward through the diagonal 16x16 blocks of the two decayed attention matrices, one program per row.

For row i of a diagonal block (rows b..b+15 of a chunk) and every head of the program, over all K channels
(notation of intra_bwd.py, E_ij[d] = exp(gc_i[d] - gc_j[d]) for j <= i):
  as the query / left row:  Xq_i = sum_{b <= j <= i} dAqk_ij k_j E_ij,
                            Xk_i = sum_{b <= j < i} dAkk_ij k_j E_ij
  as the key / right row:   Zq_i = sum_{i <= r < b+16} dAqk_ri q_r E_ri,
                            Zk_i = sum_{i < r < b+16} dAkk_ri beta_r k_r E_ri
and it folds them into row i's partial gradients in place (each row has one program, so no atomics):
  dq_p += Xq,  dk_p += Zq + beta_i Xk + Zk,  dgc_p += q_i Xq - k_i Zq + beta_i k_i Xk - k_i Zk,
  dbeta_p += sum_d k_i Xk.
Inside a chunk's program these blocks were a serial walk of 16 rows per block on [16, BK] tiles; spread over
rows (as the forward's diagonal blocks, intra_fwd._diag_fwd_kernel) each program walks at most 16 rows of its
own block. The chunk kernel (intra_bwd.py) then adds only the off-diagonal blocks. Every factor is
exp(-|gc_i - gc_j|) <= 1 (gc is a running sum of gates <= 0); dAkk holds zeros on and above the diagonal,
dAqk above it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..chunk_gdn.gates import _input_rows
from .blocks import _decay, _head_group


@triton.jit
def _row_inputs(q, k, beta, gc, row_src, row, o_hk, o_hv, o_k, HK: tl.constexpr, HV: tl.constexpr,
                K: tl.constexpr, GATHER: tl.constexpr):
    """(q, k, beta [BH, 1], gc) of packed row `row` (inside the sequence) for the program's heads, fp32
    (o_hv clamped to real heads, so no load needs a mask)."""
    src = _input_rows(row_src, row, row >= 0, 0, GATHER).to(tl.int64)
    p_qk = src * (HK * K) + o_hk[:, None] * K + o_k[None, :]
    b_q = tl.load(q + p_qk).to(tl.float32)
    b_k = tl.load(k + p_qk).to(tl.float32)
    b_b = tl.load(beta + src * HV + o_hv).to(tl.float32)[:, None]
    b_gc = tl.load(gc + (row.to(tl.int64) * HV + o_hv[:, None]) * K + o_k[None, :])
    return b_q, b_k, b_b, b_gc


@triton.jit
def _x_step(q, k, beta, gc, dAqk, dAkk, row_src, row_i, col, gc_i, row_j, xq, xk, o_hk, o_hv, o_k,
            HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, GATHER: tl.constexpr):
    """Row j's terms of row i's X (column `col` of row i's dAqk, dAkk rows)."""
    _, k_j, _, gc_j = _row_inputs(q, k, beta, gc, row_src, row_j, o_hk, o_hv, o_k, HK, HV, K, GATHER)
    p_a = (row_i.to(tl.int64) * HV + o_hv) * BT + col
    a_q = tl.load(dAqk + p_a)[:, None]
    a_k = tl.load(dAkk + p_a)[:, None]
    ke = k_j * _decay(gc_i, gc_j)
    return xq + a_q * ke, xk + a_k * ke


@triton.jit
def _z_step(q, k, beta, gc, dAqk, dAkk, row_src, col, gc_i, row_r, zq, zk, o_hk, o_hv, o_k,
            HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, GATHER: tl.constexpr):
    """Row r's terms of row i's Z (column `col` = row i's place in its block, of row r's dAqk, dAkk rows)."""
    q_r, k_r, b_r, gc_r = _row_inputs(q, k, beta, gc, row_src, row_r, o_hk, o_hv, o_k, HK, HV, K, GATHER)
    p_a = (row_r.to(tl.int64) * HV + o_hv) * BT + col
    a_q = tl.load(dAqk + p_a)[:, None]
    a_k = tl.load(dAkk + p_a)[:, None]
    e = _decay(gc_r, gc_i)
    return zq + a_q * (q_r * e), zk + (a_k * b_r) * (k_r * e)  # beta_r on the [BH, 1] factor: one product less


@triton.jit
def _diag_bwd_kernel(q, k, beta, gc, dAqk, dAkk, dq_p, dk_p, dgc_p, dbeta_p, chunk_row_start, chunk_row_end,
                     row_src, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                     BH: tl.constexpr, GATHER: tl.constexpr, INTERPRET: tl.constexpr):
    i_t, i_hg = tl.program_id(0), tl.program_id(1)
    i_c, t = i_t // BT, i_t % BT
    row0 = tl.load(chunk_row_start + i_c)
    row_end = tl.load(chunk_row_end + i_c)
    row = row0 + t
    if row < row_end:
        first = row0 + (t // 16) * 16  # the block's first row
        last = tl.minimum(first + 16, row_end)  # one past its last row inside the sequence
        col0 = (t // 16) * 16
        o_hv, m_h, o_hk = _head_group(i_hg, BH, HV, HK)
        o_k = tl.arange(0, K)
        q_i, k_i, b_i, gc_i = _row_inputs(q, k, beta, gc, row_src, row, o_hk, o_hv, o_k, HK, HV, K, GATHER)
        xq = tl.zeros([BH, K], dtype=tl.float32)
        xk = tl.zeros([BH, K], dtype=tl.float32)
        zq = tl.zeros([BH, K], dtype=tl.float32)
        zk = tl.zeros([BH, K], dtype=tl.float32)
        if INTERPRET:  # while loops: interpreter_safe.py
            j = first
            while j <= row:
                xq, xk = _x_step(q, k, beta, gc, dAqk, dAkk, row_src, row, col0 + j - first, gc_i, j, xq, xk, o_hk,
                                 o_hv, o_k, HK, HV, K, BT, GATHER)
                j += 1
            r = row
            while r < last:
                zq, zk = _z_step(q, k, beta, gc, dAqk, dAkk, row_src, col0 + t % 16, gc_i, r, zq, zk, o_hk, o_hv,
                                 o_k, HK, HV, K, BT, GATHER)
                r += 1
        else:
            for j in range(first, row + 1):
                xq, xk = _x_step(q, k, beta, gc, dAqk, dAkk, row_src, row, col0 + j - first, gc_i, j, xq, xk, o_hk,
                                 o_hv, o_k, HK, HV, K, BT, GATHER)
            for r in range(row, last):
                zq, zk = _z_step(q, k, beta, gc, dAqk, dAkk, row_src, col0 + t % 16, gc_i, r, zq, zk, o_hk, o_hv,
                                 o_k, HK, HV, K, BT, GATHER)
        p = (row.to(tl.int64) * HV + o_hv[:, None]) * K + o_k[None, :]
        m = m_h[:, None]
        kb_xk = b_i * xk
        tl.store(dq_p + p, tl.load(dq_p + p, mask=m, other=0.0) + xq, mask=m)
        tl.store(dk_p + p, tl.load(dk_p + p, mask=m, other=0.0) + zq + kb_xk + zk, mask=m)
        tl.store(dgc_p + p, tl.load(dgc_p + p, mask=m, other=0.0) + q_i * xq - k_i * zq + k_i * kb_xk - k_i * zk,
                 mask=m)
        p_b = row.to(tl.int64) * HV + o_hv
        tl.store(dbeta_p + p_b, tl.load(dbeta_p + p_b, mask=m_h, other=0.0) + tl.sum(k_i * xk, 1), mask=m_h)
