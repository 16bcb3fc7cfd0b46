"""Jit helpers shared by the chunk kernels: a chunk's rows, the rows behind them, and the gate arithmetic."""
import triton
import triton.language as tl

from .. import LOG2E as _LOG2E
from .index import NO_SHIFT as _NO_SHIFT

NO_SHIFT = tl.constexpr(_NO_SHIFT)


# exp(x) = exp2(x log2 e): FMUL + MUFU.EX2 an entry, where tl.exp adds a range check for results under 2^-126
# (five instructions); such results flush to 0, and every exp in these kernels is a decay factor <= 1 that scales
# other terms. A constexpr, as jit functions read module globals only in that form.
LOG2E = tl.constexpr(_LOG2E)


@triton.jit
def _exp_gate_gap(b_gap):
    """exp(gc_i - gc_j) for the in-chunk decay between tokens j <= i, whose gap is <= 0 exactly
    (gc is a running sum of g <= 0, and rounding keeps it non-increasing), so the clamp is the
    identity wherever the callers keep the value. It matters in the lanes they select away: past a
    sequence's end gc loads as 0 while a valid row's gc can be -1000 (strong decays, as
    transformers' init gives), and exp(+1000) = inf times a zero operand made NaN there, which
    leaked into dv, dk, dg, dbeta and the initial-state gradient of partial chunks."""
    return tl.exp2(tl.minimum(b_gap, 0.0) * LOG2E)


@triton.jit
def _chunk_rows(chunk_row_start, chunk_row_end, i_c, BT: tl.constexpr):
    """Packed rows of chunk i_c: (row0, row_end, rows [BT], mask of the rows inside the sequence [BT])."""
    row0 = tl.load(chunk_row_start + i_c)
    row_end = tl.load(chunk_row_end + i_c)
    rows = row0 + tl.arange(0, BT)
    return row0, row_end, rows, rows < row_end


@triton.jit
def _input_rows(row_src, rows, m_t, shift, GATHER: tl.constexpr):
    """Rows of q, k, v, g, beta behind packed rows: rows + `shift`, or with GATHER the compact tokens they hold
    (index.PackedRows.src), so that tree mode reads its inputs in place instead of from copies."""
    if GATHER:
        return tl.load(row_src + rows, mask=m_t, other=0)
    else:
        return rows + shift


@triton.jit
def _kept_rows(row_own, rows, m_t, shift, GATHER: tl.constexpr):
    """(rows of o, do and the input gradients of kept tokens, their mask): rows + `shift`, or with GATHER the
    compact token each row keeps (index.PackedRows.own), masked off on replayed rows (whose value there is
    -1 - their slot in the side buffers)."""
    if GATHER:
        b_own = tl.load(row_own + rows, mask=m_t, other=-1)
        return b_own, m_t & (b_own >= 0)
    else:
        return rows + shift, m_t


@triton.jit
def _chunk_shift(chunk_shift, i_c, GATHER: tl.constexpr):
    """(shift, whether chunk i_c of a chunk-parallel launch reads and writes its rows at row + shift rather than
    through the row maps). With GATHER (tree mode) the plan's per-chunk shift, NO_SHIFT where the chunk has a
    replayed row; without, never (False at compile time, so the kernel holds one path)."""
    if GATHER:
        shift = tl.load(chunk_shift + i_c)
        return shift, shift != NO_SHIFT
    else:
        return 0, False


@triton.jit
def _scan_program(cu_seqlens, seq_chunk_start, seq_order, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                  V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    """The (sequence, value head, BV state columns) of a scan program: (i_n, i_h, i_hk, bos, eos, first chunk
    c0, chunk count, i_v, offsets [K, BV] of its columns in a [K, V] state). A 1-D grid of `scan_grid`
    programs: the k-th group of HV x (V / BV) programs runs sequence seq_order[k]. The scans' time is the
    longest sequence's chunk walk, so the host orders the sequences longest first (`index.longest_first`):
    the GPU starts programs in grid order, and a long sequence launched last would run alone at the end."""
    pid = tl.program_id(0)
    i_v = pid % (V // BV)
    i_nh = pid // (V // BV)
    i_n = tl.load(seq_order + i_nh // HV)
    i_h = i_nh % HV
    i_hk = i_h // (HV // HK)
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    c0 = tl.load(seq_chunk_start + i_n)
    o_v = i_v * BV + tl.arange(0, BV)
    state_offs = tl.arange(0, K)[:, None] * V + o_v[None, :]
    return i_n, i_h, i_hk, bos, eos, c0, tl.cdiv(eos - bos, BT), i_v, o_v, state_offs


def scan_grid(count: int, value_heads: int, value_dim: int, block_v: int) -> tuple[int]:
    """The 1-D grid of a scan launch over `count` sequences (`_scan_program`)."""
    return (count * value_heads * (value_dim // block_v),)


def scan_order(index, seqs: tuple[int, int] | None, order):
    """The launch order a scan over `seqs` = (first, count) of `index` reads: `order` (a plan's
    RoundLaunch.scan_order, relative to `first`), or the whole index's `seq_order` when the scan runs every
    sequence."""
    if order is not None:
        return order
    if seqs is not None and tuple(seqs) != (0, index.num_seqs):
        raise ValueError("a scan over part of the index's sequences needs its launch's order (RoundLaunch.scan_order)")
    return index.seq_order
