"""Backward, sequential part: the reverse state recurrence with injected export gradients.

With h_c the state entering chunk c and dS the gradient of the state leaving it:
  dS   += d(exported) if the state leaving chunk c was exported       (injection)
  dh_c  = dS  (stored for the chunk-parallel kernels)
  dvn   = dv_local + kg dS                                             (grad of v_new)
  dS    = diag(exp(gl)) dS + qg^T do - w^T dvn                         (grad of the state entering c)
and after the first chunk dS is the gradient of the initial state. The prologue computes, chunk-parallel,
dv_local = scale Aqk^T do and qg = scale exp(gc) q on packed rows, so the scan reads only packed rows
except do (through the row maps on a tree sequence's first chunk, at row + shift after it, as GDN's scan).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_gdn.gates import LOG2E, _chunk_shift, _kept_rows, _scan_program, scan_grid
from ..chunk_gdn.index import chunk_shift_table, row_tables, scan_row_shift
from ..interpreter_safe import interpreting
from .programs import _chunk_program


@triton.jit
def _bwd_prep_chunk(q, gc, Aqk, do, qg, dv_local, chunk_row_start, chunk_row_end, row_src, row_own, shift, scale,
                    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                    GATHER: tl.constexpr):
    # replayed rows have no output gradient (do_rows: the kept tokens)
    i_c, i_h, i_hk, row0, row_end, rows64, m_t, src, do_rows, m_do = _chunk_program(
        tl.program_id(0), chunk_row_start, chunk_row_end, row_src, row_own, shift, HK, HV, BT, GATHER)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)
    b_q = tl.load(q + src[:, None] * (HK * K) + i_hk * K + o_k[None, :], mask=m_t[:, None], other=0.0)
    p_k = (rows64[:, None] * HV + i_h) * K + o_k[None, :]
    b_gc = tl.load(gc + p_k, mask=m_t[:, None], other=0.0)
    tl.store(qg + p_k, (b_q.to(tl.float32) * tl.exp2(b_gc * LOG2E) * scale).to(qg.dtype.element_ty), mask=m_t[:, None])
    # Aqk^T [BT(j), BT(i)], loaded transposed
    b_at = tl.load(Aqk + (rows64[None, :] * HV + i_h) * BT + o_t[:, None], mask=m_t[None, :], other=0.0)
    b_do = tl.load(do + (do_rows[:, None] * HV + i_h) * V + o_v[None, :], mask=m_do[:, None], other=0.0)
    b_dv = tl.dot(b_at.to(b_do.dtype), b_do) * scale
    tl.store(dv_local + (rows64[:, None] * HV + i_h) * V + o_v[None, :], b_dv, mask=m_t[:, None])


@triton.jit
def _bwd_prep_kernel(q, gc, Aqk, do, qg, dv_local, chunk_row_start, chunk_row_end, row_src, row_own, chunk_shift,
                     scale, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                     GATHER: tl.constexpr):
    shift, affine = _chunk_shift(chunk_shift, tl.program_id(0) // HV, GATHER)
    if affine:
        _bwd_prep_chunk(q, gc, Aqk, do, qg, dv_local, chunk_row_start, chunk_row_end, row_src, row_own, shift, scale,
                        HK, HV, K, V, BT, False)
    else:
        _bwd_prep_chunk(q, gc, Aqk, do, qg, dv_local, chunk_row_start, chunk_row_end, row_src, row_own, 0, scale,
                        HK, HV, K, V, BT, GATHER)


@triton.jit
def _scan_bwd_step(qg, kg, w, gc, do, dv_local, dvn, dh, row_own, b_ds, i_c, c0, bos, eos, i_h, state_offs, shift,
                   HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, o_v, GATHER: tl.constexpr):
    """One chunk of the reverse scan; do is read at the row maps (GATHER) or at packed row + `shift`."""
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    ic = (c0 + i_c).to(tl.int64)
    rows = bos + i_c * BT + o_t
    m_t = rows < eos
    rows64 = rows.to(tl.int64)
    last = (tl.minimum(bos + i_c * BT + BT, eos) - 1).to(tl.int64)
    tl.store(dh + (ic * HV + i_h) * (K * V) + state_offs, b_ds.to(dh.dtype.element_ty))
    do_rows, m_do = _kept_rows(row_own, rows, m_t, shift, GATHER)
    b_gl = tl.load(gc + (last * HV + i_h) * K + o_k)
    # qg^T do first: it does not depend on dS, so its dot can run beside the chain's kg dS
    b_qgt = tl.load(qg + (rows64[None, :] * HV + i_h) * K + o_k[:, None], mask=m_t[None, :], other=0.0)
    b_do = tl.load(do + (do_rows[:, None].to(tl.int64) * HV + i_h) * V + o_v[None, :], mask=m_do[:, None],
                   other=0.0)
    b_acc = tl.dot(b_qgt, b_do.to(b_qgt.dtype), acc=b_ds * tl.exp2(b_gl * LOG2E)[:, None])
    b_kg = tl.load(kg + (rows64[:, None] * HV + i_h) * K + o_k[None, :], mask=m_t[:, None], other=0.0)
    p_v = (rows64[:, None] * HV + i_h) * V + o_v[None, :]
    b_dvn = tl.load(dv_local + p_v, mask=m_t[:, None], other=0.0) + tl.dot(b_kg, b_ds.to(b_kg.dtype))
    tl.store(dvn + p_v, b_dvn.to(dvn.dtype.element_ty), mask=m_t[:, None])
    # - w^T dvn accumulated onto the same registers (negation is exact)
    b_wt = tl.load(w + (rows64[None, :] * HV + i_h) * K + o_k[:, None], mask=m_t[None, :], other=0.0)
    return tl.dot(b_wt, (-b_dvn).to(b_wt.dtype), acc=b_acc)


@triton.jit
def _scan_bwd_kernel(qg, kg, w, gc, do, dv_local, dvn, dh, dh0, bank_grad, cu_seqlens, seq_chunk_start, seq_order,
                     seq_export_start, export_end_chunk, export_end_slot, row_own, seq_shift, HV: tl.constexpr,
                     K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, INTERPRET: tl.constexpr,
                     GATHER: tl.constexpr):
    i_n, i_h, i_hk, bos, eos, c0, n_chunks, _, o_v, state_offs = _scan_program(
        cu_seqlens, seq_chunk_start, seq_order, 1, HV, K, V, BT, BV)
    # export segments in reverse (GDN's scan): a segment's exported end state takes its gradient before the
    # segment's last chunk; the inner loops carry no bank logic
    e0 = tl.load(seq_export_start + i_n)
    e1 = tl.load(seq_export_start + i_n + 1)
    b_ds = tl.zeros([K, BV], dtype=tl.float32)
    shift = e0 * 0
    c_first = e0 * 0
    if GATHER:  # chunk 0 (which holds the replayed rows) through the row maps, last, below; the rest at row + shift
        shift = tl.load(seq_shift + i_n)
        c_first += 1
    i_e = e1 - 1
    while i_e >= e0:
        c_end = tl.minimum(tl.load(export_end_chunk + i_e), n_chunks)
        c_start = tl.maximum(tl.where(i_e > e0, tl.load(export_end_chunk + tl.maximum(i_e - 1, 0)), 0), c_first)
        slot = tl.load(export_end_slot + i_e)  # masked, not a branch
        b_ds += tl.load(bank_grad + (tl.maximum(slot, 0) * HV + i_h).to(tl.int64) * (K * V) + state_offs,
                        mask=(state_offs * 0 + slot) >= 0, other=0.0)
        if INTERPRET:
            i_c = c_end - 1
            while i_c >= c_start:
                b_ds = _scan_bwd_step(qg, kg, w, gc, do, dv_local, dvn, dh, row_own, b_ds, i_c, c0, bos, eos, i_h,
                                      state_offs, shift, HV, K, V, BT, o_v, False)
                i_c -= 1
        else:
            for i_r in range(0, c_end - c_start):
                b_ds = _scan_bwd_step(qg, kg, w, gc, do, dv_local, dvn, dh, row_own, b_ds, c_end - 1 - i_r, c0, bos,
                                      eos, i_h, state_offs, shift, HV, K, V, BT, o_v, False)
        i_e -= 1
    if GATHER:
        if n_chunks > 0:
            b_ds = _scan_bwd_step(qg, kg, w, gc, do, dv_local, dvn, dh, row_own, b_ds, 0, c0, bos, eos, i_h,
                                  state_offs, e0 * 0, HV, K, V, BT, o_v, True)
    tl.store(dh0 + (i_n * HV + i_h).to(tl.int64) * (K * V) + state_offs, b_ds)


def bwd_prep(q, gc, Aqk, do, scale, index, config, rows=None):
    """qg = scale exp(gc) q [R, HV, K] (q's dtype) and dv_local = scale Aqk^T do [R, HV, V] fp32, every chunk."""
    _, hk, kd = q.shape
    hv, vd = do.shape[1], do.shape[2]
    n_rows = gc.shape[0]
    qg = torch.empty(n_rows, hv, kd, device=q.device, dtype=q.dtype)
    dv_local = torch.empty(n_rows, hv, vd, device=q.device, dtype=torch.float32)
    if index.num_chunks:
        _bwd_prep_kernel[(index.num_chunks * hv,)](
            q, gc, Aqk, do, qg, dv_local, index.chunk_row_start, index.chunk_row_end, *row_tables(index, rows),
            chunk_shift_table(index, rows), scale, HK=hk, HV=hv, K=kd, V=vd, BT=index.chunk_size,
            GATHER=rows is not None, num_warps=config.bwd_prep_warps)
    return qg, dv_local


def scan_bwd(qg, kg, w, gc, do, dv_local, bank_grad, index, dh, dvn, *, seqs: tuple[int, int], rows, launch_seqs,
             order):
    """The reverse scan of sequences `seqs` = (first, count) into the shared dh [NC, HV, K, V] and dvn [R, HV, V];
    returns their initial-state gradients [count, HV, K, V] fp32."""
    hv, kd, vd = kg.shape[1], kg.shape[2], dvn.shape[2]
    first, count = seqs
    bv, warps, stages = index.config.scan_launch_for(launch_seqs, hv, vd, kg.element_size())
    dh0 = torch.empty(count, hv, kd, vd, device=kg.device, dtype=torch.float32)
    if count:
        _scan_bwd_kernel[scan_grid(count, hv, vd, bv)](
            qg, kg, w, gc, do, dv_local, dvn, dh, dh0, bank_grad, index.cu_seqlens[first:],
            index.seq_chunk_start[first:], order, index.seq_export_start[first:], index.export_end_chunk,
            index.export_end_slot, row_tables(index, rows)[1], scan_row_shift(index, rows, first), HV=hv, K=kd,
            V=vd, BT=index.chunk_size, BV=bv, INTERPRET=interpreting(), GATHER=rows is not None, num_warps=warps,
            num_stages=stages)
    return dh0
