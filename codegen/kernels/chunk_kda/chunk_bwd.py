"""Backward, chunk-parallel part 1: the inter-chunk terms and the WY backward (partial gradients on packed rows).

Inter-chunk kernel, per chunk and value head, over V blocks, all K at once (as GDN's dq/dk kernel):
  o = scale (qg h + Aqk vn), qg = exp(gc) q      ->  dq = scale exp(gc) (do h^T),  dAqk = scale lower(do vn^T)
  S' = diag(exp(gl)) h + kg^T vn, kg = exp(gl - gc) k  ->  dk = exp(gl - gc) (vn dh^T)
  vn = u - w h                                   ->  dw = -dvn h^T
  and the gate terms: dgc += q dq - k dk (per channel), dgl = exp(gl) sum_v h dh + sum_i k_i dk_i, added to the
  chunk's last row (gl is its gc).
WY kernel, through w = T (beta exp(gc) k), u = T (beta v), T = (I + Akk)^-1:
  dT = dw (beta exp(gc) k)^T + du (beta v)^T,  dAkk = -strictly_lower(T^T dT T^T)  (stored for intra_bwd.py)
  dk += beta exp(gc) T^T dw,  dgc += beta exp(gc) k T^T dw,  dv = beta T^T du,  dbeta = sums of both.
Both kernels write packed-row fp32 partials that each program owns (no atomics); dv is final (kept rows at
compact tokens, replayed rows into the side buffer).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_gdn.gates import LOG2E, _chunk_shift, _exp_gate_gap
from ..chunk_gdn.index import chunk_shift_table, row_tables
from ..interpreter_safe import interpreting
from .diag_bwd import _diag_bwd_kernel
from .intra_bwd import _intra_bwd_kernel
from .programs import _chunk_program


@triton.jit
def _bwd_inter_chunk(q, k, gc, v_new, h, dh, do, dvn, dq, dk, dgc, dw, dAqk, chunk_row_start, chunk_row_end, row_src,
                     row_own, shift, scale, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, BV: tl.constexpr, GATHER: tl.constexpr):
    i_c, i_h, i_hk, row0, row_end, rows64, m_t, src, kept, m_keep = _chunk_program(
        tl.program_id(0), chunk_row_start, chunk_row_end, row_src, row_own, shift, HK, HV, BT, GATHER)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    state = (i_c.to(tl.int64) * HV + i_h) * (K * V)

    b_dqg = tl.zeros([BT, K], dtype=tl.float32)     # do h^T
    b_dkg = tl.zeros([BT, K], dtype=tl.float32)     # vn dh^T
    b_dw = tl.zeros([BT, K], dtype=tl.float32)      # dvn h^T
    b_da = tl.zeros([BT, BT], dtype=tl.float32)     # do vn^T
    b_dgl = tl.zeros([K], dtype=tl.float32)         # sum_v h dh
    for i_v in range(0, V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        p_v = (rows64[:, None] * HV + i_h) * V + o_v[None, :]
        b_vn = tl.load(v_new + p_v, mask=m_t[:, None], other=0.0)
        b_vnt = tl.load(v_new + (rows64[None, :] * HV + i_h) * V + o_v[:, None], mask=m_t[None, :], other=0.0)
        b_do = tl.load(do + (kept[:, None] * HV + i_h) * V + o_v[None, :], mask=m_keep[:, None], other=0.0)
        b_dvn = tl.load(dvn + p_v, mask=m_t[:, None], other=0.0)
        b_ht = tl.load(h + state + o_v[:, None] + o_k[None, :] * V)        # [BV, K]
        b_dht = tl.load(dh + state + o_v[:, None] + o_k[None, :] * V)      # [BV, K]
        b_dgl += tl.sum(b_ht.to(tl.float32) * b_dht.to(tl.float32), 0)
        b_da += tl.dot(b_do.to(b_vnt.dtype), b_vnt)
        b_dqg += tl.dot(b_do.to(b_ht.dtype), b_ht)
        b_dkg += tl.dot(b_vn, b_dht)
        b_dw += tl.dot(b_dvn.to(b_ht.dtype), b_ht)

    p_k = (rows64[:, None] * HV + i_h) * K + o_k[None, :]
    b_q = tl.load(q + src[:, None] * (HK * K) + i_hk * K + o_k[None, :], mask=m_t[:, None], other=0.0).to(tl.float32)
    b_k = tl.load(k + src[:, None] * (HK * K) + i_hk * K + o_k[None, :], mask=m_t[:, None], other=0.0).to(tl.float32)
    b_gc = tl.load(gc + p_k, mask=m_t[:, None], other=0.0)
    last = row_end - 1 - row0
    b_gl = tl.load(gc + ((row_end - 1).to(tl.int64) * HV + i_h) * K + o_k)

    b_dq = b_dqg * tl.exp2(b_gc * LOG2E) * scale
    b_dk = b_dkg * _exp_gate_gap(b_gl[None, :] - b_gc)
    b_dgc = b_dq * b_q - b_dk * b_k
    b_dgl = b_dgl * tl.exp2(b_gl * LOG2E) + tl.sum(b_dk * b_k, 0)
    b_dgc += tl.where((o_t == last)[:, None], b_dgl[None, :], 0.0)
    b_da = tl.where(o_t[:, None] >= o_t[None, :], b_da * scale, 0.0)

    tl.store(dq + p_k, b_dq, mask=m_t[:, None])
    tl.store(dk + p_k, b_dk, mask=m_t[:, None])
    tl.store(dgc + p_k, b_dgc, mask=m_t[:, None])
    tl.store(dw + p_k, -b_dw, mask=m_t[:, None])
    tl.store(dAqk + (rows64[:, None] * HV + i_h) * BT + o_t[None, :], b_da, mask=m_t[:, None])


@triton.jit
def _bwd_inter_kernel(q, k, gc, v_new, h, dh, do, dvn, dq, dk, dgc, dw, dAqk, chunk_row_start, chunk_row_end, row_src,
                      row_own, chunk_shift, scale, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, GATHER: tl.constexpr):
    shift, affine = _chunk_shift(chunk_shift, tl.program_id(0) // HV, GATHER)
    if affine:
        _bwd_inter_chunk(q, k, gc, v_new, h, dh, do, dvn, dq, dk, dgc, dw, dAqk, chunk_row_start, chunk_row_end,
                         row_src, row_own, shift, scale, HK, HV, K, V, BT, BV, False)
    else:
        _bwd_inter_chunk(q, k, gc, v_new, h, dh, do, dvn, dq, dk, dgc, dw, dAqk, chunk_row_start, chunk_row_end,
                         row_src, row_own, 0, scale, HK, HV, K, V, BT, BV, GATHER)


@triton.jit
def _wy_bwd_chunk(k, v, beta, gc, T, dw, du, dk, dgc, dbeta, dAkk, dv, side_dv, chunk_row_start, chunk_row_end,
                  row_src, row_own, shift, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATHER: tl.constexpr):
    i_c, i_h, i_hk, row0, row_end, rows64, m_t, src, kept, m_keep = _chunk_program(
        tl.program_id(0), chunk_row_start, chunk_row_end, row_src, row_own, shift, HK, HV, BT, GATHER)
    m_side = m_t & ~m_keep
    slot = -1 - kept  # side-buffer row of a replayed row (garbage, and masked, elsewhere)
    o_t = tl.arange(0, BT)
    dt = k.dtype.element_ty

    b_b = tl.load(beta + src * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_tt = tl.load(T + (rows64[None, :] * HV + i_h) * BT + o_t[:, None], mask=m_t[None, :], other=0.0).to(dt)  # T^T

    b_dt = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_kt = tl.load(k + src[None, :] * (HK * K) + i_hk * K + o_k[:, None], mask=m_t[None, :], other=0.0)
        b_gct = tl.load(gc + (rows64[None, :] * HV + i_h) * K + o_k[:, None], mask=m_t[None, :], other=0.0)
        b_dwt = tl.load(dw + (rows64[:, None] * HV + i_h) * K + o_k[None, :], mask=m_t[:, None], other=0.0)
        b_kbt = b_kt.to(tl.float32) * tl.exp2(b_gct * LOG2E) * b_b[None, :]
        b_dt += tl.dot(b_dwt.to(dt), b_kbt.to(dt))
    for i_v in range(0, V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        b_du = tl.load(du + (rows64[:, None] * HV + i_h) * V + o_v[None, :], mask=m_t[:, None], other=0.0)
        b_vt = tl.load(v + (src[None, :] * HV + i_h) * V + o_v[:, None], mask=m_t[None, :], other=0.0)
        b_dt += tl.dot(b_du.to(dt), (b_vt.to(tl.float32) * b_b[None, :]).to(dt))
    # T = (I + A)^-1  =>  dA = -T^T dT T^T, kept strictly lower
    b_da = -tl.dot(tl.dot(b_tt, b_dt.to(dt)).to(dt), b_tt)
    b_da = tl.where(o_t[:, None] > o_t[None, :], b_da, 0.0)
    tl.store(dAkk + (rows64[:, None] * HV + i_h) * BT + o_t[None, :], b_da, mask=m_t[:, None])

    b_db = tl.zeros([BT], dtype=tl.float32)
    for i_k in range(0, K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        p_k = (rows64[:, None] * HV + i_h) * K + o_k[None, :]
        b_k = tl.load(k + src[:, None] * (HK * K) + i_hk * K + o_k[None, :], mask=m_t[:, None],
                      other=0.0).to(tl.float32)
        b_eg = tl.exp2(tl.load(gc + p_k, mask=m_t[:, None], other=0.0) * LOG2E)
        b_dwt = tl.load(dw + p_k, mask=m_t[:, None], other=0.0)
        b_dkb = tl.dot(b_tt, b_dwt.to(dt))                                # d(beta exp(gc) k)
        b_kb = b_dkb * b_k * b_eg
        b_db += tl.sum(b_kb, 1)
        tl.store(dgc + p_k, tl.load(dgc + p_k, mask=m_t[:, None], other=0.0) + b_kb * b_b[:, None],
                 mask=m_t[:, None])
        tl.store(dk + p_k, tl.load(dk + p_k, mask=m_t[:, None], other=0.0) + b_dkb * b_eg * b_b[:, None],
                 mask=m_t[:, None])
    for i_v in range(0, V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        b_du = tl.load(du + (rows64[:, None] * HV + i_h) * V + o_v[None, :], mask=m_t[:, None], other=0.0)
        b_v = tl.load(v + (src[:, None] * HV + i_h) * V + o_v[None, :], mask=m_t[:, None], other=0.0)
        b_dvb = tl.dot(b_tt, b_du.to(dt))
        b_db += tl.sum(b_dvb * b_v.to(tl.float32), 1)
        b_dv = b_dvb * b_b[:, None]
        tl.store(dv + (kept[:, None] * HV + i_h) * V + o_v[None, :], b_dv, mask=m_keep[:, None])
        if GATHER:
            tl.store(side_dv + (slot[:, None] * HV + i_h) * V + o_v[None, :], b_dv, mask=m_side[:, None])
    tl.store(dbeta + rows64 * HV + i_h, b_db, mask=m_t)


@triton.jit
def _wy_bwd_kernel(k, v, beta, gc, T, dw, du, dk, dgc, dbeta, dAkk, dv, side_dv, chunk_row_start, chunk_row_end,
                   row_src, row_own, chunk_shift, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                   V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATHER: tl.constexpr):
    shift, affine = _chunk_shift(chunk_shift, tl.program_id(0) // HV, GATHER)
    if affine:
        _wy_bwd_chunk(k, v, beta, gc, T, dw, du, dk, dgc, dbeta, dAkk, dv, side_dv, chunk_row_start, chunk_row_end,
                      row_src, row_own, shift, HK, HV, K, V, BT, BK, BV, False)
    else:
        _wy_bwd_chunk(k, v, beta, gc, T, dw, du, dk, dgc, dbeta, dAkk, dv, side_dv, chunk_row_start, chunk_row_end,
                      row_src, row_own, 0, HK, HV, K, V, BT, BK, BV, GATHER)


def chunk_bwd(q, k, v, beta, gc, T, v_new, h, dh, do, dvn, scale, index, config, rows=None):
    """Returns dq, dk [n, HV, K], dv [n, HV, V], dbeta [n, HV], dg [n, HV, K], all fp32 per value head, on the
    packed rows (n = R) or with `rows` (index.PackedRows: q, k, v, beta, do compact) on the compact tokens
    (n = T), and then a sixth value: the replayed rows' dk, dv, dbeta, dg [rows.num_replays, ...] by replay
    slot, for the caller to add to the tokens they replay (their dq is 0)."""
    _, hk, kd = q.shape
    hv, vd = v.shape[1], v.shape[2]
    n_rows, dev = gc.shape[0], q.device
    BT = index.chunk_size
    f32 = dict(device=dev, dtype=torch.float32)

    def dk_dv_dbeta_dg(n):
        return (torch.empty(n, hv, kd, **f32), torch.empty(n, hv, vd, **f32), torch.empty(n, hv, **f32),
                torch.empty(n, hv, kd, **f32))
    n_out = n_rows if rows is None else rows.num_tokens
    dq = torch.empty(n_out, hv, kd, **f32)
    out = dk_dv_dbeta_dg(n_out)
    side = out if rows is None else dk_dv_dbeta_dg(rows.num_replays)
    # packed-row partials: each written and re-read by the program of its chunk
    dq_p, dk_p, dgc_p, dw = (torch.empty(n_rows, hv, kd, **f32) for _ in range(4))
    dbeta_p = torch.empty(n_rows, hv, **f32)
    dAqk, dAkk = torch.empty(n_rows, hv, BT, **f32), torch.empty(n_rows, hv, BT, **f32)
    if index.num_chunks:
        tables = (index.chunk_row_start, index.chunk_row_end, *row_tables(index, rows), chunk_shift_table(index, rows))
        gather = rows is not None
        grid = (index.num_chunks * hv,)
        bv = min(config.bwd_block_v, vd)
        _bwd_inter_kernel[grid](q, k, gc, v_new, h, dh, do, dvn, dq_p, dk_p, dgc_p, dw, dAqk, *tables, scale, HK=hk,
                                HV=hv, K=kd, V=vd, BT=BT, BV=bv, GATHER=gather, num_warps=config.bwd_inter_warps)
        _wy_bwd_kernel[grid](k, v, beta, gc, T, dw, dvn, dk_p, dgc_p, dbeta_p, dAkk, out[1], side[1], *tables, HK=hk,
                             HV=hv, K=kd, V=vd, BT=BT, BK=min(64, kd), BV=bv, GATHER=gather,
                             num_warps=config.wy_bwd_warps)
        heads = config.diag_bwd_heads
        _diag_bwd_kernel[(index.num_chunks * BT, triton.cdiv(hv, heads))](
            q, k, beta, gc, dAqk, dAkk, dq_p, dk_p, dgc_p, dbeta_p, *tables[:3], HK=hk, HV=hv, K=kd, BT=BT, BH=heads,
            GATHER=gather, INTERPRET=interpreting(), num_warps=config.diag_bwd_warps)
        _intra_bwd_kernel[grid](q, k, beta, gc, dAqk, dAkk, dq_p, dk_p, dgc_p, dbeta_p, dq, out[0], out[3], out[2],
                                side[0], side[3], side[2], *tables, HK=hk, HV=hv, K=kd, BT=BT,
                                BK=min(config.intra_block_k, kd), GATHER=gather, num_warps=config.intra_bwd_warps)
    grads = (dq, *out)  # dq, dk, dv, dbeta, dg
    return grads if rows is None else (*grads, side)
