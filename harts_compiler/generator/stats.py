"""Batch statistics computed from flat trajectories alone (independent of the compiler)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BatchStats:
    trajectories: int
    trees: int                  # distinct first tokens = roots of the prefix trie
    trajectory_tokens: int
    compact_tokens: int         # distinct prefixes = tokens of the prefix trie
    compression: float          # trajectory_tokens / compact_tokens
    nodes: int                  # maximal runs shared by the same trajectories
    depth_max: int              # nodes on the longest root-to-trajectory-end path
    depth_mean: float
    branch_points: int          # nodes with at least two children
    branching_mean: float       # mean children of the branch points
    branching_max: int
    trajectory_length_mean: float
    trajectory_length_max: int

    def lines(self) -> list[str]:
        return [
            f"trajectories        {self.trajectories}",
            f"trees               {self.trees}",
            f"tokens              {self.trajectory_tokens} trajectory-wise, "
            f"{self.compact_tokens} compact",
            f"compression         {self.compression:.2f}x",
            f"trajectory length   mean {self.trajectory_length_mean:.0f}, "
            f"max {self.trajectory_length_max}",
            f"nodes               {self.nodes}",
            f"depth (nodes/path)  mean {self.depth_mean:.1f}, max {self.depth_max}",
            f"branching           {self.branch_points} branch points, "
            f"mean {self.branching_mean:.2f} children, max {self.branching_max}",
        ]


def batch_stats(trajectories: list[tuple[str, np.ndarray]] | list[np.ndarray]) -> BatchStats:
    """Statistics of a batch of flat trajectories (a list of token arrays or (id, tokens) pairs).

    Every prefix gets a 64-bit polynomial hash `H(p) = sum_j (t_j + 1) * Q^j mod 2^64` (Q a fixed
    odd constant; uint64 arithmetic wraps), computed for all prefixes at once with one segmented
    cumulative sum. Distinct prefixes are distinct hashes (a collision needs two different random
    token strings to agree on 64 bits); a prefix's children are the distinct hashes one longer.
    """
    arrays = [np.asarray(t[1] if isinstance(t, tuple) else t) for t in trajectories]
    if not arrays or any(a.ndim != 1 or len(a) == 0 for a in arrays):
        raise ValueError("trajectories: need at least one, each a non-empty 1-D token array")
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    tokens = np.concatenate(arrays).astype(np.uint64) + np.uint64(1)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    position = np.arange(len(tokens), dtype=np.int64) - np.repeat(starts, lengths)
    powers = np.cumprod(np.full(int(lengths.max()), 0x9E3779B97F4A7C15, dtype=np.uint64))
    running = np.cumsum(tokens * powers[position], dtype=np.uint64)
    before = np.concatenate([[np.uint64(0)], running])[np.repeat(starts, lengths)]
    prefix_hash = running - before                           # hash of the prefix ending here
    parent_hash = np.where(position > 0, np.roll(prefix_hash, 1), np.uint64(0))
    # One sort gives the distinct prefixes and, per token, the index of its prefix among them.
    order = np.argsort(prefix_hash)
    sorted_hash = prefix_hash[order]
    is_new = np.concatenate([[True], sorted_hash[1:] != sorted_hash[:-1]])
    distinct = sorted_hash[is_new]
    representative = order[is_new]
    prefix_index = np.empty(len(tokens), dtype=np.int64)
    prefix_index[order] = np.cumsum(is_new) - 1
    compact = len(distinct)
    roots = int(np.count_nonzero(position[representative] == 0))
    # Children per distinct prefix (roots hang under the empty prefix, hash 0).
    parents, n_children = np.unique(parent_hash[representative], return_counts=True)
    inner = parents != 0
    children = np.zeros(compact, dtype=np.int64)
    children[np.searchsorted(distinct, parents[inner])] = n_children[inner]
    # A node ends where a prefix has several children or a trajectory ends; a child starts one.
    is_last = np.zeros(len(tokens), dtype=bool)
    is_last[starts + lengths - 1] = True
    boundary = children >= 2
    boundary[prefix_index[is_last]] = True
    inner_boundary = boundary[prefix_index] & ~is_last
    depth = 1 + np.add.reduceat(inner_boundary.astype(np.int64), starts)
    nodes = roots + int(children[boundary].sum())
    branching = n_children[(n_children >= 2) & (parents != 0)]
    traj_tokens = int(lengths.sum())
    return BatchStats(
        trajectories=len(arrays), trees=roots, trajectory_tokens=traj_tokens,
        compact_tokens=compact, compression=traj_tokens / compact, nodes=int(nodes),
        depth_max=int(depth.max()), depth_mean=float(depth.mean()),
        branch_points=len(branching),
        branching_mean=float(branching.mean()) if len(branching) else 0.0,
        branching_max=int(branching.max()) if len(branching) else 0,
        trajectory_length_mean=float(lengths.mean()), trajectory_length_max=int(lengths.max()))
