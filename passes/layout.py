"""`layout`: DFS preorder with the continuation child first, plus every per-token table."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts_compiler.ir import Forest, Program
from harts_compiler.ir import derive

from .base import Pass
from .rounds import optimal_continuations


@dataclass(frozen=True)
class Layout(Pass):
    """Compressed (or laid-out) forest -> laid-out forest.

    Nodes are renumbered in DFS preorder, trees in tree order, a node's continuation child first,
    then its other children by their first trajectory in input order. The continuation child is
    kept when the forest already has one, otherwise it is the one the min-rounds DP picks at
    `chunk_size` (passes/rounds.py), so `replay-min` at the same chunk size finds this layout optimal
    and keeps it (at another chunk size it lays out again with the same function, `lay_out`).

    Output invariants (`Forest.verify()`, laid-out stage): node order = compact order = preorder;
    every subtree is the compact range [node_start, node_subtree_end); every heavy path (a node
    and its chain of continuation children) is one contiguous compact range; token_pred (which
    fixes the conv predecessor table `Forest.conv_pred()` and the distinct (source, next token)
    log-prob targets `Forest.targets()`, P = T - trees), multiplicities and the run-length
    trajectory gather map agree with their derivation.
    Complexity: O(T) vectorised numpy, O(N log N + runs) Python over nodes (the DP: O(N)).
    """

    name = "layout"
    conv_width: int = 4
    chunk_size: int = 64

    def run(self, program: Program) -> Program:
        forest = program.forest
        self.require(forest is not None, "a forest (run prefix-compress first)")
        self.require(program.sequences is None, "no sequences yet (layout renumbers nodes)")
        self.require(self.chunk_size >= 1, "chunk_size >= 1")
        cont = forest.node_cont_child
        if cont is None:
            cont = optimal_continuations(forest.node_parent, forest.node_position, forest.node_length,
                                         subtree_tokens(forest), self.chunk_size, forest.children())[0]
        return program.replace(forest=lay_out(forest, self.conv_width, cont))


def subtree_tokens(forest: Forest) -> np.ndarray:
    return derive.accumulate_up(forest.node_length.copy(), forest.node_parent,
                                derive.bottom_up_order(forest.node_position))


def first_trajectory(forest: Forest) -> np.ndarray:
    """Smallest input index of a trajectory ending in each node's subtree."""
    first = np.full(forest.num_nodes, np.iinfo(np.int64).max, np.int64)
    np.minimum.at(first, forest.traj_end_node, np.arange(forest.num_trajectories))
    return derive.accumulate_up(first, forest.node_parent,
                                derive.bottom_up_order(forest.node_position), combine=min)


def lay_out(forest: Forest, conv_width: int, cont_child: np.ndarray) -> Forest:
    """Lay the forest out with continuation children `cont_child` (over the forest's current node ids,
    -1 for a leaf). Returns a new, laid-out Forest."""
    children = forest.children()
    first = first_trajectory(forest).tolist()
    cont = cont_child.tolist()
    roots = sorted(np.flatnonzero(forest.node_parent < 0).tolist(),
                   key=lambda r: int(forest.node_tree[r]))
    order: list[int] = []
    stack = roots[::-1]
    while stack:
        v = stack.pop()
        order.append(v)
        kids = children[v]
        if kids:
            rest = sorted((c for c in kids if c != cont[v]), key=first.__getitem__)
            stack.extend(rest[::-1])
            stack.append(cont[v])
    old = np.asarray(order, np.int64)
    new_of_old = np.empty(forest.num_nodes, np.int64)
    new_of_old[old] = np.arange(old.size)

    def renumber(ids: np.ndarray) -> np.ndarray:
        return np.where(ids >= 0, new_of_old[np.maximum(ids, 0)], -1)

    node_parent = renumber(forest.node_parent[old])
    node_tree = forest.node_tree[old]
    node_length = forest.node_length[old]
    node_position = forest.node_position[old]
    node_start = derive.exclusive_cumsum(node_length)
    node_cont = renumber(cont_child[old])
    token_ids = forest.token_ids[derive.concat_ranges(forest.node_start[old], node_length)]
    traj_end_node = new_of_old[forest.traj_end_node]
    tables = derive.layout_tables(node_parent, node_tree, node_start, node_length, node_position,
                                  node_cont, traj_end_node, forest.num_trees)
    return Forest(token_ids=token_ids, node_parent=node_parent, node_tree=node_tree,
                  node_start=node_start, node_length=node_length, node_position=node_position,
                  tree_ids=list(forest.tree_ids), traj_ids=list(forest.traj_ids),
                  traj_end_node=traj_end_node, traj_length=forest.traj_length.copy(),
                  laid_out=True, conv_width=conv_width, node_cont_child=node_cont,
                  **tables)
