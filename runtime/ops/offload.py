"""Checkpointed layer inputs that wait in host memory between a piece's forward and its backward.

A tree in pieces runs every piece's forward before the backwards (runtime/pieces.py), so with activation
checkpointing every earlier piece keeps its decoder layers' inputs on the device: layers x piece tokens x hidden
values each, 3 GiB per 65,536-token piece of the 2.25B benchmark model, 13 GB for a 48-layer model of hidden
2048. With `TreeModel(offload_piece_inputs=True)` the pieces before the last copy those inputs to pinned host
memory once their forward is done (asynchronously, on the compute stream) and bring each back when its layer is
recomputed in the backward, so the device holds one piece's layer inputs whatever the number of pieces, at the
price of one host round trip of them per earlier piece. Values are copied, not changed: results are bitwise those
of the run without offloading.
"""
from __future__ import annotations

import torch


class HostParkedInput:
    """One checkpointed layer's input: the device tensor until `park`, then a host copy."""

    def __init__(self, x: torch.Tensor):
        self.x = x
        self.device = x.device
        self.requires_grad = x.requires_grad
        self.parked = False

    def park(self) -> None:
        """Copy to (pinned) host memory and drop the device tensor. The copy is enqueued on the current stream,
        so the device memory is only reused after it, and the host copy only read by copies enqueued later."""
        host = torch.empty(self.x.shape, dtype=self.x.dtype, device="cpu", pin_memory=self.device.type == "cuda")
        host.copy_(self.x, non_blocking=True)
        self.x, self.parked = host, True

    def tensor(self) -> torch.Tensor:
        """The input on its device: itself in the first forward; a fresh copy when the backward recomputes the
        layer (with the original's requires_grad, as checkpointing's own recomputation detaches its inputs)."""
        if not self.parked:
            return self.x
        return self.x.to(self.device, non_blocking=True).detach().requires_grad_(self.requires_grad)


def run_layer(layer, parked: HostParkedInput, ctx):
    """`layer(x, ctx)` with x read from `parked` (the function activation checkpointing recomputes)."""
    return layer(parked.tensor(), ctx)
