"""Backward, chunk-parallel part 2: through the two decayed attention matrices, then the gate's reverse cumsum.

With E_ij[d] = exp(gc_i[d] - gc_j[d]) and the stored dAqk (lower, diagonal included) and dAkk (strictly lower,
before beta), per 16-row block, K columns a step:
  Aqk_ij = sum_d q_i k_j E_ij:         Xq_i = sum_j dAqk_ij k_j E_ij,  Zq_j = sum_i dAqk_ij q_i E_ij
  Akk_ij = beta_i sum_d k_i k_j E_ij:  Xk_i = sum_j dAkk_ij k_j E_ij,  Zk_j = sum_i dAkk_ij beta_i k_i E_ij
  dq += Xq,  dk += Zq + beta Xk + Zk,  dbeta += sum_d k Xk,  dgc += q Xq - k Zq + beta k Xk - k Zk
  dg = reverse cumsum of dgc inside the chunk.
X terms of a block I split the decay at the last row of block I - 1, Z terms of a block J at J's last row
(blocks.py), so every factor is at most 1. The diagonal blocks' terms were added to the partials by
diag_bwd.py's row-parallel kernel before this one runs; this kernel adds the off-diagonal blocks' and writes
the final dq, dk, dg, dbeta: kept rows at their compact tokens, replayed rows into the side buffers.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..chunk_gdn.gates import _chunk_shift, _kept_rows
from .blocks import _block_betas, _block_tiles, _chunk_blocks, _load_block, _off_cols, _off_rows


@triton.jit
def _x_terms(dq_ij, dk_ij, k_j, gc_j, gc_i, ref):
    """(Xq, Xk) contributions of block J < I to block I."""
    return _off_rows(dq_ij, k_j, gc_j, gc_i, ref), _off_rows(dk_ij, k_j, gc_j, gc_i, ref)


@triton.jit
def _z_terms(dq_ij, dk_ij, q_i, kb_i, gc_i, gc_j, ref):
    """(Zq, Zk) contributions of block I > J to block J (dq_ij, dk_ij: the (I, J) blocks, transposed here)."""
    return _off_cols(tl.trans(dq_ij), q_i, gc_i, gc_j, ref), _off_cols(tl.trans(dk_ij), kb_i, gc_i, gc_j, ref)


@triton.jit
def _off_block(dAqk, dAkk, rows_i, m_i, i_h, col_j, q_i, kb_i, gc_i, k_j, gc_j, ref_x, ref_z, xq_i, xk_i, zq_j, zk_j,
               HV: tl.constexpr, BT: tl.constexpr):
    """Block (I, J), I > J, over these BK columns (its dAqk, dAkk block in block I's rows at column col_j): its
    X terms added to block I's (split at `ref_x`), its Z terms to block J's (split at `ref_z`)."""
    dqb = _load_block(dAqk, rows_i, m_i, i_h, col_j, HV, BT)
    dkb = _load_block(dAkk, rows_i, m_i, i_h, col_j, HV, BT)
    xq, xk = _x_terms(dqb, dkb, k_j, gc_j, gc_i, ref_x)
    zq, zk = _z_terms(dqb, dkb, q_i, kb_i, gc_i, gc_j, ref_z)
    return xq_i + xq, xk_i + xk, zq_j + zq, zk_j + zk


@triton.jit
def _finish_block(dq, dk, dg, side_dk, side_dg, dq_p, dk_p, dgc_p, rows, m, kept, m_keep, i_h, o_k, q_i, k_i, b_i,
                  xq, xk, zq, zk, carry, HV: tl.constexpr, K: tl.constexpr, GATHER: tl.constexpr):
    """Block I's final dq, dk, dg columns (dg: reverse cumsum continuing from `carry`, the sum of the later
    blocks' dgc); returns (sum_d k Xk per row [16], carry after this block)."""
    p = (rows[:, None].to(tl.int64) * HV + i_h) * K + o_k[None, :]
    b_dq = tl.load(dq_p + p, mask=m[:, None], other=0.0) + xq
    kb_xk = b_i[:, None] * xk
    b_dk = tl.load(dk_p + p, mask=m[:, None], other=0.0) + zq + kb_xk + zk
    b_dgc = tl.load(dgc_p + p, mask=m[:, None], other=0.0) + q_i * xq - k_i * zq + k_i * kb_xk - k_i * zk
    b_dgc = tl.where(m[:, None], b_dgc, 0.0)
    b_sum = tl.sum(b_dgc, 0)
    b_dg = carry[None, :] + b_sum[None, :] - tl.cumsum(b_dgc, 0) + b_dgc
    p_kept = (kept[:, None].to(tl.int64) * HV + i_h) * K + o_k[None, :]
    tl.store(dq + p_kept, b_dq, mask=m_keep[:, None])  # a replayed row's dq is 0 (its do is 0): not kept
    tl.store(dk + p_kept, b_dk, mask=m_keep[:, None])
    tl.store(dg + p_kept, b_dg, mask=m_keep[:, None])
    if GATHER:
        p_side = ((-1 - kept)[:, None].to(tl.int64) * HV + i_h) * K + o_k[None, :]
        m_side = m & ~m_keep
        tl.store(side_dk + p_side, b_dk, mask=m_side[:, None])
        tl.store(side_dg + p_side, b_dg, mask=m_side[:, None])
    return tl.sum(k_i * xk, 1), carry + b_sum


@triton.jit
def _store_dbeta(dbeta, side_dbeta, dbeta_p, rows, m, kept, m_keep, i_h, b_acc, HV: tl.constexpr,
                 GATHER: tl.constexpr):
    b_db = tl.load(dbeta_p + rows.to(tl.int64) * HV + i_h, mask=m, other=0.0) + b_acc
    tl.store(dbeta + kept.to(tl.int64) * HV + i_h, b_db, mask=m_keep)
    if GATHER:
        tl.store(side_dbeta + (-1 - kept).to(tl.int64) * HV + i_h, b_db, mask=m & ~m_keep)


@triton.jit
def _intra_bwd_chunk(q, k, beta, gc, dAqk, dAkk, dq_p, dk_p, dgc_p, dbeta_p, dq, dk, dg, dbeta, side_dk, side_dg,
                     side_dbeta, chunk_row_start, chunk_row_end, row_src, row_own, shift, HK: tl.constexpr,
                     HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, GATHER: tl.constexpr):
    i_ch = tl.program_id(0)
    i_c, i_h = i_ch // HV, i_ch % HV
    i_hk = i_h // (HV // HK)
    row0, row_end, r0, m0, s0, r1, m1, s1, r2, m2, s2, r3, m3, s3 = _chunk_blocks(
        chunk_row_start, chunk_row_end, row_src, i_c, shift, GATHER)
    o0, n0 = _kept_rows(row_own, r0, m0, shift, GATHER)
    o1, n1 = _kept_rows(row_own, r1, m1, shift, GATHER)
    o2, n2 = _kept_rows(row_own, r2, m2, shift, GATHER)
    o3, n3 = _kept_rows(row_own, r3, m3, shift, GATHER)
    b0, b1, b2, b3 = _block_betas(beta, s0, m0, s1, m1, s2, m2, s3, m3, i_h, HV)
    db0 = tl.zeros([16], dtype=tl.float32)
    db1 = tl.zeros([16], dtype=tl.float32)
    db2 = tl.zeros([16], dtype=tl.float32)
    db3 = tl.zeros([16], dtype=tl.float32)
    for i_k in range(0, K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        g0, g1, g2, g3 = _block_tiles(gc + i_h * K, r0, m0, r1, m1, r2, m2, r3, m3, HV * K, 0, o_k)
        k0, k1, k2, k3 = _block_tiles(k, s0, m0, s1, m1, s2, m2, s3, m3, HK * K, i_hk * K, o_k)
        q0, q1, q2, q3 = _block_tiles(q, s0, m0, s1, m1, s2, m2, s3, m3, HK * K, i_hk * K, o_k)
        kb1 = k1 * b1[:, None]
        kb2 = k2 * b2[:, None]
        kb3 = k3 * b3[:, None]
        # the diagonal blocks' terms are in the partials already (diag_bwd.py)
        xq0, xk0, zq0, zk0 = tl.zeros_like(g0), tl.zeros_like(g0), tl.zeros_like(g0), tl.zeros_like(g0)
        xq1, xk1, zq1, zk1 = tl.zeros_like(g0), tl.zeros_like(g0), tl.zeros_like(g0), tl.zeros_like(g0)
        xq2, xk2, zq2, zk2 = tl.zeros_like(g0), tl.zeros_like(g0), tl.zeros_like(g0), tl.zeros_like(g0)
        xq3, xk3, zq3, zk3 = tl.zeros_like(g0), tl.zeros_like(g0), tl.zeros_like(g0), tl.zeros_like(g0)
        # off-diagonal blocks (I, J), I > J: X of I split at the last row of block I - 1, Z of J at J's last row
        # split points: gc of each block's last row (a padding row loads 0: every later row is padding then)
        p_l = gc + i_h * K + o_k
        l_0 = tl.load(p_l + (row0 + 15).to(tl.int64) * (HV * K), mask=(o_k * 0 + row0 + 15) < row_end, other=0.0)
        l_1 = tl.load(p_l + (row0 + 31).to(tl.int64) * (HV * K), mask=(o_k * 0 + row0 + 31) < row_end, other=0.0)
        l_2 = tl.load(p_l + (row0 + 47).to(tl.int64) * (HV * K), mask=(o_k * 0 + row0 + 47) < row_end, other=0.0)
        xq1, xk1, zq0, zk0 = _off_block(dAqk, dAkk, r1, m1, i_h, 0, q1, kb1, g1, k0, g0, l_0, l_0,
                                        xq1, xk1, zq0, zk0, HV, BT)  # (1, 0)
        xq2, xk2, zq0, zk0 = _off_block(dAqk, dAkk, r2, m2, i_h, 0, q2, kb2, g2, k0, g0, l_1, l_0,
                                        xq2, xk2, zq0, zk0, HV, BT)  # (2, 0)
        xq2, xk2, zq1, zk1 = _off_block(dAqk, dAkk, r2, m2, i_h, 16, q2, kb2, g2, k1, g1, l_1, l_1,
                                        xq2, xk2, zq1, zk1, HV, BT)  # (2, 1)
        xq3, xk3, zq0, zk0 = _off_block(dAqk, dAkk, r3, m3, i_h, 0, q3, kb3, g3, k0, g0, l_2, l_0,
                                        xq3, xk3, zq0, zk0, HV, BT)  # (3, 0)
        xq3, xk3, zq1, zk1 = _off_block(dAqk, dAkk, r3, m3, i_h, 16, q3, kb3, g3, k1, g1, l_2, l_1,
                                        xq3, xk3, zq1, zk1, HV, BT)  # (3, 1)
        xq3, xk3, zq2, zk2 = _off_block(dAqk, dAkk, r3, m3, i_h, 32, q3, kb3, g3, k2, g2, l_2, l_2,
                                        xq3, xk3, zq2, zk2, HV, BT)  # (3, 2)
        # the blocks from last to first: dg's reverse cumsum carries the later blocks' sums
        carry = tl.zeros([BK], dtype=tl.float32)
        d, carry = _finish_block(dq, dk, dg, side_dk, side_dg, dq_p, dk_p, dgc_p, r3, m3, o3, n3, i_h, o_k, q3, k3,
                                 b3, xq3, xk3, zq3, zk3, carry, HV, K, GATHER)
        db3 += d
        d, carry = _finish_block(dq, dk, dg, side_dk, side_dg, dq_p, dk_p, dgc_p, r2, m2, o2, n2, i_h, o_k, q2, k2,
                                 b2, xq2, xk2, zq2, zk2, carry, HV, K, GATHER)
        db2 += d
        d, carry = _finish_block(dq, dk, dg, side_dk, side_dg, dq_p, dk_p, dgc_p, r1, m1, o1, n1, i_h, o_k, q1, k1,
                                 b1, xq1, xk1, zq1, zk1, carry, HV, K, GATHER)
        db1 += d
        d, carry = _finish_block(dq, dk, dg, side_dk, side_dg, dq_p, dk_p, dgc_p, r0, m0, o0, n0, i_h, o_k, q0, k0,
                                 b0, xq0, xk0, zq0, zk0, carry, HV, K, GATHER)
        db0 += d
    _store_dbeta(dbeta, side_dbeta, dbeta_p, r0, m0, o0, n0, i_h, db0, HV, GATHER)
    _store_dbeta(dbeta, side_dbeta, dbeta_p, r1, m1, o1, n1, i_h, db1, HV, GATHER)
    _store_dbeta(dbeta, side_dbeta, dbeta_p, r2, m2, o2, n2, i_h, db2, HV, GATHER)
    _store_dbeta(dbeta, side_dbeta, dbeta_p, r3, m3, o3, n3, i_h, db3, HV, GATHER)


@triton.jit
def _intra_bwd_kernel(q, k, beta, gc, dAqk, dAkk, dq_p, dk_p, dgc_p, dbeta_p, dq, dk, dg, dbeta, side_dk, side_dg,
                      side_dbeta, chunk_row_start, chunk_row_end, row_src, row_own, chunk_shift, HK: tl.constexpr,
                      HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, GATHER: tl.constexpr):
    shift, affine = _chunk_shift(chunk_shift, tl.program_id(0) // HV, GATHER)
    if affine:
        _intra_bwd_chunk(q, k, beta, gc, dAqk, dAkk, dq_p, dk_p, dgc_p, dbeta_p, dq, dk, dg, dbeta, side_dk, side_dg,
                         side_dbeta, chunk_row_start, chunk_row_end, row_src, row_own, shift, HK, HV, K, BT, BK, False)
    else:
        _intra_bwd_chunk(q, k, beta, gc, dAqk, dAkk, dq_p, dk_p, dgc_p, dbeta_p, dq, dk, dg, dbeta, side_dk, side_dg,
                         side_dbeta, chunk_row_start, chunk_row_end, row_src, row_own, 0, HK, HV, K, BT, BK, GATHER)
