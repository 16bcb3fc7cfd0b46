"""`Forest`: the compact prefix forest of a batch, numpy struct-of-arrays (docs/INTERFACES.md 1).

Two stages share the one class:

- after `prefix-compress` (`laid_out=False`): the canonical trie. Nodes are numbered in creation
  order, node `v`'s tokens are `token_ids[node_start[v]:node_start[v]+node_length[v]]` with nodes
  stored back to back in node order; the layout fields are None.
- after `layout` (`laid_out=True`): nodes are renumbered in DFS preorder with the continuation
  child first, so node order = compact order, subtrees and heavy paths are contiguous, and the
  per-token tables (predecessor, conv predecessors, log-prob targets, trajectory gather runs) exist.

Fields beyond INTERFACES.md: `token_pred` (path predecessor of each token, -1 at a tree start),
`traj_run_ptr`/`run_start`/`run_length` (the per-trajectory gather map, run-length encoded:
trajectory j's compact indices are the concatenated ranges of its runs; one run per heavy-path
segment of its path), `tree_start`/`tree_end`, `conv_width`. Trees larger than a microbatch stay whole
here; `cut-pieces` records their pieces beside the forest (`Pieces`).

The conv predecessor table [T, W-1] and the distinct (source, next token) log-prob targets are
fixed by the layout but derived on demand (`conv_pred()`, `targets()`) rather than stored, which
keeps the batch-wide IR at a few int64 per token; codegen materialises them per microbatch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .derive import LAYOUT_FIELDS  # noqa: F401  (re-exported: the fields `layout` sets)
from .derive import concat_ranges, conv_predecessors, log_prob_targets
from .verify_forest import verify_forest


@dataclass(frozen=True, eq=False)
class Forest:
    token_ids: np.ndarray
    token_node: np.ndarray
    token_position: np.ndarray
    node_parent: np.ndarray
    node_tree: np.ndarray
    node_start: np.ndarray
    node_length: np.ndarray
    node_position: np.ndarray
    node_multiplicity: np.ndarray
    tree_ids: list[str]
    traj_ids: list[str]
    traj_end_node: np.ndarray
    traj_length: np.ndarray
    laid_out: bool = False
    conv_width: int = 0
    node_subtree_end: np.ndarray | None = None
    node_cont_child: np.ndarray | None = None
    token_pred: np.ndarray | None = None
    traj_run_ptr: np.ndarray | None = None
    run_start: np.ndarray | None = None
    run_length: np.ndarray | None = None
    tree_start: np.ndarray | None = None
    tree_end: np.ndarray | None = None

    # -- sizes --------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.size)

    @property
    def num_nodes(self) -> int:
        return int(self.node_parent.size)

    @property
    def num_trees(self) -> int:
        return len(self.tree_ids)

    @property
    def num_trajectories(self) -> int:
        return len(self.traj_ids)

    def replace(self, **changes) -> "Forest":
        return dataclasses.replace(self, **changes)

    def children(self) -> list[list[int]]:
        """Children of every node, in node order (O(N) Python; N is small next to T)."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for v, p in enumerate(self.node_parent.tolist()):
            if p >= 0:
                kids[p].append(v)
        return kids

    def trajectory_compact_indices(self, j: int) -> np.ndarray:
        """Compact indices of trajectory j's tokens, in position order (needs the layout)."""
        lo, hi = self.traj_run_ptr[j], self.traj_run_ptr[j + 1]
        return concat_ranges(self.run_start[lo:hi], self.run_length[lo:hi])

    def conv_pred(self) -> np.ndarray:
        """[T, conv_width-1] path predecessors, oldest first, -1 before position 0."""
        return conv_predecessors(self.token_pred, self.node_start, self.node_length,
                                 self.conv_width)

    def targets(self):
        """(target_src [P], target_token [P], token_target [T]): one target per token with a
        predecessor (P = T - trees); pairs (src, token) are distinct in a canonical forest."""
        return log_prob_targets(self.token_pred, self.token_ids)

    def verify(self) -> None:
        verify_forest(self)
