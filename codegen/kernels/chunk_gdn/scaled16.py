"""Row-scaled fp16: how fp32 gradient rows travel between two kernels at half the bytes.

Each row is multiplied by a power of two that brings its largest magnitude into [2^14, 2^15) and stored as fp16;
the reader multiplies by the inverse power. Both products are exact, so the only rounding is the fp16 cast: a
relative 2^-12 on the row's large entries, an eighth of what a bf16 cast costs, and rows of any magnitude keep
that precision (plain fp16 would underflow small gradients) down to a largest entry of 2^-112, below which the
scale stops growing (its inverse must stay a normal fp32) and the row loses bits to fp16's subnormals.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

# the row maximum's exponent after scaling: [2^14, 2^15) stays below fp16's largest finite value, 65504
TOP = tl.constexpr(14)
# the scale's largest biased exponent, so that its inverse stays a normal fp32 (2^-126 at the least)
MAX_SHIFT = tl.constexpr(253)


@dataclasses.dataclass(frozen=True)
class ScaledRows:
    """fp16 `payload` [N, H, D] and fp32 `inverse` [N, H]: row (n, h) is payload[n, h] * inverse[n, h]."""
    payload: torch.Tensor
    inverse: torch.Tensor

    @staticmethod
    def empty(rows: int, heads: int, dim: int, device) -> "ScaledRows":
        return ScaledRows(torch.empty(rows, heads, dim, device=device, dtype=torch.float16),
                          torch.empty(rows, heads, device=device, dtype=torch.float32))

    def float(self) -> torch.Tensor:
        return self.payload.float() * self.inverse[..., None]


@triton.jit
def _row_scales(b_x):
    """(scale [R], inverse [R]) of the rows of fp32 b_x [R, C]: powers of two, scale * inverse = 1."""
    bits = tl.max(tl.abs(b_x), 1).to(tl.int32, bitcast=True)
    shift = (127 + TOP + 127) - ((bits >> 23) & 0xFF)  # biased exponent of 2^(TOP - the maximum's exponent)
    shift = tl.where(shift > MAX_SHIFT, MAX_SHIFT, tl.where(shift < 1, 1, shift))
    return (shift << 23).to(tl.float32, bitcast=True), ((254 - shift) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _store_scaled(payload, inverse, offsets, row_offsets, b_x, mask_rows):
    """Store fp32 b_x [R, C] row-scaled: fp16 entries at payload + offsets [R, C], inverses at inverse +
    row_offsets [R], rows under mask_rows [R]."""
    b_scale, b_inv = _row_scales(b_x)
    tl.store(payload + offsets, (b_x * b_scale[:, None]).to(tl.float16), mask=mask_rows[:, None])
    tl.store(inverse + row_offsets, b_inv, mask=mask_rows)


@triton.jit
def _load_scaled(payload, inverse, offsets, row_offsets, mask_rows):
    """fp32 [R, C] of rows stored by _store_scaled (0 where mask_rows is off)."""
    b_inv = tl.load(inverse + row_offsets, mask=mask_rows, other=0.0)
    return tl.load(payload + offsets, mask=mask_rows[:, None], other=0.0).to(tl.float32) * b_inv[:, None]
