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


def scan_descriptors(config, block_v: int, chunk_size: int,
                     tiles: tuple[tuple[torch.Tensor, int], ...]) -> tuple[bool, tuple]:
    """(TMA, the launch's descriptor arguments) of a scan launch of `block_v` state columns: `tiles` holds each
    tensor [R, H, D] with the columns of its [chunk_size, columns] tiles. TMA when the launch is at most
    `config.scan_tma_max_block_v` columns wide, every tensor is dense, 16-byte aligned and non-empty (TMA's
    rules), on sm_90+ or under the interpreter; otherwise the tensors themselves stand in for the descriptors
    (the kernel never reads them)."""
    tensors = tuple(t for t, _ in tiles)
    if not (block_v <= config.scan_tma_max_block_v and _tma_ok(tensors)):
        return False, tensors
    return True, tuple(rows_descriptor(t, chunk_size, cols) for t, cols in tiles)


def _tma_ok(tensors: tuple[torch.Tensor, ...]) -> bool:
    if any(t.numel() == 0 or not t.is_contiguous() or t.data_ptr() % 16 for t in tensors):
        return False
    if interpreting():
        return True
    device = tensors[0].device
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
