"""Block-scaled fp16: how fp32 gradient rows travel between two kernels at half the bytes.

A row [D] is cut into blocks of `block` columns (the whole row, or the writer's column tile); each block is
multiplied by a power of two that brings its largest magnitude into [2^14, 2^15) and stored as fp16, and the reader
multiplies by the inverse power. Both products are exact, so the only rounding is the fp16 cast: a relative 2^-12
on the block's large entries, an eighth of what a bf16 cast costs, and blocks of any magnitude keep that precision
(plain fp16 would underflow small gradients) down to a largest entry of 2^-112, below which the scale stops growing
(its inverse must stay a normal fp32) and the block loses bits to fp16's subnormals.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

# the block maximum's exponent after scaling: [2^14, 2^15) stays below fp16's largest finite value, 65504
TOP = tl.constexpr(14)
# the scale's largest biased exponent, so that its inverse stays a normal fp32 (2^-126 at the least)
MAX_SHIFT = tl.constexpr(253)


@dataclasses.dataclass(frozen=True)
class ScaledRows:
    """fp16 `payload` [N, H, D] and fp32 `inverse` [N, H, D // block]: payload[n, h, j] * inverse[n, h, j // block]
    is the value."""
    payload: torch.Tensor
    inverse: torch.Tensor

    @staticmethod
    def empty(rows: int, heads: int, dim: int, device, block: int | None = None) -> "ScaledRows":
        blocks = dim // (block or dim)
        return ScaledRows(torch.empty(rows, heads, dim, device=device, dtype=torch.float16),
                          torch.empty(rows, heads, blocks, device=device, dtype=torch.float32))

    @property
    def shape(self) -> torch.Size:
        return self.payload.shape

    @property
    def blocks(self) -> int:
        """Scale blocks per row."""
        return self.inverse.shape[-1]

    @property
    def block(self) -> int:
        """Columns per scale block."""
        return self.payload.shape[-1] // self.blocks

    def float(self) -> torch.Tensor:
        n, h, d = self.payload.shape
        return (self.payload.float().view(n, h, self.blocks, -1) * self.inverse[..., None]).view(n, h, d)

    @staticmethod
    def encode(x: torch.Tensor, block: int) -> "ScaledRows":
        """Plain-torch reference of `_store_scaled`: fp32 x [N, H, D] in blocks of `block` columns."""
        n, h, d = x.shape
        tiles = x.float().reshape(n, h, d // block, block)
        exponent = (tiles.abs().amax(-1).view(torch.int32) >> 23) & 0xFF
        shift = ((127 + TOP.value + 127) - exponent).clamp(1, MAX_SHIFT.value)
        scale, inverse = (shift << 23).view(torch.float32), ((254 - shift) << 23).view(torch.float32)
        return ScaledRows((tiles * scale[..., None]).to(torch.float16).view(n, h, d), inverse)


def kernel_pointers(x) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, inverses) a kernel takes for `x`: ScaledRows' payload and inverse, or a plain tensor twice (its
    kernels' SCALED flag off, the inverse pointer is not read)."""
    return (x.payload, x.inverse) if isinstance(x, ScaledRows) else (x, x)


@triton.jit
def _row_scales(b_x):
    """(scale [R], inverse [R]) of the rows of fp32 b_x [R, C]: powers of two, scale * inverse = 1."""
    bits = tl.max(tl.abs(b_x), 1).to(tl.int32, bitcast=True)
    shift = (127 + TOP + 127) - ((bits >> 23) & 0xFF)  # biased exponent of 2^(TOP - the maximum's exponent)
    shift = tl.where(shift > MAX_SHIFT, MAX_SHIFT, tl.where(shift < 1, 1, shift))
    return (shift << 23).to(tl.float32, bitcast=True), ((254 - shift) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _store_scaled(payload, inverse, offsets, row_offsets, b_x, mask_rows):
    """Store fp32 b_x [R, C] (each row one scale block) scaled: fp16 entries at payload + offsets [R, C], inverses at
    inverse + row_offsets [R], rows under mask_rows [R]."""
    b_scale, b_inv = _row_scales(b_x)
    tl.store(payload + offsets, (b_x * b_scale[:, None]).to(tl.float16), mask=mask_rows[:, None])
    tl.store(inverse + row_offsets, b_inv, mask=mask_rows)


@triton.jit
def _load_scaled(payload, inverse, offsets, inv_offsets, mask_rows):
    """fp32 [R, C] of entries stored by _store_scaled (0 where mask_rows [R] is off); inv_offsets names each entry's
    block: [R, 1] where every row of the tile lies in one block, [R, C] in general."""
    b_inv = tl.load(inverse + inv_offsets, mask=mask_rows[:, None], other=0.0)
    return tl.load(payload + offsets, mask=mask_rows[:, None], other=0.0).to(tl.float32) * b_inv
