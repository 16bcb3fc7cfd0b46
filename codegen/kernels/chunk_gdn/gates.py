"""Jit helpers shared by the chunk kernels: a chunk's rows and the gate arithmetic."""
import triton
import triton.language as tl


@triton.jit
def _exp_gate_gap(b_gap):
    """exp(gc_i - gc_j) for the in-chunk decay between tokens j <= i, whose gap is <= 0 exactly
    (gc is a running sum of g <= 0, and rounding keeps it non-increasing), so the clamp is the
    identity wherever the callers keep the value. It matters in the lanes they select away: past a
    sequence's end gc loads as 0 while a valid row's gc can be -1000 (strong decays, as
    transformers' init gives), and exp(+1000) = inf times a zero operand made NaN there, which
    leaked into dv, dk, dg, dbeta and the initial-state gradient of partial chunks."""
    return tl.exp(tl.minimum(b_gap, 0.0))


@triton.jit
def _chunk_rows(chunk_row_start, chunk_row_end, i_c, BT: tl.constexpr):
    """Packed rows of chunk i_c: (row0, row_end, rows [BT], mask of the rows inside the sequence [BT])."""
    row0 = tl.load(chunk_row_start + i_c)
    row_end = tl.load(chunk_row_end + i_c)
    rows = row0 + tl.arange(0, BT)
    return row0, row_end, rows, rows < row_end


@triton.jit
def _gate_cumsum(g, gc, rows, m_t, i_h, HV: tl.constexpr):
    """In-chunk cumsum of the gate, fp32 [BT], stored: every later kernel reads these values."""
    b_gc = tl.cumsum(tl.load(g + rows * HV + i_h, mask=m_t, other=0.0).to(tl.float32), 0)
    tl.store(gc + rows * HV + i_h, b_gc, mask=m_t)
    return b_gc
