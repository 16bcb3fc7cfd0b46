"""Forward, sequential part (state scan over chunks) and the chunk-parallel output.

Scan, per sequence / value head / BV columns of the state (S fp32 in registers, [K, BV]):
  h_c   = S (stored in the input dtype for the output and the backward)
  vn    = u - w S                                   (v_new: what the state did not predict)
  S     = exp(gc_last) S + k^T (exp(gc_last - gc) vn)
  export S in fp32 when the state leaving this chunk is requested.
Output, per chunk: o = scale * ( exp(gc) (q h_c) + tril(q k^T exp(gc_i - gc_j)) vn ).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..interpreter_safe import interpreting
from .gates import (LOG2E, _chunk_rows, _chunk_shift, _exp_gate_gap, _input_rows, _kept_rows, _scan_program, scan_grid,
                    scan_order)
from .index import chunk_shift_table, row_tables, scan_row_shift
from .tma import scan_descriptors


@triton.jit
def _state_fwd_step(k, w, u, gc, h, v_new, row_src, b_s, i_c, c0, bos, eos, i_h, i_hk, state_offs, shift,
                    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, o_v,
                    GATHER: tl.constexpr):
    """One chunk of the scan; returns the state leaving the chunk. k is read at the row maps (GATHER) or at
    packed row + `shift` (0 outside tree mode)."""
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    ic = (c0 + i_c).to(tl.int64)
    rows = bos + i_c * BT + o_t
    m_t = rows < eos
    last = tl.minimum(bos + i_c * BT + BT, eos) - 1
    tl.store(h + (ic * HV + i_h) * (K * V) + state_offs, b_s.to(h.dtype.element_ty))

    b_w = tl.load(w + (rows[:, None] * HV + i_h) * K + o_k[None, :], mask=m_t[:, None], other=0.0)
    b_u = tl.load(u + (rows[:, None] * HV + i_h) * V + o_v[None, :], mask=m_t[:, None], other=0.0)
    b_vn = b_u.to(tl.float32) - tl.dot(b_w, b_s.to(b_w.dtype))
    tl.store(v_new + (rows[:, None] * HV + i_h) * V + o_v[None, :], b_vn.to(v_new.dtype.element_ty),
             mask=m_t[:, None])

    b_gc = tl.load(gc + rows * HV + i_h, mask=m_t, other=0.0)
    b_gl = tl.load(gc + last * HV + i_h)
    src = _input_rows(row_src, rows, m_t, shift, GATHER)
    b_kt = tl.load(k + src[None, :] * (HK * K) + i_hk * K + o_k[:, None], mask=m_t[None, :], other=0.0)
    b_vd = tl.where(m_t[:, None], b_vn * tl.exp2((b_gl - b_gc) * LOG2E)[:, None], 0.0)
    return b_s * tl.exp2(b_gl * LOG2E) + tl.dot(b_kt, b_vd.to(b_kt.dtype))


@triton.jit
def _state_fwd_step_tma(k_desc, w_desc, u_desc, h, v_new, gc, b_s, i_c, c0, bos, i_h, i_hk, i_v, state_offs, shift,
                        HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, o_v):
    """_state_fwd_step on a full chunk (every row inside the sequence, read at packed row + `shift`), its loads
    through tensor descriptors (tma.py) and its stores unmasked: the same arithmetic in the same order, so the
    same bits (GPU-checked), without per-element load addresses or masks. (h and v_new stored through
    descriptors too were slower: the staging buffers add a barrier and a wait per chunk.)"""
    ic = (c0 + i_c).to(tl.int64)
    row0 = (bos + i_c * BT).to(tl.int32)
    col_v = i_h * V + i_v * BV
    tl.store(h + (ic * HV + i_h) * (K * V) + state_offs, b_s.to(h.dtype.element_ty))
    b_w = w_desc.load([row0, i_h * K])                                  # [BT, K]
    b_u = u_desc.load([row0, col_v])                                    # [BT, BV]
    b_vn = b_u.to(tl.float32) - tl.dot(b_w, b_s.to(b_w.dtype))
    rows = row0 + tl.arange(0, BT)
    tl.store(v_new + (rows[:, None] * HV + i_h).to(tl.int64) * V + o_v[None, :], b_vn.to(v_new.dtype.element_ty))
    b_gc = tl.load(gc + rows * HV + i_h)
    b_gl = tl.load(gc + (row0 + BT - 1) * HV + i_h)
    b_k = k_desc.load([(row0 + shift).to(tl.int32), i_hk * K])         # [BT, K]
    b_vd = b_vn * tl.exp2((b_gl - b_gc) * LOG2E)[:, None]
    return b_s * tl.exp2(b_gl * LOG2E) + tl.dot(tl.trans(b_k), b_vd.to(b_k.dtype))


@triton.jit
def _state_fwd_chunk(k, w, u, gc, h, v_new, descs, row_src, b_s, i_c, c0, bos, eos, i_h, i_hk, i_v, state_offs,
                     shift, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                     BV: tl.constexpr, o_v, GATHER: tl.constexpr, TMA: tl.constexpr):
    """A chunk of the main loop: loads through the descriptors `descs` = (k, w, u) with TMA (the loop then holds
    full chunks only), else through pointers."""
    if TMA:
        return _state_fwd_step_tma(descs[0], descs[1], descs[2], h, v_new, gc, b_s, i_c, c0, bos, i_h, i_hk, i_v,
                                   state_offs, shift, HV, K, V, BT, BV, o_v)
    else:
        return _state_fwd_step(k, w, u, gc, h, v_new, row_src, b_s, i_c, c0, bos, eos, i_h, i_hk, state_offs,
                               shift, HK, HV, K, V, BT, o_v, GATHER)


@triton.jit
def _state_fwd_kernel(k, w, u, gc, h0, h0_row, h, v_new, bank, k_desc, w_desc, u_desc, cu_seqlens,
                      seq_chunk_start, seq_order, seq_export_start, export_end_chunk, export_end_slot, row_src,
                      seq_shift,
                      HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      BV: tl.constexpr, INTERPRET: tl.constexpr, GATHER: tl.constexpr, TMA: tl.constexpr):
    i_n, i_h, i_hk, bos, eos, c0, n_chunks, i_v, o_v, state_offs = _scan_program(
        cu_seqlens, seq_chunk_start, seq_order, HK, HV, K, V, BT, BV)
    descs = (k_desc, w_desc, u_desc)
    # the chunks in export segments (index.GDNIndex): the inner loop has no per-chunk bank logic, so Triton
    # can prefetch its loads `num_stages - 1` chunks ahead
    e0 = tl.load(seq_export_start + i_n)
    e1 = tl.load(seq_export_start + i_n + 1)
    i_h0 = tl.load(h0_row + i_n)  # the initial state is a row of the bank (tree.py), read in place
    b_s = tl.load(h0 + (i_h0 * HV + i_h).to(tl.int64) * (K * V) + state_offs)     # fp32
    shift = e0 * 0
    c_first = e0 * 0
    if GATHER:  # chunk 0 (which holds the replayed rows) through the row maps, the rest at row + shift
        shift = tl.load(seq_shift + i_n)
        c_first += 1
        if n_chunks > 0:
            b_s = _state_fwd_step(k, w, u, gc, h, v_new, row_src, b_s, 0, c0, bos, eos, i_h, i_hk, state_offs,
                                  e0 * 0, HK, HV, K, V, BT, o_v, True)
    # with TMA the loops take the full chunks and a partial last chunk runs masked after them
    n_loop = (eos - bos) // BT if TMA else n_chunks
    c_start = e0 * 0
    i_e = e0
    while i_e < e1:  # a while loop: the interpreter takes no loaded bound in range() (numpy >= 2.4)
        c_end = tl.load(export_end_chunk + i_e)
        c_lo = tl.maximum(c_start, c_first)
        if INTERPRET:
            i_c = c_lo
            while i_c < tl.minimum(c_end, n_loop):
                b_s = _state_fwd_chunk(k, w, u, gc, h, v_new, descs, row_src, b_s, i_c, c0, bos, eos, i_h, i_hk, i_v,
                                       state_offs, shift, HK, HV, K, V, BT, BV, o_v, False, TMA)
                i_c += 1
        else:  # a for loop, which Triton software-pipelines
            for i_c in range(c_lo, tl.minimum(c_end, n_loop)):
                b_s = _state_fwd_chunk(k, w, u, gc, h, v_new, descs, row_src, b_s, i_c, c0, bos, eos, i_h, i_hk, i_v,
                                       state_offs, shift, HK, HV, K, V, BT, BV, o_v, False, TMA)
        if TMA:
            if (n_loop >= c_lo) & (n_loop < c_end):
                b_s = _state_fwd_step(k, w, u, gc, h, v_new, row_src, b_s, n_loop, c0, bos, eos, i_h, i_hk,
                                      state_offs, shift, HK, HV, K, V, BT, o_v, False)
        slot = tl.load(export_end_slot + i_e)
        # masked, not a branch (the mask is a tile: the interpreter takes no scalar masks)
        tl.store(bank + (tl.maximum(slot, 0) * HV + i_h) * (K * V) + state_offs, b_s,
                 mask=(state_offs * 0 + slot) >= 0)
        c_start = c_end
        i_e += 1


@triton.jit
def _output_chunk(q, q_rstd, k, k_rstd, v_new, gc, h, o, chunk_row_start, chunk_row_end, row_src, row_own, i_c, i_h,
                  i_v, shift, scale, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BV: tl.constexpr, GATHER: tl.constexpr, RSTD: tl.constexpr):
    """o of one chunk and BV columns. RSTD: q and k are the raw query and key and q_rstd, k_rstd [rows, HK] their
    l2 norms' reciprocals, applied to the dots' fp32 results, so the normalised rows are never rounded to 16 bits
    here (the output is where those roundings cost o most: bench/gdn_rounding.py)."""
    i_hk = i_h // (HV // HK)
    row0, row_end, rows, m_t = _chunk_rows(chunk_row_start, chunk_row_end, i_c, BT)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    src = _input_rows(row_src, rows, m_t, shift, GATHER)

    b_q = tl.load(q + src[:, None] * (HK * K) + i_hk * K + o_k[None, :], mask=m_t[:, None], other=0.0)
    b_kt = tl.load(k + src[None, :] * (HK * K) + i_hk * K + o_k[:, None], mask=m_t[None, :], other=0.0)
    b_h = tl.load(h + (i_c.to(tl.int64) * HV + i_h) * (K * V) + o_k[:, None] * V + o_v[None, :])
    b_gc = tl.load(gc + rows * HV + i_h, mask=m_t, other=0.0)

    b_row = tl.exp2(b_gc * LOG2E)
    b_a = tl.dot(b_q, b_kt)
    if RSTD:
        b_rq = tl.load(q_rstd + src * HK + i_hk, mask=m_t, other=0.0)
        b_rk = tl.load(k_rstd + src * HK + i_hk, mask=m_t, other=0.0)
        b_row = b_row * b_rq
        b_a = b_a * b_rq[:, None] * b_rk[None, :]
    b_o = tl.dot(b_q, b_h) * b_row[:, None]
    b_a = tl.where(o_t[:, None] >= o_t[None, :], b_a * _exp_gate_gap(b_gc[:, None] - b_gc[None, :]), 0.0)
    b_vn = tl.load(v_new + (rows[:, None] * HV + i_h) * V + o_v[None, :], mask=m_t[:, None], other=0.0)
    b_o = (b_o + tl.dot(b_a.to(b_vn.dtype), b_vn)) * scale
    out_rows, m_out = _kept_rows(row_own, rows, m_t, shift, GATHER)  # replayed rows' outputs are dropped
    tl.store(o + (out_rows[:, None] * HV + i_h) * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_out[:, None])


@triton.jit
def _output_kernel(q, q_rstd, k, k_rstd, v_new, gc, h, o, chunk_row_start, chunk_row_end, row_src, row_own,
                   chunk_shift, scale, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BV: tl.constexpr, GATHER: tl.constexpr, RSTD: tl.constexpr):
    """One program per (chunk, value head, BV columns), in that order with the columns fastest: the column blocks
    of a chunk and head read the same q, k and gc rows, which the second then finds in L2 (docs/gdn_kernels.md).
    Chunks without replayed rows run the plain-row code at row + their shift, the others through the row maps
    (GATHER) or on plain rows."""
    i_ch, i_v = tl.program_id(0) // (V // BV), tl.program_id(0) % (V // BV)
    i_c, i_h = i_ch // HV, i_ch % HV
    shift, affine = _chunk_shift(chunk_shift, i_c, GATHER)
    if affine:
        _output_chunk(q, q_rstd, k, k_rstd, v_new, gc, h, o, chunk_row_start, chunk_row_end, row_src, row_own, i_c,
            i_h, i_v, shift, scale, HK, HV, K, V, BT, BV, False, RSTD)
    else:
        _output_chunk(q, q_rstd, k, k_rstd, v_new, gc, h, o, chunk_row_start, chunk_row_end, row_src, row_own, i_c,
            i_h, i_v, 0, scale, HK, HV, K, V, BT, BV, GATHER, RSTD)


def state_fwd(k, w, u, gc, initial_state, index, *, seqs: tuple[int, int] | None = None, out=None, rows=None,
              launch_seqs: int | None = None, initial_rows: torch.Tensor | None = None, order=None):
    """Returns h [NC, HV, K, V] (k's dtype), v_new [R, HV, V] (u's dtype), bank [slots, HV, K, V] fp32.

    `initial_rows` ([count] int64): sequence i starts from `initial_state[initial_rows[i]]` (tree.py passes its
    export bank, so no copy of the states is made); default: from `initial_state[i]`.

    `seqs` = (first, count): scan only those sequences of `index`, whose initial states `initial_state`
    holds, into `out` = (h, v_new, bank) shared by the calls of a multi-round tree (tree.py); the
    programs read the sequence tables from `first` on, so each chunk runs exactly as in a whole call.
    `rows` (index.PackedRows): k is compact and read through `rows.src`. `launch_seqs`: the sequence count
    the launch configuration is chosen for (default: count; tree.py passes its round's, whose lanes run
    side by side). `order`: the launch's sequences longest first, relative to `first` (RoundLaunch.scan_order;
    default, for a scan of every sequence: index.seq_order).
    """
    _, hk, kd = k.shape
    hv, vd = u.shape[1], u.shape[2]
    first, count = seqs if seqs is not None else (0, index.num_seqs)
    cfg = index.config
    bv, warps, stages = cfg.scan_launch_for(launch_seqs or count, hv, vd, k.element_size())
    if out is None:
        out = (torch.empty(index.num_chunks, hv, kd, vd, device=k.device, dtype=k.dtype), torch.empty_like(u),
               torch.empty(index.num_slots, hv, kd, vd, device=k.device, dtype=torch.float32))
    h, v_new, bank = out
    if initial_rows is None:
        initial_rows = torch.arange(count, device=k.device)
    shifts = scan_row_shift(index, rows, first)
    tma, descs = scan_descriptors(cfg, bv, index.chunk_size, ((k, kd), (w, kd), (u, bv)))
    if count:
        _state_fwd_kernel[scan_grid(count, hv, vd, bv)](
            k, w, u, gc, initial_state, initial_rows, h, v_new, bank,
            *descs, index.cu_seqlens[first:], index.seq_chunk_start[first:], scan_order(index, seqs, order),
            index.seq_export_start[first:], index.export_end_chunk, index.export_end_slot, row_tables(index, rows)[0],
            shifts, HK=hk, HV=hv, K=kd, V=vd,
            BT=index.chunk_size, BV=bv, INTERPRET=interpreting(), GATHER=rows is not None,
            TMA=tma, num_warps=warps, num_stages=stages)
    return h, v_new, bank


def output_fwd(q, k, v_new, gc, h, scale, index, rows=None, rstd=None):
    """o [R, HV, V] on the packed rows, or with `rows` (index.PackedRows) o [T, HV, V] on the compact tokens:
    q and k read through `rows.src`, each kept row's output stored at `rows.own`, replayed rows' dropped.
    `rstd` = (q_rstd, k_rstd) ([rows of q, HK] fp32 each): q and k are the raw query and key, normalised by these
    factors inside the kernel (o's error against fp32 about a fifth lower than from the bf16 normalised rows)."""
    _, hk, kd = q.shape
    hv, vd = v_new.shape[1], v_new.shape[2]
    cfg = index.config
    bv = min(cfg.out_block_v, vd)
    o = torch.empty_like(v_new) if rows is None else v_new.new_empty(rows.num_tokens, hv, vd)
    shifts = chunk_shift_table(index, rows)
    if index.num_chunks:
        _output_kernel[(index.num_chunks * hv * (vd // bv),)](
            q, q if rstd is None else rstd[0], k, k if rstd is None else rstd[1], v_new, gc, h, o,
            index.chunk_row_start, index.chunk_row_end, *row_tables(index, rows), shifts, scale, HK=hk, HV=hv, K=kd,
            V=vd, BT=index.chunk_size, BV=bv, GATHER=rows is not None, RSTD=rstd is not None,
            num_warps=cfg.out_warps)
    return o
