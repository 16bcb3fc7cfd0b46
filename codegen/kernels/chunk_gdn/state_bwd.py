"""Backward, sequential part: the reverse state recurrence with injected export gradients.

With S_c the state entering chunk c (h_c), dS the gradient of the state leaving chunk c:
  dS   += d(exported) if the state leaving chunk c was exported       (injection)
  dh_c  = dS  (stored for the chunk-parallel dq/dk/dw kernel)
  dvn   = dv_local + exp(gc_last - gc) (k dS)                          (grad of v_new)
  dS    = exp(gc_last) dS + (scale exp(gc) q)^T do - w^T dvn            (grad of the state entering c)
and after the first chunk dS is the gradient of the initial state.
dv_local = A^T do, A = scale * tril(q k^T exp(gc_i - gc_j)), is chunk-local. A full-width scan launch over long
sequences forms A^T (LOCAL_DV) from the q and k tiles it loads for dS anyway, off the dS chain; other launches (narrow
ones are issue-bound, short sequences latency-bound: docs/gdn_kernels.md) read A^T, rounded to do's dtype as the dot
takes it, from a buffer that a chunk-parallel kernel fills beforehand over their chunks (tree.gated_at_buffer). Both
then run the same dot, so both give the same bits.
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
def _gated_at_chunk(q, k, gc, at, chunk_row_start, chunk_row_end, row_src, i_c, i_h, c_first, shift, scale,
                    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, GATHER: tl.constexpr):
    i_hk = i_h // (HV // HK)
    row0, row_end, rows, m_t = _chunk_rows(chunk_row_start, chunk_row_end, i_c, BT)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    src = _input_rows(row_src, rows, m_t, shift, GATHER)
    b_k = tl.load(k + src[:, None] * (HK * K) + i_hk * K + o_k[None, :], mask=m_t[:, None], other=0.0)
    b_qt = tl.load(q + src[None, :] * (HK * K) + i_hk * K + o_k[:, None], mask=m_t[None, :], other=0.0)
    b_gc = tl.load(gc + rows * HV + i_h, mask=m_t, other=0.0)
    b_at = _gated_at(b_k, b_qt, b_gc, scale, BT)
    tile = ((i_c - c_first) * HV + i_h).to(tl.int64) * (BT * BT)
    tl.store(at + tile + o_t[:, None] * BT + o_t[None, :], b_at.to(at.dtype.element_ty))


@triton.jit
def _gated_at_kernel(q, k, gc, at, chunk_row_start, chunk_row_end, row_src, chunk_shift, c_first, scale,
                     HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, GATHER: tl.constexpr):
    """One program per chunk (from c_first on) and value head: the chunk's A^T in at's dtype. Chunks without replayed
    rows run the plain-row code at row + their shift, the others through the row maps (GATHER) or on plain rows.
    (Replayed rows need no special case: their do rows are zero in the scans' dot.)"""
    i_c, i_h = c_first + tl.program_id(0) // HV, tl.program_id(0) % HV
    shift, affine = _chunk_shift(chunk_shift, i_c, GATHER)
    if affine:
        _gated_at_chunk(q, k, gc, at, chunk_row_start, chunk_row_end, row_src, i_c, i_h, c_first, shift, scale, HK,
                        HV, K, BT, False)
    else:
        _gated_at_chunk(q, k, gc, at, chunk_row_start, chunk_row_end, row_src, i_c, i_h, c_first, 0, scale, HK,
                        HV, K, BT, GATHER)


@triton.jit
def _gated_at(b_k, b_qt, b_gc, scale, BT: tl.constexpr):
    """[BT(j), BT(i)] fp32: scale tril(q k^T exp(gc_i - gc_j))^T of one chunk, from b_k [BT, K] and b_qt [K, BT]
    (the intra-chunk attention, transposed; non-zero for i >= j)."""
    o_t = tl.arange(0, BT)
    b_at = tl.dot(b_k, b_qt)
    return tl.where(o_t[:, None] <= o_t[None, :], b_at * _exp_gate_gap(b_gc[None, :] - b_gc[:, None]) * scale, 0.0)


@triton.jit
def _opaque(x, INTERPRET: tl.constexpr):
    """x through an opaque fp32 copy, so that the sum it enters rounds as written: without it Triton folds
    `dot + y` into the dot's accumulator, and a select on both sides of the sum lets LLVM merge them and ptxas
    fuse y's multiply into the add; either rounds differently from adding a tile read from memory."""
    if INTERPRET:
        return x
    else:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _chunk_dv_local(at, at_chunk0, ic, i_h, b_k, b_qt, b_gc, b_do, scale, HV: tl.constexpr, BT: tl.constexpr,
                    LOCAL_DV: tl.constexpr, INTERPRET: tl.constexpr):
    """A scan chunk's dv_local [BT, BV] fp32 = A^T do: A^T formed here (LOCAL_DV) or read from the chunk-parallel
    kernel's buffer (chunks from at_chunk0 on), the same values in do's dtype either way, into the same dot (rows
    past the chunk's end are 0 in both: their do rows are). The k q^T dot and its gating do not depend on the
    column block, so every state column gets the same bits whatever the scan's width."""
    if LOCAL_DV:
        b_at = _gated_at(b_k, b_qt, b_gc, scale, BT).to(b_do.dtype)
    else:
        o_t = tl.arange(0, BT)
        b_at = tl.load(at + ((ic - at_chunk0) * HV + i_h) * (BT * BT) + o_t[:, None] * BT + o_t[None, :])
    return _opaque(tl.dot(b_at, b_do), INTERPRET)


@triton.jit
def _decayed_q_do(b_qt, b_dos, b_acc, QDO: tl.constexpr):
    """b_acc + q^T b_dos, b_qt [K, BT] bf16 and b_dos = scale exp(gc) do [BT, BV] fp32. QDO 0 rounds b_dos to
    bf16 (one wgmma; 2^-9 relative per element, the largest rounding in d(initial state): 1.2x fla's error,
    whose q^T do runs in tf32); QDO 1 adds the bf16 remainder in a second wgmma (~2^-17, below fla's)."""
    b_hi = b_dos.to(b_qt.dtype)
    b_acc = tl.dot(b_qt, b_hi, acc=b_acc)
    if QDO:
        b_acc = tl.dot(b_qt, (b_dos - b_hi.to(tl.float32)).to(b_qt.dtype), acc=b_acc)
    return b_acc


@triton.jit
def _state_bwd_step(q, k, w, gc, do, at, at_chunk0, dvn, dh, row_src, row_own, b_ds, i_c, c0, bos, eos, i_h, i_hk,
                    state_offs, scale, shift, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BT: tl.constexpr, o_v, GATHER: tl.constexpr, QDO: tl.constexpr, LOCAL_DV: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """One chunk of the reverse scan; q, k and do are read at the row maps (GATHER) or at packed row + `shift`."""
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    ic = (c0 + i_c).to(tl.int64)
    rows = bos + i_c * BT + o_t
    m_t = rows < eos
    last = tl.minimum(bos + i_c * BT + BT, eos) - 1

    tl.store(dh + (ic * HV + i_h) * (K * V) + state_offs, b_ds.to(dh.dtype.element_ty))

    src = _input_rows(row_src, rows, m_t, shift, GATHER)
    do_rows, m_do = _kept_rows(row_own, rows, m_t, shift, GATHER)
    b_gc = tl.load(gc + rows * HV + i_h, mask=m_t, other=0.0)
    b_gl = tl.load(gc + last * HV + i_h)
    # (scale exp(gc) q)^T do first: it does not depend on dS, so its wgmma runs beside the chain's
    # k dS; the row scaling goes on the [BT, BV] do tile (fewer registers than q^T)
    b_qt = tl.load(q + src[None, :] * (HK * K) + i_hk * K + o_k[:, None], mask=m_t[None, :], other=0.0)
    b_do = tl.load(do + (do_rows[:, None] * HV + i_h) * V + o_v[None, :], mask=m_do[:, None], other=0.0)
    b_acc = _decayed_q_do(b_qt, b_do * (tl.exp2(b_gc * LOG2E) * scale)[:, None], b_ds * tl.exp2(b_gl * LOG2E), QDO)

    b_k = tl.load(k + src[:, None] * (HK * K) + i_hk * K + o_k[None, :], mask=m_t[:, None], other=0.0)
    b_dvn = _chunk_dv_local(at, at_chunk0, ic, i_h, b_k, b_qt, b_gc, b_do, scale, HV, BT, LOCAL_DV, INTERPRET)
    b_dvn += tl.where(m_t[:, None], tl.dot(b_k, b_ds.to(b_k.dtype)) * tl.exp2((b_gl - b_gc) * LOG2E)[:, None], 0.0)
    tl.store(dvn + (rows[:, None] * HV + i_h) * V + o_v[None, :], b_dvn.to(dvn.dtype.element_ty),
             mask=m_t[:, None])

    # - w^T dvn accumulated onto the same registers (bf16 negation is exact): no wait between the two wgmmas
    b_wt = tl.load(w + (rows[None, :] * HV + i_h) * K + o_k[:, None], mask=m_t[None, :], other=0.0)
    return tl.dot(b_wt, (-b_dvn).to(b_wt.dtype), acc=b_acc)


@triton.jit
def _state_bwd_step_tma(q_desc, k_desc, w_desc, do_desc, at_desc, at_chunk0, dh, dvn, gc, b_ds, i_c, c0, bos, eos,
                        i_h, i_hk, i_v, state_offs, scale, shift, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BT: tl.constexpr, BV: tl.constexpr, o_v, QDO: tl.constexpr, LOCAL_DV: tl.constexpr,
                        INTERPRET: tl.constexpr):
    """_state_bwd_step on a full chunk, its loads through tensor descriptors (see state_fwd._state_fwd_step_tma):
    the same arithmetic in the same order. The row mask stays on the k dS term although every row is inside:
    without the select, ptxas contracts dv_local + (k dS) exp(..) into one FMA, which rounds differently."""
    ic = (c0 + i_c).to(tl.int64)
    row0 = (bos + i_c * BT).to(tl.int32)
    src0 = (row0 + shift).to(tl.int32)
    col_v = i_h * V + i_v * BV
    rows = row0 + tl.arange(0, BT)
    m_t = rows < eos
    tl.store(dh + (ic * HV + i_h) * (K * V) + state_offs, b_ds.to(dh.dtype.element_ty))
    b_gc = tl.load(gc + rows * HV + i_h)
    b_gl = tl.load(gc + (row0 + BT - 1) * HV + i_h)
    b_qt = tl.trans(q_desc.load([src0, i_hk * K]))                      # [K, BT]
    b_do = do_desc.load([src0, col_v])                                  # [BT, BV]
    b_acc = _decayed_q_do(b_qt, b_do * (tl.exp2(b_gc * LOG2E) * scale)[:, None], b_ds * tl.exp2(b_gl * LOG2E), QDO)
    b_k = k_desc.load([src0, i_hk * K])
    if LOCAL_DV:
        b_at = _gated_at(b_k, b_qt, b_gc, scale, BT).to(b_do.dtype)
    else:
        b_at = at_desc.load([(((ic - at_chunk0) * HV + i_h) * BT).to(tl.int32), 0])  # [BT, BT]
    b_dvn = _opaque(tl.dot(b_at, b_do), INTERPRET)
    b_dvn += tl.where(m_t[:, None], tl.dot(b_k, b_ds.to(b_k.dtype)) * tl.exp2((b_gl - b_gc) * LOG2E)[:, None], 0.0)
    tl.store(dvn + (rows[:, None] * HV + i_h).to(tl.int64) * V + o_v[None, :], b_dvn.to(dvn.dtype.element_ty))
    b_w = w_desc.load([row0, i_h * K])
    return tl.dot(tl.trans(b_w), (-b_dvn).to(b_w.dtype), acc=b_acc)


@triton.jit
def _state_bwd_chunk(q, k, w, gc, do, at, at_chunk0, dvn, dh, descs, row_src, row_own, b_ds, i_c, c0, bos, eos,
                     i_h, i_hk, i_v, state_offs, scale, shift, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                     V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, o_v, GATHER: tl.constexpr, TMA: tl.constexpr,
                     QDO: tl.constexpr, LOCAL_DV: tl.constexpr, INTERPRET: tl.constexpr):
    """A chunk of the main loop: loads through `descs` = (q, k, w, do, A^T) with TMA (full chunks only),
    else through pointers."""
    if TMA:
        return _state_bwd_step_tma(descs[0], descs[1], descs[2], descs[3], descs[4], at_chunk0, dh, dvn, gc, b_ds, i_c,
                                   c0, bos, eos, i_h, i_hk, i_v, state_offs, scale, shift, HV, K, V, BT, BV, o_v, QDO,
                                   LOCAL_DV, INTERPRET)
    else:
        return _state_bwd_step(q, k, w, gc, do, at, at_chunk0, dvn, dh, row_src, row_own, b_ds, i_c, c0, bos,
                               eos, i_h, i_hk, state_offs, scale, shift, HK, HV, K, V, BT, o_v, GATHER, QDO, LOCAL_DV,
                               INTERPRET)


@triton.jit
def _state_bwd_kernel(q, k, w, gc, do, at, at_chunk0, dvn, dh, dh0, bank_grad, q_desc, k_desc, w_desc, do_desc,
                      at_desc, cu_seqlens, seq_chunk_start, seq_order, seq_export_start, export_end_chunk,
                      export_end_slot, row_src, row_own, seq_shift, scale, HK: tl.constexpr, HV: tl.constexpr,
                      K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, INTERPRET: tl.constexpr,
                      GATHER: tl.constexpr, TMA: tl.constexpr, QDO: tl.constexpr, LOCAL_DV: tl.constexpr):
    i_n, i_h, i_hk, bos, eos, c0, n_chunks, i_v, o_v, state_offs = _scan_program(
        cu_seqlens, seq_chunk_start, seq_order, HK, HV, K, V, BT, BV)
    descs = (q_desc, k_desc, w_desc, do_desc, at_desc)
    # export segments in reverse (see state_fwd): a segment's exported end state takes its gradient before
    # the segment's last chunk, as the per-chunk injection did; the inner loops carry no bank logic
    e0 = tl.load(seq_export_start + i_n)
    e1 = tl.load(seq_export_start + i_n + 1)
    b_ds = tl.zeros([K, BV], dtype=tl.float32)
    shift = e0 * 0
    c_first = e0 * 0
    if GATHER:  # see state_fwd: chunk 0 through the row maps (last, below), the rest at row + shift
        shift = tl.load(seq_shift + i_n)
        c_first += 1
    # with TMA the loops take the full chunks; a partial last chunk runs masked before them (see state_fwd)
    n_loop = (eos - bos) // BT if TMA else n_chunks
    i_e = e1 - 1
    while i_e >= e0:
        c_end = tl.load(export_end_chunk + i_e)
        c_start = tl.maximum(tl.where(i_e > e0, tl.load(export_end_chunk + tl.maximum(i_e - 1, 0)), 0), c_first)
        slot = tl.load(export_end_slot + i_e)  # masked, not a branch (see state_fwd)
        b_ds += tl.load(bank_grad + (tl.maximum(slot, 0) * HV + i_h) * (K * V) + state_offs,
                        mask=(state_offs * 0 + slot) >= 0, other=0.0)
        if TMA:
            if (n_loop >= c_start) & (n_loop < c_end):
                b_ds = _state_bwd_step(q, k, w, gc, do, at, at_chunk0, dvn, dh, row_src, row_own, b_ds, n_loop,
                                       c0, bos, eos, i_h, i_hk, state_offs, scale, shift, HK, HV, K, V, BT, o_v,
                                       False, QDO, LOCAL_DV, INTERPRET)
        c_hi = tl.minimum(c_end, n_loop)
        if INTERPRET:  # see state_fwd: no loaded loop bounds in the CPU interpreter
            i_c = c_hi - 1
            while i_c >= c_start:
                b_ds = _state_bwd_chunk(q, k, w, gc, do, at, at_chunk0, dvn, dh, descs, row_src, row_own, b_ds,
                                        i_c, c0, bos, eos, i_h, i_hk, i_v, state_offs, scale, shift, HK, HV, K, V, BT,
                                        BV, o_v, False, TMA, QDO, LOCAL_DV, INTERPRET)
                i_c -= 1
        else:
            for i_r in range(0, c_hi - c_start):
                b_ds = _state_bwd_chunk(q, k, w, gc, do, at, at_chunk0, dvn, dh, descs, row_src, row_own, b_ds,
                                        c_hi - 1 - i_r, c0, bos, eos, i_h, i_hk, i_v, state_offs, scale, shift, HK, HV,
                                        K, V, BT, BV, o_v, False, TMA, QDO, LOCAL_DV, INTERPRET)
        i_e -= 1
    if GATHER:
        if n_chunks > 0:
            b_ds = _state_bwd_step(q, k, w, gc, do, at, at_chunk0, dvn, dh, row_src, row_own, b_ds, 0, c0, bos,
                                   eos, i_h, i_hk, state_offs, scale, e0 * 0, HK, HV, K, V, BT, o_v, True, QDO,
                                   LOCAL_DV, INTERPRET)
    tl.store(dh0 + (i_n * HV + i_h).to(tl.int64) * (K * V) + state_offs, b_ds)


def gated_at_bwd(q, k, gc, scale, index, chunks: tuple[int, int], dtype: torch.dtype, rows=None):
    """A^T (A = scale tril(q k^T exp(gc_i - gc_j))) of chunks [chunks[0], chunks[1]) of `index` in `dtype` (do's: the
    dot with do takes it so): [chunks, HV, BT, BT], for the scan launches over them to read (`state_bwd_scan`'s
    `gated_at`). `rows` (index.PackedRows): q and k are compact, read through `rows.src`."""
    _, hk, kd = q.shape
    hv, bt = gc.shape[1], index.chunk_size
    at = torch.empty(chunks[1] - chunks[0], hv, bt, bt, device=q.device, dtype=dtype)
    if chunks[1] > chunks[0]:
        _gated_at_kernel[((chunks[1] - chunks[0]) * hv,)](
            q, k, gc, at, index.chunk_row_start, index.chunk_row_end, row_tables(index, rows)[0],
            chunk_shift_table(index, rows), chunks[0], scale, HK=hk, HV=hv, K=kd, BT=bt, GATHER=rows is not None,
            num_warps=index.config.gated_at_warps)
    return at


def state_bwd_scan(q, k, w, gc, do, bank_grad, scale, index, dh, dvn, *, gated_at=None,
                   seqs: tuple[int, int] | None = None, rows=None, launch_seqs: int | None = None,
                   initial_state_grad: bool = False, order=None):
    """The reverse scan of sequences `seqs` = (first, count) of `index` (default: all) into the shared dh
    [NC, HV, K, V] and dvn [R, HV, V]; returns their initial-state gradients [count, HV, K, V] fp32.
    `gated_at`: (gated_at_bwd's buffer over the launch's chunks, its first chunk) for the scan to read, or None for it
    to form each chunk's A^T itself, which needs a full-width launch (`GDNKernelConfig.scan_full_width`).
    `rows` (index.PackedRows): q, k and do are compact, read through `rows.src` and `rows.own`.
    `launch_seqs`, `order`: as in state_fwd. `initial_state_grad`: the caller returns the initial-state gradients
    (GDNKernelConfig.scan_q_do_precision "auto" then takes the precise q^T do)."""
    _, hk, kd = q.shape
    hv, vd = do.shape[1], do.shape[2]
    first, count = seqs if seqs is not None else (0, index.num_seqs)
    cfg = index.config
    bv, warps, stages = cfg.scan_launch_for(launch_seqs or count, hv, vd, k.element_size())
    local_dv = gated_at is None
    if local_dv and not cfg.scan_full_width(launch_seqs or count, hv, vd, k.element_size()):
        raise ValueError("a narrow backward scan launch reads A^T: pass gated_at_bwd's buffer")
    at, at_chunk0 = (do, 0) if local_dv else gated_at  # never read with LOCAL_DV
    at_tile = (do, bv) if local_dv else (at.view(-1, 1, index.chunk_size), index.chunk_size)
    dh0 = torch.empty(count, hv, kd, vd, device=q.device, dtype=torch.float32)
    shifts = scan_row_shift(index, rows, first)
    tma, descs = scan_descriptors(cfg, bv, index.chunk_size, ((q, kd), (k, kd), (w, kd), (do, bv), at_tile))
    if count:
        _state_bwd_kernel[scan_grid(count, hv, vd, bv)](
            q, k, w, gc, do, at, at_chunk0, dvn, dh, dh0, bank_grad, *descs, index.cu_seqlens[first:],
            index.seq_chunk_start[first:], scan_order(index, seqs, order), index.seq_export_start[first:],
            index.export_end_chunk, index.export_end_slot, *row_tables(index, rows), shifts, scale, HK=hk, HV=hv,
            K=kd, V=vd, BT=index.chunk_size, BV=bv, INTERPRET=interpreting(), GATHER=rows is not None,
            TMA=tma, QDO=cfg.scan_q_do_code(initial_state_grad), LOCAL_DV=local_dv, num_warps=warps,
            num_stages=stages)
    return dh0


def state_bwd(q, k, w, gc, do, bank_grad, scale, index, initial_state_grad: bool = False, order=None):
    """Returns dh [NC, HV, K, V] (k's dtype), dvn [R, HV, V] (do's dtype), dh0 [N, HV, K, V] fp32
    (`initial_state_grad`, `order`: see state_bwd_scan). One launch over every sequence, which forms dv_local itself
    where it runs at full width (the runtime's path, tree.py, also asks for long sequences: it knows their lengths
    on the host)."""
    hv, kd, vd = do.shape[1], q.shape[2], do.shape[2]
    gated_at = None
    if not index.config.scan_full_width(index.num_seqs, hv, vd, k.element_size()):
        gated_at = (gated_at_bwd(q, k, gc, scale, index, (0, index.num_chunks), do.dtype), 0)
    dh = torch.empty(index.num_chunks, hv, kd, vd, device=q.device, dtype=k.dtype)
    dvn = torch.empty_like(do)
    dh0 = state_bwd_scan(q, k, w, gc, do, bank_grad, scale, index, dh, dvn, gated_at=gated_at,
                         initial_state_grad=initial_state_grad, order=order)
    return dh, dvn, dh0
