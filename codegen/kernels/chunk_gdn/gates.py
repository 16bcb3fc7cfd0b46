"""Gate arithmetic shared by the chunk kernels."""
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
