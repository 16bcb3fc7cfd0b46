"""dst[rows[d]] += sum of a segment of source rows, in a fixed order, for every d in one launch.

Tree mode sums gradients over duplicates: a compact token that several packed rows replay gets its own
row's gradient plus the replays' (tree.py), and a bank state that several sequences start from gets their
initial-state gradients. In torch that took a gather, a cast, a segment_reduce (two cub scans for its
offsets), a second gather, an add, a cast and an index_put per tensor: about 8 launches each, 92 launches
for one tau2 microbatch against 19 trajectory-wise (H200 profile, 2026-12-01). One program here sums one
segment's rows over a block of columns, in source order, in fp32, and rounds once into the destination's
dtype: deterministic, no atomics. Destination rows must be distinct (a segment per destination row). A
destination of block-scaled fp16 rows (scaled16.ScaledRows: the GDN backward's final dk) is decoded, added to and
encoded again block by block, one program a block.

The embedding gradient of a microbatch is the same sum: the rows of the tokens that share an id, in a
fixed order (`codegen.lower` groups them on the host; torch's own CUDA embedding backward reads a count
back from the device).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interpreter_safe import interpreter_needs_fp32
from .scaled16 import ScaledRows, _load_scaled, _store_scaled, kernel_pointers


def segment_add_reference(dst, dst_rows: torch.Tensor, src: torch.Tensor, seg_start: torch.Tensor,
                          src_rows: torch.Tensor | None = None):
    """Plain-torch oracle of `segment_add`, in place on `dst`: the same sums in the same order."""
    if isinstance(dst, ScaledRows):
        rows = dst_rows.long()
        decoded = ScaledRows(dst.payload[rows], dst.inverse[rows]).float()
        segment_add_reference(decoded, torch.arange(len(rows)), src, seg_start, src_rows)
        encoded = ScaledRows.encode(decoded, dst.block)
        dst.payload[rows], dst.inverse[rows] = encoded.payload, encoded.inverse
        return dst
    bounds = seg_start.tolist()
    for d, row in enumerate(dst_rows.tolist()):
        acc = torch.zeros(dst[row].shape, dtype=torch.float32, device=dst.device)
        for j in range(bounds[d], bounds[d + 1]):
            acc = acc + src[src_rows[j] if src_rows is not None else j].float()
        dst[row] = (dst[row].float() + acc).to(dst.dtype)
    return dst


@triton.jit
def _segment_add_kernel(dst, dst_inv, dst_rows, src, src_rows, seg_start, W, BW: tl.constexpr, INDEXED: tl.constexpr,
                        SCALED: tl.constexpr):
    """Program (d, i_w): columns [i_w * BW, i_w * BW + BW) of destination row dst_rows[d] ([W] elements); source
    row j from src_rows[j] (INDEXED) or j itself. SCALED: dst holds fp16 blocks of BW columns, scaled by the
    inverses at dst_inv (scaled16.py)."""
    i_d, i_w = tl.program_id(0), tl.program_id(1)
    o_w = i_w * BW + tl.arange(0, BW)
    m_w = o_w < W
    j0 = tl.load(seg_start + i_d)
    j1 = tl.load(seg_start + i_d + 1)
    b_acc = tl.zeros([BW], dtype=tl.float32)
    j = j0
    while j < j1:  # a while loop: its bounds are loaded values (the interpreter runs it too)
        if INDEXED:
            row = tl.load(src_rows + j).to(tl.int64)
        else:
            row = j.to(tl.int64)
        b_acc += tl.load(src + row * W + o_w, mask=m_w, other=0.0).to(tl.float32)
        j += 1
    row = tl.load(dst_rows + i_d).to(tl.int64)
    if SCALED:  # as a [1, BW] tile: one block, one inverse
        one = tl.arange(0, 1)
        offsets, inv_offsets = (row * W + o_w)[None, :], row * (W // BW) + i_w + one
        b_dst = _load_scaled(dst, dst_inv, offsets, inv_offsets[:, None], one == 0) + b_acc[None, :]
        _store_scaled(dst, dst_inv, offsets, inv_offsets, b_dst, one == 0)
    else:
        b_dst = tl.load(dst + row * W + o_w, mask=m_w, other=0.0).to(tl.float32) + b_acc
        tl.store(dst + row * W + o_w, b_dst.to(dst.dtype.element_ty), mask=m_w)


def segment_add(dst, dst_rows: torch.Tensor, src: torch.Tensor, seg_start: torch.Tensor,
                src_rows: torch.Tensor | None = None):
    """In place: dst[dst_rows[d]] += sum over j in [seg_start[d], seg_start[d + 1]) of src[src_rows[j]] (or
    src[j]), summed in that order in fp32 and rounded once (for scaled16.ScaledRows, encoded once).

    dst [T, ...] (a tensor or ScaledRows) and src [R, ...] contiguous with rows of the same size; dst_rows [D]
    distinct int64; seg_start [D + 1] int64 ascending; src_rows [J] int64 or None."""
    scaled = isinstance(dst, ScaledRows)
    values, inverse = kernel_pointers(dst)
    if not (values.is_contiguous() and inverse.is_contiguous() and src.is_contiguous()):
        raise ValueError("segment_add: dst and src must be contiguous")
    if seg_start.numel() != dst_rows.numel() + 1:
        raise ValueError(f"segment_add: seg_start has {seg_start.numel()} bounds for {dst_rows.numel()} rows")
    width = values[0].numel() if values.shape[0] else 0
    if src.shape[0] and src[0].numel() != width:
        raise ValueError(f"segment_add: a source row has {src[0].numel()} elements, a destination row {width}")
    count = dst_rows.numel()
    if not count or not width:
        return dst
    rows = src_rows if src_rows is not None else seg_start  # placeholder pointer when not INDEXED
    if scaled:  # one program per destination row and scale block
        _segment_add_kernel[(count, width // dst.block)](
            values, inverse, dst_rows, src, rows, seg_start, width, BW=dst.block, INDEXED=src_rows is not None,
            SCALED=True, num_warps=1)
        return dst
    if interpreter_needs_fp32(dst):  # the interpreter truncates fp32 -> bf16: sum in fp32, round in torch
        return dst.copy_(segment_add(dst.float(), dst_rows, src, seg_start, src_rows))
    block = min(1024, triton.next_power_of_2(width))
    _segment_add_kernel[(count, triton.cdiv(width, block))](
        dst, dst, dst_rows, src, rows, seg_start, width, BW=block, INDEXED=src_rows is not None, SCALED=False,
        num_warps=4)
    return dst
