"""Jit helpers of the sub-chunk decomposition: a 64-row chunk is four 16-row blocks, and every product that
carries the per-channel decay exp(gc_i - gc_j) (j <= i, gc the in-chunk cumsum of g) is computed so that no
factor exceeds 1:

- off-diagonal blocks (I > J) split the decay at a reference row n between the two blocks, as fla does:
  exp(gc_i - gc_j) = exp(gc_i - gc_n) exp(gc_n - gc_j) with both exponents <= 0, so each factor scales a
  [16, BK] tile of q or k and a tensor-core dot sums over the channels;
- diagonal blocks take exp(gc_i - gc_j) elementwise, with no split at all, in row-parallel kernels of their
  own (intra_fwd._diag_fwd_kernel, diag_bwd._diag_bwd_kernel).

Every exponent x is taken as -|x| (`_decay`): on valid rows the gap is <= 0 exactly (gc is a running sum of
g <= 0), so this is the identity; in padding lanes (gc loads 0) x could be large and positive, and exp(x) = inf
would meet a zero operand (NaN). GDN's `_exp_gate_gap` clamps at 0 instead; -|x| is an operand modifier of the
FMUL where the clamp costs an FMNMX.
Dots of these fp32 tiles run through the tensor cores (tf32 on the GPU, as fla's intra-chunk kernels; exact
fp32 in the CPU interpreter).
"""
import triton
import triton.language as tl

from ..chunk_gdn.gates import LOG2E, _input_rows


@triton.jit
def _block_rows(row_src, row0, row_end, sub, shift, GATHER: tl.constexpr):
    """Packed rows of block `sub` (16 rows from row0 + 16 sub): (rows, mask inside the sequence, input rows)."""
    rows = row0 + sub * 16 + tl.arange(0, 16)
    m = rows < row_end
    return rows, m, _input_rows(row_src, rows, m, shift, GATHER)


@triton.jit
def _chunk_blocks(chunk_row_start, chunk_row_end, row_src, i_c, shift, GATHER: tl.constexpr):
    """Chunk i_c's first and end rows, then its four blocks' (rows, mask, input rows), block 0 first."""
    row0 = tl.load(chunk_row_start + i_c)
    row_end = tl.load(chunk_row_end + i_c)
    r0, m0, s0 = _block_rows(row_src, row0, row_end, 0, shift, GATHER)
    r1, m1, s1 = _block_rows(row_src, row0, row_end, 1, shift, GATHER)
    r2, m2, s2 = _block_rows(row_src, row0, row_end, 2, shift, GATHER)
    r3, m3, s3 = _block_rows(row_src, row0, row_end, 3, shift, GATHER)
    return row0, row_end, r0, m0, s0, r1, m1, s1, r2, m2, s2, r3, m3, s3


@triton.jit
def _block_betas(beta, s0, m0, s1, m1, s2, m2, s3, m3, i_h, HV: tl.constexpr):
    """beta [16] fp32 of the four blocks' input rows (masked rows 0)."""
    return (tl.load(beta + s0 * HV + i_h, mask=m0, other=0.0).to(tl.float32),
            tl.load(beta + s1 * HV + i_h, mask=m1, other=0.0).to(tl.float32),
            tl.load(beta + s2 * HV + i_h, mask=m2, other=0.0).to(tl.float32),
            tl.load(beta + s3 * HV + i_h, mask=m3, other=0.0).to(tl.float32))


@triton.jit
def _block_tiles(x, s0, m0, s1, m1, s2, m2, s3, m3, row_stride, col0, o_k):
    """The four blocks' [16, BK] fp32 tiles of x (`_tile`), block 0 first."""
    return (_tile(x, s0, m0, row_stride, col0, o_k), _tile(x, s1, m1, row_stride, col0, o_k),
            _tile(x, s2, m2, row_stride, col0, o_k), _tile(x, s3, m3, row_stride, col0, o_k))


@triton.jit
def _tile(x, rows, m, row_stride, col0, o_k):
    """[16, BK] fp32 tile of x at rows `rows` (masked rows 0), columns col0 + o_k."""
    return tl.load(x + rows[:, None].to(tl.int64) * row_stride + col0 + o_k[None, :], mask=m[:, None],
                   other=0.0).to(tl.float32)


@triton.jit
def _tile_t(x, rows, m, row_stride, col0, o_k):
    """The same tile transposed, loaded transposed ([BK, 16]), not a transposed register tile."""
    return tl.load(x + rows[None, :].to(tl.int64) * row_stride + col0 + o_k[:, None], mask=m[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _decay(gc_a, gc_b):
    """exp(-|gc_a - gc_b|) <= 1: the decay between two rows of a chunk, whichever of them comes first."""
    return tl.exp2(tl.abs(gc_a - gc_b) * -LOG2E)


@triton.jit
def _head_group(i_hg, BH: tl.constexpr, HV: tl.constexpr, HK: tl.constexpr):
    """(value heads [BH], their mask, key heads) of head group i_hg in the row-parallel diagonal kernels. A partial
    group repeats the last head (its lanes are stored nowhere), so the walks' loads need no masks."""
    o_h = i_hg * BH + tl.arange(0, BH)
    o_hv = tl.minimum(o_h, HV - 1)
    return o_hv, o_h < HV, o_hv // (HV // HK)


@triton.jit
def _to_ref(b_x, b_gc, b_ref):
    """x exp(gc - ref) for rows at or after the reference row (factor <= 1)."""
    return b_x * _decay(b_gc, b_ref[None, :])


@triton.jit
def _from_ref(b_x, b_gc, b_ref):
    """x exp(ref - gc) for rows at or before the reference row (factor <= 1)."""
    return b_x * _decay(b_ref[None, :], b_gc)


@triton.jit
def _off_rows(b_dm, b_y, b_gcj, b_gci, b_ref):
    """X_I += [16, BK]: sum_{j in J} dm_ij y_j exp(gc_i - gc_j) for a block J before I, split at a row between
    them (gc of that row: b_ref).
    (The factors are written out rather than calls of _to_ref / _from_ref / _decay: each device-function call costs the
    CPU interpreter a re-patch of triton.language, about a millisecond.)"""
    b_yr = b_y * tl.exp2(tl.abs(b_ref[None, :] - b_gcj) * -LOG2E)
    return tl.dot(b_dm, b_yr) * tl.exp2(tl.abs(b_gci - b_ref[None, :]) * -LOG2E)


@triton.jit
def _off_cols(b_dmt, b_x, b_gci, b_gcj, b_ref):
    """Z_J += [16, BK]: sum_{i in I} dm_ij x_i exp(gc_i - gc_j) for a block I after J, split at a row between
    them;
    b_dmt is dm_IJ transposed."""
    b_xr = b_x * tl.exp2(tl.abs(b_gci - b_ref[None, :]) * -LOG2E)
    return tl.dot(b_dmt, b_xr) * tl.exp2(tl.abs(b_ref[None, :] - b_gcj) * -LOG2E)


@triton.jit
def _store_block(x, rows, m, i_h, col0, b_x, HV: tl.constexpr, W: tl.constexpr):
    """A [16, 16] block into rows `rows`, columns col0.. of x [R, HV, W]."""
    o_i = tl.arange(0, 16)
    tl.store(x + (rows[:, None].to(tl.int64) * HV + i_h) * W + col0 + o_i[None, :], b_x, mask=m[:, None])


@triton.jit
def _load_block(x, rows, m, i_h, col0, HV: tl.constexpr, W: tl.constexpr, LOWER: tl.constexpr = False):
    """A [16, 16] block of x [R, HV, W] at rows `rows`, columns col0..; LOWER: only entries j <= i (the others
    load as 0, whatever memory holds there)."""
    o_i = tl.arange(0, 16)
    mask = m[:, None] & (o_i[None, :] <= o_i[:, None]) if LOWER else m[:, None]
    return tl.load(x + (rows[:, None].to(tl.int64) * HV + i_h) * W + col0 + o_i[None, :], mask=mask, other=0.0)


@triton.jit
def _load_block_t(x, rows_i, m_i, i_h, col0, HV: tl.constexpr, W: tl.constexpr):
    """Block (I, J) of x [R, HV, W] transposed: element (j, i) = x[rows_i[i], col0 + j]."""
    o_j = tl.arange(0, 16)
    return tl.load(x + (rows_i[None, :].to(tl.int64) * HV + i_h) * W + col0 + o_j[:, None], mask=m_i[None, :],
                   other=0.0)
