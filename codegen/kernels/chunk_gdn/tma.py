"""Tensor descriptors for the scans' full chunks (TMA bulk copies on sm_90, plain loads elsewhere).

A scan program of a lone long root is one warpgroup on its SM, so the SM issues its instructions one
after another; with pointer loads, half of each chunk's ~420 instructions computed per-element addresses
and masks (sm_90a SASS of the 16-column forward scan). A descriptor load is one bulk copy per tile. Chunks
that need masks or row maps (a sequence's partial last chunk, a tree round's first chunk) keep the pointer
path; both paths do the same arithmetic in the same order.
"""
from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ..interpreter_safe import interpreting


def rows_descriptor(x: torch.Tensor, block_rows: int, block_cols: int) -> TensorDescriptor:
    """x [R, H, D] (contiguous) as [R, H * D] in [block_rows, block_cols] tiles."""
    cols = x.shape[1] * x.shape[2]
    return TensorDescriptor(x, [x.shape[0], cols], [cols, 1], [block_rows, block_cols])


def scan_uses_tma(enabled: bool, row_maps_only: bool, *tensors: torch.Tensor) -> bool:
    """Whether a scan launch reads and writes its full chunks through descriptors: `enabled`
    (GDNKernelConfig.scan_tma), not a launch that reads every chunk through row maps, every tensor dense,
    16-byte aligned and non-empty (TMA's rules), on sm_90+ or under the interpreter."""
    if not enabled or row_maps_only:
        return False
    if any(t.numel() == 0 or not t.is_contiguous() or t.data_ptr() % 16 for t in tensors):
        return False
    if interpreting():
        return True
    device = tensors[0].device
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
