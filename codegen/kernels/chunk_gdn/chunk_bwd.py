"""Backward, chunk-parallel part: dq, dk, dw, dgc of each chunk, then back through the WY representation.

No kernel here transposes a dot accumulator with tl.trans before another dot (Triton 3.6 on Hopper
miscompiles that, docs/gdn_kernels.md): transposed products are computed as their own dots, or go through a small
per-program scratch buffer. Loaded (or elementwise-scaled) tiles are transposed with tl.trans, which only changes
how the dot reads them from shared memory (no second transposed load from global memory).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gates import LOG2E, _chunk_rows, _chunk_shift, _exp_gate_gap, _input_rows, _kept_rows
from .index import chunk_shift_table, row_tables
from ..scaled16 import ScaledRows, _load_scaled, _store_scaled, kernel_pointers


@triton.jit
def _chunk_bwd_qk_chunk(q, k, v_new, gc, h, dh, do, dvn, dq, dk, dw, dgc, dq_inv, dk_inv, chunk_row_start,
                        chunk_row_end, row_src, row_own, shift, scale, HK: tl.constexpr, HV: tl.constexpr,
                        K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, GATHER: tl.constexpr,
                        SCALED: tl.constexpr):
    """One program per chunk and value head, all K columns (programs over K blocks, each recomputing the
    [BT, BT] do.v_new tiles, were no faster). GATHER: q, k, do are compact (index.PackedRows); dq of kept rows
    goes to compact rows. A replayed row's dq is exactly 0 (dq_i is linear in do_i, and a replayed row's do is
    0), so it is not stored."""
    i_ch = tl.program_id(0)
    i_c, i_h = i_ch // HV, i_ch % HV
    i_hk = i_h // (HV // HK)
    row0, row_end, rows, m_t = _chunk_rows(chunk_row_start, chunk_row_end, i_c, BT)
    src = _input_rows(row_src, rows, m_t, shift, GATHER)
    kept, m_keep = _kept_rows(row_own, rows, m_t, shift, GATHER)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    state = (i_c.to(tl.int64) * HV + i_h) * (K * V)

    # q and k load before the V loop, not after it where they are first used: their copies into shared memory (both
    # feed dots) overlap the loop's work instead of stalling the program after it (at one program per SM nothing
    # else hides that wait); on plain rows the kernel also compiles to fewer registers (232 against 255, no spill)
    b_q = tl.load(q + src[:, None] * (HK * K) + i_hk * K + o_k[None, :], mask=m_t[:, None], other=0.0)
    b_k = tl.load(k + src[:, None] * (HK * K) + i_hk * K + o_k[None, :], mask=m_t[:, None], other=0.0)
    b_dq = tl.zeros([BT, K], dtype=tl.float32)       # do h^T
    b_dk = tl.zeros([BT, K], dtype=tl.float32)       # v_new dh^T
    b_dw = tl.zeros([BT, K], dtype=tl.float32)       # dvn h^T
    b_da = tl.zeros([BT, BT], dtype=tl.float32)      # [i, j] do_i . v_new_j
    b_dat = tl.zeros([BT, BT], dtype=tl.float32)     # [j, i] the same, transposed by its own dot
    b_dgl = tl.zeros([K], dtype=tl.float32)          # sum(h * dh), reduced below
    for i_v in range(0, V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        b_vn = tl.load(v_new + (rows[:, None] * HV + i_h) * V + o_v[None, :], mask=m_t[:, None], other=0.0)
        b_do = tl.load(do + (kept[:, None] * HV + i_h) * V + o_v[None, :], mask=m_keep[:, None], other=0.0)
        b_dvn = tl.load(dvn + (rows[:, None] * HV + i_h) * V + o_v[None, :], mask=m_t[:, None], other=0.0)
        b_ht = tl.load(h + state + o_v[:, None] + o_k[None, :] * V)        # [BV, K]
        b_dht = tl.load(dh + state + o_v[:, None] + o_k[None, :] * V)      # [BV, K]
        b_dgl += tl.sum(b_ht.to(tl.float32) * b_dht.to(tl.float32), 0)
        b_da += tl.dot(b_do, tl.trans(b_vn))
        b_dat += tl.dot(b_vn, tl.trans(b_do))
        b_dq += tl.dot(b_do, b_ht)
        b_dk += tl.dot(b_vn, b_dht)
        b_dw += tl.dot(b_dvn.to(b_ht.dtype), b_ht)

    b_gc = tl.load(gc + rows * HV + i_h, mask=m_t, other=0.0)
    last = row_end - 1 - row0
    b_gl = tl.sum(tl.where(o_t == last, b_gc, 0.0))

    # inter-chunk terms: o += scale exp(gc) q h ;  S_next += k^T (exp(gc_last - gc) vn)
    b_dq = b_dq * (tl.exp2(b_gc * LOG2E) * scale)[:, None]
    b_dk = tl.where(m_t[:, None], b_dk * tl.exp2((b_gl - b_gc) * LOG2E)[:, None], 0.0)
    b_dgc = tl.sum(b_dq * b_q.to(tl.float32), 1) - tl.sum(b_dk * b_k.to(tl.float32), 1)
    b_dgl = tl.sum(b_dgl) * tl.exp2(b_gl * LOG2E) + tl.sum(b_dk * b_k.to(tl.float32))

    # intra-chunk attention: o_i += scale sum_{j<=i} (q_i.k_j) exp(gc_i - gc_j) vn_j
    m_a = o_t[:, None] >= o_t[None, :]
    b_da = tl.where(m_a, b_da * _exp_gate_gap(b_gc[:, None] - b_gc[None, :]) * scale, 0.0)
    b_dat = tl.where(o_t[:, None] <= o_t[None, :], b_dat * _exp_gate_gap(b_gc[None, :] - b_gc[:, None]) * scale, 0.0)
    b_dq += tl.dot(b_da.to(b_k.dtype), b_k)
    b_dk += tl.dot(b_dat.to(b_q.dtype), b_q)
    b_m = b_da * tl.dot(b_q, tl.trans(b_k))
    b_dgc += tl.sum(b_m, 1) - tl.sum(b_m, 0)
    b_dgc += tl.where(o_t == last, b_dgl, 0.0)

    p_rows = (rows[:, None] * HV + i_h) * K + o_k[None, :]
    p_dq = (kept[:, None] * HV + i_h) * K + o_k[None, :]
    if SCALED:  # dq and dk's first share row-scaled fp16 (scaled16.py)
        _store_scaled(dq, dq_inv, p_dq, kept * HV + i_h, b_dq, m_keep)
        _store_scaled(dk, dk_inv, p_rows, rows * HV + i_h, b_dk, m_t)
    else:
        tl.store(dq + p_dq, b_dq.to(dq.dtype.element_ty), mask=m_keep[:, None])
        tl.store(dk + p_rows, b_dk.to(dk.dtype.element_ty), mask=m_t[:, None])
    tl.store(dw + p_rows, (-b_dw).to(dw.dtype.element_ty), mask=m_t[:, None])
    tl.store(dgc + rows * HV + i_h, b_dgc, mask=m_t)


@triton.jit
def _chunk_bwd_qk_kernel(q, k, v_new, gc, h, dh, do, dvn, dq, dk, dw, dgc, dq_inv, dk_inv, chunk_row_start,
                         chunk_row_end, row_src, row_own, chunk_shift, scale, HK: tl.constexpr, HV: tl.constexpr,
                         K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, GATHER: tl.constexpr,
                         SCALED: tl.constexpr):
    """Chunks without replayed rows run the plain-row code at row + their shift, the others
    through the row maps (GATHER) or on plain rows."""
    shift, affine = _chunk_shift(chunk_shift, tl.program_id(0) // HV, GATHER)
    if affine:
        _chunk_bwd_qk_chunk(q, k, v_new, gc, h, dh, do, dvn, dq, dk, dw, dgc, dq_inv, dk_inv, chunk_row_start,
            chunk_row_end, row_src, row_own, shift, scale, HK, HV, K, V, BT, BV, False, SCALED)
    else:
        _chunk_bwd_qk_chunk(q, k, v_new, gc, h, dh, do, dvn, dq, dk, dw, dgc, dq_inv, dk_inv, chunk_row_start,
            chunk_row_end, row_src, row_own, 0, scale, HK, HV, K, V, BT, BV, GATHER, SCALED)


@triton.jit
def _wy_bwd_chunk(k, v, beta, gc, T, dw, du, dk, dgc, dk_out, dv, dbeta, dg, side_dk, side_dv, side_dbeta, side_dg,
                  scratch, dk_inv, dk_out_inv, chunk_row_start, chunk_row_end, row_src, row_own, shift,
                  HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, GATHER: tl.constexpr, SCALED: tl.constexpr,
                  SCALED_OUT: tl.constexpr):
    """Through w = T (beta exp(gc) k), u = T (beta v), T = (I + A)^-1, A = (beta k k^T exp(gc_i - gc_j))_{i>j}.

    dk and dgc arrive holding the chunk_bwd_qk contributions; the total dk leaves in dk_out and dg as the
    reverse in-chunk cumsum of dgc (dg may be dgc itself). K and V are walked in blocks so that only [BT, 64]
    tiles stay live: K twice (dT and k k^T, then dk, which needs dA from all of dT), V once. GATHER: k, v, beta
    are compact (index.PackedRows); the gradients of kept rows go to compact rows, those of replayed rows to their
    slots of the side buffers.
    """
    i_ch = tl.program_id(0)
    i_c, i_h = i_ch // HV, i_ch % HV
    i_hk = i_h // (HV // HK)
    row0, row_end, rows, m_t = _chunk_rows(chunk_row_start, chunk_row_end, i_c, BT)
    src = _input_rows(row_src, rows, m_t, shift, GATHER)
    kept, m_keep = _kept_rows(row_own, rows, m_t, shift, GATHER)
    m_side = m_t & ~m_keep
    slot = -1 - kept  # side-buffer row of a replayed row (garbage, and masked, elsewhere)
    o_t = tl.arange(0, BT)
    dt = k.dtype.element_ty

    b_b = tl.load(beta + src * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_gc = tl.load(gc + rows * HV + i_h, mask=m_t, other=0.0)
    b_eg = tl.exp2(b_gc * LOG2E)
    b_tt = tl.load(T + (rows[None, :] * HV + i_h) * BT + o_t[:, None], mask=m_t[None, :], other=0.0).to(dt)  # T_ji

    # dT = dw (beta exp(gc) k)^T + du (beta v)^T. Each loop also does the work that needs no dT and reads the tiles it
    # has loaded: k k^T beside dT's k blocks, dv = T^T du beta (and its share of dbeta) beside its du and v blocks, so
    # k, du and v are read once here instead of again in loops of their own
    b_dt = tl.zeros([BT, BT], dtype=tl.float32)
    b_kk = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_k = tl.load(k + src[:, None] * (HK * K) + i_hk * K + o_k[None, :], mask=m_t[:, None], other=0.0)
        b_kk += tl.dot(b_k, tl.trans(b_k))
        b_dw = tl.load(dw + (rows[:, None] * HV + i_h) * K + o_k[None, :], mask=m_t[:, None], other=0.0)
        b_dt += tl.dot(b_dw.to(dt), tl.trans((b_k * (b_b * b_eg)[:, None]).to(dt)))
    b_dbv = tl.zeros([BT], dtype=tl.float32)  # dv's share of dbeta, added to b_db once that exists
    for i_v in range(0, V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        p_rv = (rows[:, None] * HV + i_h) * V + o_v[None, :]
        b_du = tl.load(du + p_rv, mask=m_t[:, None], other=0.0)
        b_v = tl.load(v + (src[:, None] * HV + i_h) * V + o_v[None, :], mask=m_t[:, None], other=0.0)
        b_dt += tl.dot(b_du.to(dt), tl.trans((b_v * b_b[:, None]).to(dt)))
        b_dvb = tl.dot(b_tt, b_du.to(dt))
        b_dbv += tl.sum(b_dvb * b_v.to(tl.float32), 1)
        tl.store(dv + (kept[:, None] * HV + i_h) * V + o_v[None, :], (b_dvb * b_b[:, None]).to(dv.dtype.element_ty),
                 mask=m_keep[:, None])
        if GATHER:
            tl.store(side_dv + (slot[:, None] * HV + i_h) * V + o_v[None, :],
                     (b_dvb * b_b[:, None]).to(side_dv.dtype.element_ty), mask=m_side[:, None])

    # T = (I + A)^-1  =>  dA = -T^T dT T^T, kept strictly lower
    m_lower = o_t[:, None] > o_t[None, :]
    b_da = -tl.dot(tl.dot(b_tt, b_dt.to(dt)).to(dt), b_tt)
    b_decay = tl.where(m_lower, _exp_gate_gap(b_gc[:, None] - b_gc[None, :]), 0.0)
    b_da = tl.where(m_lower, b_da, 0.0)
    b_dkk = b_da * b_decay                                             # d(k_i . k_j) / beta_i, i > j
    b_db = tl.sum(b_dkk * b_kk, 1)
    b_dgc_a = b_dkk * b_kk * b_b[:, None]                              # dA * A
    b_dgc = tl.load(dgc + rows * HV + i_h, mask=m_t, other=0.0) + tl.sum(b_dgc_a, 1) - tl.sum(b_dgc_a, 0)
    b_dkk = (b_dkk * b_b[:, None]).to(dt)
    # the other side of k_i . k_j needs b_dkk^T: round trip through this program's scratch tile
    p_s = scratch + i_ch.to(tl.int64) * (BT * BT)
    tl.store(p_s + o_t[:, None] * BT + o_t[None, :], b_dkk)
    tl.debug_barrier()
    b_dkkt = tl.load(p_s + o_t[None, :] * BT + o_t[:, None])

    # dk += T^T dw * beta exp(gc) + dkk k + dkk^T k
    for i_k in range(0, K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        p_rk = (rows[:, None] * HV + i_h) * K + o_k[None, :]
        b_k = tl.load(k + src[:, None] * (HK * K) + i_hk * K + o_k[None, :], mask=m_t[:, None], other=0.0)
        b_dw = tl.load(dw + p_rk, mask=m_t[:, None], other=0.0)
        b_dkb = tl.dot(b_tt, b_dw.to(dt))
        b_kb = tl.sum(b_dkb * b_k.to(tl.float32), 1)
        b_db += b_kb * b_eg
        b_dgc += b_kb * b_b * b_eg
        if SCALED:
            b_dk = _load_scaled(dk, dk_inv, p_rk, (rows * HV + i_h)[:, None], m_t)
        else:
            b_dk = tl.load(dk + p_rk, mask=m_t[:, None], other=0.0).to(tl.float32)
        b_dk += b_dkb * (b_b * b_eg)[:, None]
        b_dk += tl.dot(b_dkk, b_k) + tl.dot(b_dkkt, b_k)
        p_out = (kept[:, None] * HV + i_h) * K + o_k[None, :]
        if SCALED_OUT:  # one scale per row and block of BK columns
            _store_scaled(dk_out, dk_out_inv, p_out, (kept * HV + i_h) * (K // BK) + i_k, b_dk, m_keep)
        else:
            tl.store(dk_out + p_out, b_dk.to(dk_out.dtype.element_ty), mask=m_keep[:, None])
        if GATHER:
            tl.store(side_dk + (slot[:, None] * HV + i_h) * K + o_k[None, :], b_dk.to(side_dk.dtype.element_ty),
                     mask=m_side[:, None])
    b_db += b_dbv
    # dg = reverse cumsum of dgc inside the chunk
    b_dgc = tl.where(m_t, b_dgc, 0.0)
    b_dg = tl.sum(b_dgc) - tl.cumsum(b_dgc, 0) + b_dgc
    tl.store(dbeta + kept * HV + i_h, b_db, mask=m_keep)
    tl.store(dg + kept * HV + i_h, b_dg, mask=m_keep)
    if GATHER:
        tl.store(side_dbeta + slot * HV + i_h, b_db, mask=m_side)
        tl.store(side_dg + slot * HV + i_h, b_dg, mask=m_side)


@triton.jit
def _wy_bwd_kernel(k, v, beta, gc, T, dw, du, dk, dgc, dk_out, dv, dbeta, dg, side_dk, side_dv, side_dbeta, side_dg,
                   scratch, dk_inv, dk_out_inv, chunk_row_start, chunk_row_end, row_src, row_own, chunk_shift,
                   HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, GATHER: tl.constexpr, SCALED: tl.constexpr,
                   SCALED_OUT: tl.constexpr):
    """Chunks without replayed rows run the plain-row code at row + their shift, the others
    through the row maps (GATHER) or on plain rows."""
    shift, affine = _chunk_shift(chunk_shift, tl.program_id(0) // HV, GATHER)
    if affine:
        _wy_bwd_chunk(k, v, beta, gc, T, dw, du, dk, dgc, dk_out, dv, dbeta, dg, side_dk, side_dv, side_dbeta,
            side_dg, scratch, dk_inv, dk_out_inv, chunk_row_start, chunk_row_end, row_src, row_own, shift, HK, HV, K,
            V, BT, BK, BV, False, SCALED, SCALED_OUT)
    else:
        _wy_bwd_chunk(k, v, beta, gc, T, dw, du, dk, dgc, dk_out, dv, dbeta, dg, side_dk, side_dv, side_dbeta,
            side_dg, scratch, dk_inv, dk_out_inv, chunk_row_start, chunk_row_end, row_src, row_own, 0, HK, HV, K, V,
            BT, BK, BV, GATHER, SCALED, SCALED_OUT)


def chunk_bwd(q, k, v, beta, gc, T, v_new, h, dh, do, dvn, scale, index, rows=None, dk_fp32: bool = False,
              scaled: bool | None = None):
    """Returns dq, dk [R, HV, K], dv [R, HV, V], dbeta, dg [R, HV] fp32 (per value head) on the R packed rows.
    Launch configuration from `index.config`.

    With `rows` (index.PackedRows: q, k, v, beta, do compact) the five gradients are on the T compact tokens,
    from the rows that keep them, and a sixth value holds the replayed rows' dk, dv, dbeta, dg
    [rows.num_replays, ...] by replay slot, for the caller to add to the tokens they replay (their dq is 0).

    dv comes out in the input dtype; dk too when every value head has its own key head and nothing but the
    final rounding follows (not `dk_fp32`), else in fp32 for the grouped-head sum or the l2 norm's backward
    (rounding it before that backward raised dk's error against fp32 by about 8%); dq is fp32. With `scaled` (the
    default for 16-bit inputs) the fp32 ones travel as block-scaled fp16 (`scaled16.ScaledRows`: dq and dk's
    first share, on its way from the dq / dk / dw kernel to the WY backward, one scale a row; the final dk one a
    row and 64 columns): half the bytes of fp32 at an eighth of a bf16 rounding. The replayed rows' dk stays fp32.
    """
    _, hk, kd = q.shape
    hv, vd = v.shape[1], v.shape[2]
    n_rows, dev = gc.shape[0], q.device
    cfg = index.config
    bv, bk = min(cfg.bwd_block_v, vd), min(64, kd)
    BT = index.chunk_size
    grouped = hv != hk  # value heads share key heads: dk is summed over them after these kernels
    dk_dtype = torch.float32 if grouped or dk_fp32 else k.dtype
    scaled = k.element_size() == 2 if scaled is None else scaled
    scaled_out = scaled and dk_dtype == torch.float32

    def dk_dv_dbeta_dg(n, scaled_dk=False):
        dk = ScaledRows.empty(n, hv, kd, dev, block=bk) if scaled_dk else torch.empty(n, hv, kd, device=dev,
                                                                                      dtype=dk_dtype)
        return (dk, torch.empty(n, hv, vd, device=dev, dtype=v.dtype),
                *[torch.empty(n, hv, device=dev, dtype=torch.float32) for _ in range(2)])
    n_out = n_rows if rows is None else rows.num_tokens
    out = dk_dv_dbeta_dg(n_out, scaled_out)
    side = None if rows is None else dk_dv_dbeta_dg(rows.num_replays)
    def finer_rows(n):  # dq and dk's first share: block-scaled fp16 (one block a row) or fp32
        return ScaledRows.empty(n, hv, kd, dev) if scaled else torch.empty(n, hv, kd, device=dev, dtype=torch.float32)
    dq, dk_part = finer_rows(n_out), finer_rows(n_rows)
    (dq_ptr, dq_inv), (dk_ptr, dk_inv), (dk_out, dk_out_inv) = (kernel_pointers(x) for x in (dq, dk_part, out[0]))
    side_ptrs = (dk_out, *out[1:]) if side is None else side  # without rows the side buffers are never written
    # dw and the WY backward's scratch tiles in the inputs' dtype: their only reader rounds them to it before its
    # dots, so the bits are those of fp32 buffers at half the traffic
    dw = torch.empty(n_rows, hv, kd, device=dev, dtype=k.dtype)
    dgc = out[3] if rows is None else torch.empty(n_rows, hv, device=dev, dtype=torch.float32)
    if index.num_chunks:
        shifts = chunk_shift_table(index, rows)
        tables = (index.chunk_row_start, index.chunk_row_end, *row_tables(index, rows), shifts)
        _chunk_bwd_qk_kernel[(index.num_chunks * hv,)](
            q, k, v_new, gc, h, dh, do, dvn, dq_ptr, dk_ptr, dw, dgc, dq_inv, dk_inv, *tables, scale,
            HK=hk, HV=hv, K=kd, V=vd, BT=BT, BV=bv, GATHER=rows is not None, SCALED=scaled,
            num_warps=cfg.bwd_qk_warps)
        scratch = torch.empty(index.num_chunks * hv, BT, BT, device=dev, dtype=k.dtype)
        _wy_bwd_kernel[(index.num_chunks * hv,)](
            k, v, beta, gc, T, dw, dvn, dk_ptr, dgc, dk_out, *out[1:], *side_ptrs, scratch, dk_inv, dk_out_inv,
            *tables, HK=hk, HV=hv, K=kd, V=vd, BT=BT, BK=bk, BV=bv, GATHER=rows is not None, SCALED=scaled,
            SCALED_OUT=scaled_out, num_warps=cfg.wy_bwd_warps)
    grads = (dq, *out)  # dq, dk, dv, dbeta, dg
    return grads if rows is None else (*grads, side)
