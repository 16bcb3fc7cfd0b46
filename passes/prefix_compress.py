"""`prefix-compress`: merge all trajectories of the batch into the canonical prefix forest."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts_compiler.ir import Forest, Program, Trajectories
from harts_compiler.ir import derive

from .base import Pass


@dataclass(frozen=True)
class PrefixCompress(Pass):
    """Trajectories -> canonical prefix forest (a trie, not yet laid out).

    Across groups: trajectories of different input records that share a first token end up in
    one tree (a system prompt shared by many tasks is stored once). Canonical: a node is a
    maximal run of tokens shared by one set of trajectories, so sibling first tokens are distinct,
    a trajectory may end at an inner node, identical trajectories end at the same node.

    Algorithm: sort the trajectories lexicographically (memcmp on big-endian bytes), take the
    longest common prefix of neighbours with numpy, and build the compact trie with one stack
    sweep over the sorted trajectories (like a suffix tree from a suffix array + LCP).
    Complexity: O(L) vectorised work for L trajectory tokens, O(n log n) comparisons and an
    O(n) Python sweep for n trajectories; nodes <= 2n.

    Output invariants: `Forest.verify()` of the compressed stage (laid_out=False); nodes numbered
    in creation order, tokens stored back to back in node order; the input trajectories are
    dropped from the Program.
    """

    name = "prefix-compress"

    def run(self, program: Program) -> Program:
        self.require(program.trajectories is not None and program.forest is None,
                     "input trajectories (and no forest yet)")
        forest = compress(program.trajectories)
        return program.replace(trajectories=None, forest=forest)


def lexicographic_order(tokens: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Trajectory indices sorted lexicographically (a prefix sorts before its extensions)."""
    width = ">u4" if tokens.size == 0 or int(tokens.max()) < 2**32 else ">u8"
    big_endian = tokens.astype(width)  # byte order = numeric order under memcmp
    keys = [big_endian[a:b].tobytes() for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
    return np.asarray(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)


def neighbour_lcp(tokens: np.ndarray, offsets: np.ndarray, order: np.ndarray) -> np.ndarray:
    """lcp[k] = longest common prefix of trajectories order[k-1] and order[k] (lcp[0] = 0)."""
    lcp = np.zeros(order.size, np.int64)
    starts, ends = offsets[:-1], offsets[1:]
    for k in range(1, order.size):
        a, b = order[k - 1], order[k]
        m = int(min(ends[a] - starts[a], ends[b] - starts[b]))
        differ = tokens[starts[a]:starts[a] + m] != tokens[starts[b]:starts[b] + m]
        first = int(np.argmax(differ))
        lcp[k] = first if differ[first] else m
    return lcp


def compress(batch: Trajectories) -> Forest:
    tokens, offsets = batch.tokens, batch.offsets
    n = len(batch.ids)
    lengths = np.diff(offsets)
    order = lexicographic_order(tokens, offsets)
    lcp = neighbour_lcp(tokens, offsets, order)

    # Stack sweep. The stack is the node path of the previous trajectory; a node is
    # (representative trajectory, depth range [lo, hi), parent). Splitting node x at depth l
    # creates the *upper* part as a new node, so x's children and trajectory ends stay valid.
    rep, lo, hi, parent = [], [], [], []
    traj_end = [0] * n
    stack: list[int] = []
    lengths_list = lengths.tolist()
    for j, shared in zip(order.tolist(), lcp.tolist()):
        while stack and lo[stack[-1]] >= shared:
            stack.pop()
        if stack and hi[stack[-1]] > shared:
            x = stack[-1]
            rep.append(rep[x]); lo.append(lo[x]); hi.append(shared); parent.append(parent[x])
            lo[x] = shared
            parent[x] = len(rep) - 1
            stack[-1] = len(rep) - 1
        top = stack[-1] if stack else -1
        if lengths_list[j] > shared:
            rep.append(j); lo.append(shared); hi.append(lengths_list[j]); parent.append(top)
            stack.append(len(rep) - 1)
            traj_end[j] = len(rep) - 1
        else:  # identical to (a prefix of) the previous trajectory: ends where the path ends
            traj_end[j] = top

    node_parent = np.asarray(parent, np.int64)
    node_position = np.asarray(lo, np.int64)
    node_length = np.asarray(hi, np.int64) - node_position
    node_start = derive.exclusive_cumsum(node_length)
    source = offsets[np.asarray(rep, np.int64)] + node_position  # first token in the input
    token_ids = tokens[derive.concat_ranges(source, node_length)]
    traj_end_node = np.asarray(traj_end, np.int64)
    node_tree, tree_ids = _number_trees(node_parent, node_position, traj_end_node, batch.groups)
    token_node, token_position = derive.token_node_and_position(node_start, node_length,
                                                                node_position)
    return Forest(
        token_ids=token_ids, token_node=token_node, token_position=token_position,
        node_parent=node_parent, node_tree=node_tree, node_start=node_start,
        node_length=node_length, node_position=node_position,
        node_multiplicity=derive.multiplicity(node_parent, node_position, traj_end_node),
        tree_ids=tree_ids, traj_ids=list(batch.ids), traj_end_node=traj_end_node,
        traj_length=lengths.astype(np.int64), laid_out=False)


def _number_trees(node_parent, node_position, traj_end_node, groups):
    """Tree index per node, trees ordered by their first trajectory in input order; a tree is
    named after that trajectory's input record (made unique with '#k' when a record's
    trajectories fall into several trees)."""
    root = np.arange(node_parent.size, dtype=np.int64)
    parents = node_parent.tolist()
    root_list = root.tolist()
    for v in np.argsort(node_position, kind="stable").tolist():  # parents before children
        if parents[v] >= 0:
            root_list[v] = root_list[parents[v]]
    root = np.asarray(root_list, np.int64)
    end_roots = root[traj_end_node]
    roots_in_order, first_traj = np.unique(end_roots, return_index=True)
    by_first = np.argsort(first_traj, kind="stable")
    tree_of_root = np.full(node_parent.size, -1, np.int64)
    tree_of_root[roots_in_order[by_first]] = np.arange(roots_in_order.size)
    names, used = [], {}
    for j in first_traj[by_first].tolist():
        base = groups[j]
        count = used.get(base, 0)
        used[base] = count + 1
        names.append(base if count == 0 else f"{base}#{count}")
    # A '#k' suffix might collide with a real record name; fall back to an index suffix then.
    if len(set(names)) != len(names):
        names = [f"{name}@{t}" for t, name in enumerate(names)]
    return tree_of_root[root], names
