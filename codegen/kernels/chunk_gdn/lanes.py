"""Lanes: the scans of independent trees of a tree microbatch on their own CUDA streams (tree.py).

With one scan launch per round, every branch of round r waits for the longest sequence of round r - 1
in the whole microbatch. Trees linked by no state hand-off need not wait for each other: each lane
(a block of whole trees) runs its rounds in order on its own stream. Every chunk still runs the same
kernel code with the same entering state, so the results do not change.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch


def assign_lanes(round_sizes: list[int], seq_rows: np.ndarray, parent: np.ndarray,
                 max_lanes: int) -> tuple[np.ndarray, int]:
    """Lane of each sequence and the number of lanes. Sequences linked by a state hand-off (`parent`: the
    sequence that exported the state a sequence starts from, -1 = none) form one component (in practice
    one tree). Components, in order of their first sequence, are cut into at most `max_lanes` contiguous
    blocks of about equal rows. A lane's scans run in round order on its own stream, so a tree's branches
    start when its own root is done, not when the longest root of the microbatch is.

    Invariant: in every round each lane's sequences are contiguous (one launch per lane and round), so
    the initial-state gradients of one bank slot are summed in one call, as with a single lane; a plan
    whose rounds interleave trees gets one lane (the planner orders a round's sequences by tree). O(N log N)."""
    num_seqs = int(sum(round_sizes))
    if len(round_sizes) <= 1:  # one round: no sequence waits for another, one launch serves them all
        return np.zeros(num_seqs, dtype=np.int64), 1
    root = np.arange(num_seqs)
    for s in range(num_seqs):  # parents precede children (earlier rounds): one pass resolves the roots
        if parent[s] >= 0:
            root[s] = root[parent[s]]
    _, comp_of = np.unique(root, return_inverse=True)  # components numbered by their first sequence
    num_comps = int(comp_of.max()) + 1 if num_seqs else 0
    lanes = min(max_lanes, num_comps)
    if lanes <= 1:
        return np.zeros(num_seqs, dtype=np.int64), 1
    if num_comps <= max_lanes:  # a lane per tree
        block = np.arange(num_comps)
    else:  # contiguous blocks by the rows before each component
        comp_rows = np.bincount(comp_of, weights=seq_rows, minlength=num_comps)
        before = np.cumsum(comp_rows) - comp_rows
        block = np.minimum((before * lanes) // max(comp_rows.sum(), 1), lanes - 1).astype(np.int64)
        block = np.unique(block, return_inverse=True)[1]  # drop lanes a large component left empty
    lane = block[comp_of]
    bounds = np.cumsum([0, *round_sizes])
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a and np.count_nonzero(np.diff(lane[a:b])) + 1 > np.unique(lane[a:b]).size:
            return np.zeros(num_seqs, dtype=np.int64), 1
    return lane, int(block.max()) + 1


def lane_runs(values: np.ndarray) -> list[tuple[int, int]]:
    """(start, stop) of the maximal runs of equal values (none for an empty array)."""
    if values.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(values)) + 1
    edges = np.r_[0, cuts, values.size]
    return list(zip(edges[:-1].tolist(), edges[1:].tolist()))


# Side streams per CUDA device, created once and reused by every call (as PyTorch's own stream pool is):
# the caching allocator keeps freed blocks per stream, so fresh streams per call would scatter the scans'
# temporaries over many per-stream caches. A cache of handles: no result depends on it.
_SIDE_STREAMS: dict[int, list[torch.cuda.Stream]] = {}


def _side_streams(device: torch.device, count: int) -> list[torch.cuda.Stream]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    streams = _SIDE_STREAMS.setdefault(index, [])
    while len(streams) < count:
        streams.append(torch.cuda.Stream(index))
    return streams[:count]


class LaneStreams:
    """One CUDA stream per lane for the scans (lane 0: the current stream). Entering makes the lanes wait
    for the work queued so far; leaving makes the current stream wait for every lane. Tensors allocated
    inside `on(lane)` belong to that lane's stream in the caching allocator and are used and freed there;
    the shared outputs are allocated before, on the current stream, which waits for the lanes before
    anything else touches them. On the CPU (interpreter) or with one lane everything runs in order."""

    def __init__(self, num_lanes: int, device: torch.device):
        self.streams = None
        if num_lanes > 1 and device.type == "cuda":
            self.main = torch.cuda.current_stream(device)
            self.streams = [self.main] + _side_streams(device, num_lanes - 1)

    def __enter__(self):
        for stream in (self.streams or [])[1:]:
            stream.wait_stream(self.main)
        return self

    def on(self, lane: int):
        return torch.cuda.stream(self.streams[lane]) if self.streams else contextlib.nullcontext()

    def __exit__(self, *exc):
        for stream in (self.streams or [])[1:]:
            self.main.wait_stream(stream)
        return False
