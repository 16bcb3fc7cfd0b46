"""Forward, sequential part (state scan over chunks) and the chunk-parallel output.

Scan, per sequence / value head / BV columns of the state (S fp32 in registers, [K, BV]):
  h_c = S (stored in the input dtype for the output and the backward)
  vn  = u - w S                                     (v_new: what the state did not predict)
  S   = diag(exp(gl)) S + kg^T vn                    (gl: gc of the chunk's last row, [K])
  export S in fp32 when the state leaving this chunk is requested.
Every operand of the scan (w, u, kg, gc) lives on packed rows, written by intra_fwd: the scan needs no row
maps. The export segments and the bank follow GDN's scan (chunk_gdn/state_fwd.py): each sequence's chunks are
cut at its exported boundaries and the state leaving a segment is stored between the inner loops.
Output, per chunk: o = scale ( (exp(gc) q) h_c + Aqk vn ).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_gdn.gates import LOG2E, _chunk_shift, _scan_program, scan_grid
from ..chunk_gdn.index import chunk_shift_table, row_tables
from ..interpreter_safe import interpreting
from .programs import _chunk_program


@triton.jit
def _scan_fwd_step(kg, w, u, gc, h, v_new, b_s, i_c, c0, bos, eos, i_h, state_offs, HV: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, o_v):
    """One chunk of the scan; returns the state leaving it."""
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    ic = (c0 + i_c).to(tl.int64)
    rows = (bos + i_c * BT + o_t).to(tl.int64)
    m_t = rows < eos
    last = (tl.minimum(bos + i_c * BT + BT, eos) - 1).to(tl.int64)
    tl.store(h + (ic * HV + i_h) * (K * V) + state_offs, b_s.to(h.dtype.element_ty))
    b_w = tl.load(w + (rows[:, None] * HV + i_h) * K + o_k[None, :], mask=m_t[:, None], other=0.0)
    b_u = tl.load(u + (rows[:, None] * HV + i_h) * V + o_v[None, :], mask=m_t[:, None], other=0.0)
    b_vn = b_u.to(tl.float32) - tl.dot(b_w, b_s.to(b_w.dtype))
    tl.store(v_new + (rows[:, None] * HV + i_h) * V + o_v[None, :], b_vn.to(v_new.dtype.element_ty),
             mask=m_t[:, None])
    b_kgt = tl.load(kg + (rows[None, :] * HV + i_h) * K + o_k[:, None], mask=m_t[None, :], other=0.0)
    b_gl = tl.load(gc + (last * HV + i_h) * K + o_k)
    return b_s * tl.exp2(b_gl * LOG2E)[:, None] + tl.dot(b_kgt, b_vn.to(b_kgt.dtype))


@triton.jit
def _scan_fwd_kernel(kg, w, u, gc, h0, h0_row, h, v_new, bank, cu_seqlens, seq_chunk_start, seq_order, seq_export_start,
                     export_end_chunk, export_end_slot, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                     V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, INTERPRET: tl.constexpr):
    i_n, i_h, i_hk, bos, eos, c0, n_chunks, _, o_v, state_offs = _scan_program(
        cu_seqlens, seq_chunk_start, seq_order, HK, HV, K, V, BT, BV)
    e0 = tl.load(seq_export_start + i_n)
    e1 = tl.load(seq_export_start + i_n + 1)
    i_h0 = tl.load(h0_row + i_n)  # the initial state is a row of the bank (tree.py), read in place
    b_s = tl.load(h0 + (i_h0 * HV + i_h).to(tl.int64) * (K * V) + state_offs)
    c_start = e0 * 0
    i_e = e0
    while i_e < e1:  # export segments (GDN's scan): no bank logic inside the inner loops
        c_end = tl.minimum(tl.load(export_end_chunk + i_e), n_chunks)
        if INTERPRET:  # the interpreter takes no loaded bounds in range() (interpreter_safe.py)
            i_c = c_start
            while i_c < c_end:
                b_s = _scan_fwd_step(kg, w, u, gc, h, v_new, b_s, i_c, c0, bos, eos, i_h, state_offs, HV, K, V, BT,
                                     o_v)
                i_c += 1
        else:  # a for loop, which Triton software-pipelines
            for i_c in range(c_start, c_end):
                b_s = _scan_fwd_step(kg, w, u, gc, h, v_new, b_s, i_c, c0, bos, eos, i_h, state_offs, HV, K, V, BT,
                                     o_v)
        slot = tl.load(export_end_slot + i_e)
        # masked, not a branch (the mask is a tile: the interpreter takes no scalar masks)
        tl.store(bank + (tl.maximum(slot, 0) * HV + i_h).to(tl.int64) * (K * V) + state_offs, b_s,
                 mask=(state_offs * 0 + slot) >= 0)
        c_start = c_end
        i_e += 1


@triton.jit
def _output_chunk(q, gc, Aqk, v_new, h, o, chunk_row_start, chunk_row_end, row_src, row_own, i_ch, i_v, shift,
                  scale, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                  BV: tl.constexpr, GATHER: tl.constexpr):
    # replayed rows' outputs are dropped (out_rows: the kept tokens)
    i_c, i_h, i_hk, row0, row_end, rows64, m_t, src, out_rows, m_out = _chunk_program(
        i_ch, chunk_row_start, chunk_row_end, row_src, row_own, shift, HK, HV, BT, GATHER)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    b_q = tl.load(q + src[:, None] * (HK * K) + i_hk * K + o_k[None, :], mask=m_t[:, None], other=0.0)
    b_gc = tl.load(gc + (rows64[:, None] * HV + i_h) * K + o_k[None, :], mask=m_t[:, None], other=0.0)
    b_qg = (b_q.to(tl.float32) * tl.exp2(b_gc * LOG2E)).to(b_q.dtype)
    b_h = tl.load(h + (i_c.to(tl.int64) * HV + i_h) * (K * V) + o_k[:, None] * V + o_v[None, :])
    b_a = tl.load(Aqk + (rows64[:, None] * HV + i_h) * BT + o_t[None, :], mask=m_t[:, None], other=0.0)
    b_vn = tl.load(v_new + (rows64[:, None] * HV + i_h) * V + o_v[None, :], mask=m_t[:, None], other=0.0)
    b_o = (tl.dot(b_qg, b_h) + tl.dot(b_a.to(b_vn.dtype), b_vn)) * scale
    tl.store(o + (out_rows[:, None] * HV + i_h) * V + o_v[None, :], b_o.to(o.dtype.element_ty),
             mask=m_out[:, None])


@triton.jit
def _output_kernel(q, gc, Aqk, v_new, h, o, chunk_row_start, chunk_row_end, row_src, row_own, chunk_shift, scale,
                   HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                   BV: tl.constexpr, GATHER: tl.constexpr):
    # a chunk and head's column blocks adjacent: they read the same q, gc and Aqk rows, the second from L2
    i_ch, i_v = tl.program_id(0) // (V // BV), tl.program_id(0) % (V // BV)
    shift, affine = _chunk_shift(chunk_shift, i_ch // HV, GATHER)
    if affine:
        _output_chunk(q, gc, Aqk, v_new, h, o, chunk_row_start, chunk_row_end, row_src, row_own, i_ch, i_v, shift,
                      scale, HK, HV, K, V, BT, BV, False)
    else:
        _output_chunk(q, gc, Aqk, v_new, h, o, chunk_row_start, chunk_row_end, row_src, row_own, i_ch, i_v, 0, scale,
                      HK, HV, K, V, BT, BV, GATHER)


def scan_fwd(kg, w, u, gc, bank, index, *, seqs: tuple[int, int], out, launch_seqs: int, initial_rows, order):
    """The scan of sequences `seqs` = (first, count) of `index`, starting from bank rows `initial_rows`, into
    `out` = (h [NC, HV, K, V], v_new [R, HV, V], export slots [num_slots, HV, K, V] fp32) shared by every round
    (tree.py). The launch follows the plan's GDNKernelConfig.scan_launch_for over `launch_seqs` sequences."""
    first, count = seqs
    hk_placeholder = 1  # the scan reads no per-key-head tensor
    hv, kd, vd = u.shape[1], kg.shape[2], u.shape[2]
    bv, warps, stages = index.config.scan_launch_for(launch_seqs, hv, vd, kg.element_size())
    h, v_new, slots = out
    if count:
        _scan_fwd_kernel[scan_grid(count, hv, vd, bv)](
            kg, w, u, gc, bank, initial_rows, h, v_new, slots, index.cu_seqlens[first:],
            index.seq_chunk_start[first:], order, index.seq_export_start[first:], index.export_end_chunk,
            index.export_end_slot, HK=hk_placeholder, HV=hv, K=kd, V=vd, BT=index.chunk_size, BV=bv,
            INTERPRET=interpreting(), num_warps=warps, num_stages=stages)


def output_fwd(q, gc, Aqk, v_new, h, scale, index, config, rows=None):
    """o [R, HV, V] on the packed rows, or with `rows` (index.PackedRows) o [T, HV, V] on the compact tokens
    (q read through `rows.src`, each kept row's output stored at `rows.own`, replayed rows' dropped)."""
    _, hk, kd = q.shape
    hv, vd = v_new.shape[1], v_new.shape[2]
    bv = min(config.out_block_v, vd)
    o = torch.empty_like(v_new) if rows is None else v_new.new_empty(rows.num_tokens, hv, vd)
    if index.num_chunks:
        _output_kernel[(index.num_chunks * hv * (vd // bv),)](
            q, gc, Aqk, v_new, h, o, index.chunk_row_start, index.chunk_row_end, *row_tables(index, rows),
            chunk_shift_table(index, rows), scale, HK=hk, HV=hv, K=kd, V=vd, BT=index.chunk_size, BV=bv,
            GATHER=rows is not None, num_warps=config.out_warps)
    return o
