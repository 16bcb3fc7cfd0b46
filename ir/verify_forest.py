"""`verify_forest`: every invariant of a Forest, vectorised (O(T + N log N)).

Raises `IRError` naming the first broken invariant. Invariants of both stages:
  nodes stored back to back in node order, non-empty; token_node/token_position agree with the
  node table; positions continue from the parent; one root per tree; multiplicity = trajectories
  ending in the subtree, >= 1; trajectory lengths = end node's end position; canonical (a node is a
  maximal run shared by one set of trajectories): sibling first tokens distinct, a node with one
  child has a trajectory ending at it, tree first tokens distinct.
Extra invariants after layout: node order is DFS preorder with the continuation child first;
  subtree ends bound contiguous subtrees; token_pred, subtree ends, runs, tree ranges equal their
  derivation in `derive`;
  every trajectory's runs follow its root-to-end path.
"""
from __future__ import annotations

import numpy as np

from . import derive
from .derive import LAYOUT_FIELDS
from .errors import IRError


def _check(condition, message: str) -> None:
    if not bool(condition):
        raise IRError(f"Forest: {message}")


def verify_forest(f) -> None:
    N, T = f.num_nodes, f.num_tokens
    for name in ("node_parent", "node_tree", "node_start", "node_length", "node_position",
                 "node_multiplicity"):
        _check(getattr(f, name).shape == (N,), f"{name} has shape {getattr(f, name).shape}, "
               f"expected ({N},)")
    for name in ("token_ids", "token_node", "token_position"):
        _check(getattr(f, name).shape == (T,), f"{name} has shape {getattr(f, name).shape}")
    _check(len(f.traj_ids) == f.traj_end_node.size == f.traj_length.size,
           "traj_ids / traj_end_node / traj_length sizes differ")
    _check(len(set(f.traj_ids)) == len(f.traj_ids), "trajectory ids are not unique")
    _check(len(set(f.tree_ids)) == len(f.tree_ids), "tree ids are not unique")
    _check(T == 0 or f.token_ids.min() >= 0, "negative token id")
    _check(N == 0 or f.node_length.min() >= 1, "empty node")
    _check(np.array_equal(f.node_start, derive.exclusive_cumsum(f.node_length)),
           "nodes are not stored back to back in node order")
    _check(int(f.node_length.sum()) == T, "node lengths do not sum to the token count")
    token_node, token_position = derive.token_node_and_position(f.node_start, f.node_length,
                                                                f.node_position)
    _check(np.array_equal(token_node, f.token_node), "token_node disagrees with the node table")
    _check(np.array_equal(token_position, f.token_position),
           "token_position disagrees with the node table")
    parent = f.node_parent
    _check(N == 0 or (parent.min() >= -1 and parent.max() < N), "node_parent out of range")
    is_root = parent < 0
    safe_parent = np.where(is_root, 0, parent)
    _check(np.all(np.where(is_root, f.node_position == 0,
                           f.node_position == f.node_position[safe_parent]
                           + f.node_length[safe_parent])),
           "a node's position is not its parent's end position (or a root is not at 0)")
    _check(np.all(is_root | (f.node_tree == f.node_tree[safe_parent])),
           "a node lies in another tree than its parent")
    roots = np.flatnonzero(is_root)
    _check(np.array_equal(np.sort(f.node_tree[roots]), np.arange(f.num_trees)),
           "trees and roots do not correspond one to one")
    _check(np.all(f.traj_end_node >= 0) and np.all(f.traj_end_node < N),
           "traj_end_node out of range")
    _check(np.array_equal(f.traj_length, f.node_position[f.traj_end_node]
                          + f.node_length[f.traj_end_node]),
           "traj_length is not the end node's end position")
    _check(np.array_equal(f.node_multiplicity,
                          derive.multiplicity(parent, f.node_position, f.traj_end_node)),
           "node_multiplicity is not the number of trajectories through the node")
    _check(N == 0 or f.node_multiplicity.min() >= 1, "a node lies on no trajectory's path")
    _verify_canonical(f, is_root, safe_parent)
    if f.laid_out:
        _verify_layout(f)
    else:
        for name in LAYOUT_FIELDS:
            _check(getattr(f, name) is None, f"{name} is set before layout")


def _verify_canonical(f, is_root, safe_parent) -> None:
    first_token = f.token_ids[f.node_start]
    # (parent, first token) pairs distinct among non-roots: distinct sibling first tokens.
    key = np.stack([safe_parent, first_token])[:, ~is_root]
    _check(np.unique(key, axis=1).shape[1] == key.shape[1],
           "two siblings start with the same token: not canonical")
    roots = np.flatnonzero(is_root)
    _check(np.unique(first_token[roots]).size == roots.size,
           "two trees start with the same token: not canonical")
    child_count = np.bincount(f.node_parent[~is_root], minlength=f.num_nodes)
    ends_here = np.bincount(f.traj_end_node, minlength=f.num_nodes)
    _check(np.all((child_count != 1) | (ends_here > 0)),
           "a node with a single child and no trajectory ending at it: not maximal")
    _check(np.all((child_count > 0) | (ends_here > 0)), "a leaf node where no trajectory ends")


def _verify_layout(f) -> None:
    N, T = f.num_nodes, f.num_tokens
    parent = f.node_parent
    _check(np.all(parent < np.arange(N)), "node order is not a preorder (parent after child)")
    cont = f.node_cont_child
    _check(cont is not None and cont.shape == (N,), "node_cont_child missing")
    has_cont = cont >= 0
    _check(np.all(parent[cont[has_cont]] == np.flatnonzero(has_cont)),
           "a continuation child is not a child of its node")
    child_count = np.bincount(parent[parent >= 0], minlength=N)
    _check(np.array_equal(has_cont, child_count > 0),
           "a node with children has no continuation child (or a leaf has one)")
    _check(np.all(cont[has_cont] == np.flatnonzero(has_cont) + 1),
           "the continuation child is not laid out right after its node (heavy path broken)")
    expected = derive.layout_tables(parent, f.node_tree, f.node_start, f.node_length,
                                    f.node_position, cont, f.traj_end_node, f.num_trees,
                                    with_token_tables=False)  # token tables checked above
    # Preorder + subtree sizes: a node's subtree is the node range [v, node_end[v]).
    node_end = derive.subtree_node_end(parent)
    _check(np.all(node_end[np.maximum(parent, 0)][parent >= 0] >= node_end[parent >= 0]),
           "a subtree is not nested in its parent's subtree")
    for name, value in expected.items():
        got = getattr(f, name)
        _check(got is not None and got.shape == value.shape and np.array_equal(got, value),
               f"{name} disagrees with its derivation from the node table")
    roots = np.flatnonzero(parent < 0)
    _check(np.all(np.diff(f.node_tree[roots]) == 1) if roots.size else True,
           "trees are not laid out in tree order")
    _check(T == 0 or int(f.tree_end[-1]) == T, "trees do not cover the compact tokens")
