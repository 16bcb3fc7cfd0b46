"""Jit helper of the KDA kernels whose programs each take one chunk and one value head: what a program
reads before its arithmetic (Triton inlines it, so the kernels compile as if it were written out)."""
import triton
import triton.language as tl

from ..chunk_gdn.gates import _chunk_rows, _input_rows, _kept_rows


@triton.jit
def _chunk_program(i_ch, chunk_row_start, chunk_row_end, row_src, row_own, shift, HK: tl.constexpr,
                   HV: tl.constexpr, BT: tl.constexpr, GATHER: tl.constexpr):
    """The chunk and heads of program `i_ch` of chunks x value heads (heads fastest), and the chunk's rows:
    (i_c, i_h, i_hk, row0, row_end, packed rows [BT] int64, their mask, input rows int64 (gates._input_rows),
    kept rows int64 and their mask (gates._kept_rows: o, do and the input gradients of kept tokens))."""
    i_c, i_h = i_ch // HV, i_ch % HV
    i_hk = i_h // (HV // HK)
    row0, row_end, rows, m_t = _chunk_rows(chunk_row_start, chunk_row_end, i_c, BT)
    src = _input_rows(row_src, rows, m_t, shift, GATHER).to(tl.int64)
    kept, m_keep = _kept_rows(row_own, rows, m_t, shift, GATHER)
    return i_c, i_h, i_hk, row0, row_end, rows.to(tl.int64), m_t, src, kept.to(tl.int64), m_keep
