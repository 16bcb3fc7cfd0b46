"""Summing parameter gradients over data-parallel ranks with torch.distributed all-reduce.

The losses of a data-parallel step are already divided by batch-global normalisers, so the
gradient of the batch is the plain *sum* of the ranks' gradients (no division by the world size,
unlike DDP's averaging). Gradients are flattened into a few buckets (one dtype and device each)
so that a step issues O(buckets) collectives, all launched asynchronously before waiting.

The bucket layout depends only on the parameter list, which is the same on every rank, never on
which gradients exist: a parameter this rank did not touch (an MoE expert that got no token, or
every parameter on a rank with an empty slot) contributes zeros, so the collectives always match.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class GradientReducer:
    """Bucketed SUM all-reduce of `params`' gradients over `process_group`.

    Per step: `reduce_in_place()` reduces the accumulated local gradients directly.
    Per slot: `reduce_slot()` flattens the slot's gradients, clears `.grad` and *launches* their
    reduction asynchronously (on GPUs NCCL runs it beside the next slot's compute); the previous
    slot's reduction is waited for and added to a running sum first; `finish()` waits for the last
    one and writes the sum to `.grad`. Costs one extra gradient-sized buffer per pending slot.
    """

    def __init__(self, params: list[torch.nn.Parameter], process_group=None,
                 bucket_bytes: int = 64 << 20):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.params = list(params)
        self.group = process_group
        self.buckets = _bucket(self.params, bucket_bytes)
        self._sums: list[torch.Tensor] | None = None
        self._pending: tuple[list, list[torch.Tensor]] | None = None  # (works, flats)

    def _flat(self, bucket: list[int]) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in (self.params[i] for i in bucket)])

    def _launch(self) -> tuple[list, list[torch.Tensor]]:
        flats = [self._flat(bucket) for bucket in self.buckets]
        works = [dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                 for flat in flats]
        return works, flats

    def _write_back(self, flats: list[torch.Tensor]) -> None:
        for bucket, flat in zip(self.buckets, flats):
            offset = 0
            for i in bucket:
                p = self.params[i]
                p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()

    def reduce_in_place(self) -> None:
        works, flats = self._launch()
        for work in works:
            work.wait()
        self._write_back(flats)

    def reduce_slot(self) -> None:
        launched = self._launch()
        for p in self.params:
            p.grad = None
        self._settle()
        self._pending = launched

    def _settle(self) -> None:
        """Wait for the pending slot reduction and add it to the running sum."""
        if self._pending is None:
            return
        works, flats = self._pending
        self._pending = None
        for work in works:
            work.wait()
        if self._sums is None:
            self._sums = flats
        else:
            for total, flat in zip(self._sums, flats):
                total.add_(flat)

    def finish(self) -> None:
        self._settle()
        if self._sums is not None:
            self._write_back(self._sums)
            self._sums = None


def _bucket(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[list[int]]:
    """Parameter indices grouped by (dtype, device), split so a bucket stays under bucket_bytes
    (a single larger parameter gets its own bucket). Order: first appearance, deterministic."""
    buckets: list[list[int]] = []
    open_bucket: dict[tuple, tuple[int, int]] = {}  # key -> (bucket id, bytes so far)
    for i, p in enumerate(params):
        key = (p.dtype, p.device)
        size = p.numel() * p.element_size()
        if key in open_bucket and open_bucket[key][1] + size <= bucket_bytes:
            b, used = open_bucket[key]
            buckets[b].append(i)
            open_bucket[key] = (b, used + size)
        else:
            buckets.append([i])
            open_bucket[key] = (len(buckets) - 1, size)
    return buckets
