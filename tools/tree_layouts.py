"""Small tree-layout builders for kernel tests and benchmarks (not the compiler's IR).

A test/benchmark fixture, outside the installed package: tests import it as `tree_layouts`
(tests/conftest.py puts tools/ on sys.path), bench/attention.py after putting tools/ on sys.path.

A *layout* here is what the kernel sees: ``subtree_end`` per compact token plus, for checking,
the root-to-node paths (compact indices) that trajectory-wise attention would run.
Nodes are laid out in DFS preorder, so a subtree is a contiguous compact range.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class TreeLayout:
    subtree_end: np.ndarray       # [T] int64, compact end of each token's node subtree
    paths: list[np.ndarray]       # per trajectory: compact indices of its tokens, in position order
    node_start: np.ndarray        # [N] compact start of each node
    node_length: np.ndarray       # [N]

    @property
    def num_tokens(self) -> int:
        return int(self.subtree_end.shape[0])

    def subtree_end_tensor(self, device="cpu") -> torch.Tensor:
        return torch.as_tensor(self.subtree_end, dtype=torch.int32, device=device)

    @property
    def trajectory_tokens(self) -> int:
        return int(sum(len(p) for p in self.paths))


def layout_from_parents(parents: list[int], lengths: list[int],
                        ends: list[int] | None = None) -> TreeLayout:
    """Lay out a forest given per node its parent (-1 = root; parents precede children) and
    token count. Children are visited in index order; trajectories end at the nodes `ends`
    (default: every leaf)."""
    n_nodes = len(parents)
    children: list[list[int]] = [[] for _ in range(n_nodes)]
    roots = []
    for node, parent in enumerate(parents):
        if parent < 0:
            roots.append(node)
        else:
            if parent >= node:
                raise ValueError(f"parents[{node}] = {parent}: parents must precede children")
            children[parent].append(node)
    node_start = np.zeros(n_nodes, np.int64)
    node_end = np.zeros(n_nodes, np.int64)
    order = []
    cursor = 0
    stack = list(reversed(roots))
    while stack:  # iterative preorder: deep trees must not hit Python's recursion limit
        node = stack.pop()
        order.append(node)
        node_start[node] = cursor
        cursor += lengths[node]
        stack.extend(reversed(children[node]))
    for node in reversed(order):  # children finish before parents in reversed preorder
        last = node_start[node] + lengths[node]
        node_end[node] = max([last] + [node_end[c] for c in children[node]])
    subtree_end = np.zeros(cursor, np.int64)
    for node in range(n_nodes):
        subtree_end[node_start[node]:node_start[node] + lengths[node]] = node_end[node]
    paths = []
    if ends is None:
        ends = [node for node in range(n_nodes) if not children[node]]
    for node in ends:
        chain = []
        walk = node
        while walk >= 0:
            chain.append(np.arange(node_start[walk], node_start[walk] + lengths[walk]))
            walk = parents[walk]
        paths.append(np.concatenate(chain[::-1]))
    return TreeLayout(subtree_end, paths, node_start, np.asarray(lengths, np.int64))


def random_forest(rng: np.random.Generator, *, n_trees: int = 2, max_nodes: int = 12,
                  max_length: int = 9, wide_prob: float = 0.3) -> TreeLayout:
    """Random forest with single-token nodes, deep chains and (with ``wide_prob``) one wide
    node whose many children are all leaves."""
    parents: list[int] = []
    lengths: list[int] = []
    for _ in range(n_trees):
        base = len(parents)
        n_nodes = int(rng.integers(1, max_nodes + 1))
        for local in range(n_nodes):
            parents.append(-1 if local == 0 else base + int(rng.integers(0, local)))
            lengths.append(1 if rng.random() < 0.3 else int(rng.integers(1, max_length + 1)))
        if rng.random() < wide_prob:
            hub = base + int(rng.integers(0, n_nodes))
            for _ in range(int(rng.integers(5, 20))):
                parents.append(hub)
                lengths.append(int(rng.integers(1, 4)))
    return layout_from_parents(parents, lengths)


def anchor_tree(prefix: int, branches: int, branch_length: int) -> TreeLayout:
    """The benchmarks' anchor shape: one root of ``prefix`` tokens and ``branches`` leaves."""
    return layout_from_parents([-1] + [0] * branches, [prefix] + [branch_length] * branches)
