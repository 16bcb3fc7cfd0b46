"""Tables that follow from a forest's node table; shared by the passes and the `.hir` parser.

Everything here is a pure function of (node table, token ids, trajectory ends): the text form
stores only those, and the parser rebuilds the rest with the same code the passes use.
Complexity: O(T) vectorised numpy for per-token tables, O(N + runs) Python for node loops.
"""
from __future__ import annotations

import numpy as np

# The Forest fields `layout` sets (None before it): the tables below derive all but node_cont_child.
LAYOUT_FIELDS = ("node_subtree_end", "node_cont_child", "token_pred", "traj_run_ptr",
                 "run_start", "run_length", "tree_start", "tree_end")


def exclusive_cumsum(values: np.ndarray) -> np.ndarray:
    out = np.zeros(values.size, np.int64)
    if values.size > 1:
        np.cumsum(values[:-1], out=out[1:])
    return out


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for every (s, n), vectorised: the gather map of
    segments stored elsewhere (node tokens, trajectory runs, packed rows)."""
    total = int(lengths.sum())
    return (np.repeat(np.asarray(starts, np.int64) - exclusive_cumsum(lengths), lengths)
            + np.arange(total, dtype=np.int64))


def token_node_and_position(node_start, node_length, node_position):
    """Per-token node and position, for nodes stored back to back in node order."""
    total = int(node_length.sum())
    token_node = np.repeat(np.arange(node_length.size, dtype=np.int64), node_length)
    # position = compact index - node start + node position, one repeat instead of two gathers
    token_position = np.repeat(node_position - node_start, node_length)
    token_position += np.arange(total, dtype=np.int64)
    return token_node, token_position


def bottom_up_order(node_position: np.ndarray) -> np.ndarray:
    """Node order with every child before its parent (children sit at larger positions)."""
    return np.argsort(-node_position, kind="stable")


def accumulate_up(values: np.ndarray, node_parent: np.ndarray, order: np.ndarray,
                  combine=np.add) -> np.ndarray:
    """values[v] combined over v's subtree; `order` lists children before parents."""
    out = values.copy()
    parents = node_parent.tolist()
    acc = out.tolist()
    for v in order.tolist():
        p = parents[v]
        if p >= 0:
            acc[p] = combine(acc[p], acc[v])
    return np.asarray(acc, dtype=values.dtype)


def multiplicity(node_parent, node_position, traj_end_node) -> np.ndarray:
    ends = np.bincount(traj_end_node, minlength=node_parent.size).astype(np.int64)
    return accumulate_up(ends, node_parent, bottom_up_order(node_position))


def token_predecessor(node_parent, node_start, node_length) -> np.ndarray:
    """Path predecessor of every compact token: i-1 inside a node, the parent's last token at a
    node's first token, -1 at a root's first token."""
    total = int(node_length.sum())
    pred = np.arange(-1, total - 1, dtype=np.int64)
    parent_last = np.where(node_parent >= 0,
                           node_start[node_parent] + node_length[node_parent] - 1, -1)
    pred[node_start] = parent_last
    return pred


def conv_predecessors(token_pred: np.ndarray, node_start: np.ndarray,
                      node_length: np.ndarray, conv_width: int) -> np.ndarray:
    """[T, W-1]: conv_pred[i, j] = token at position pos(i)-(W-1)+j on i's path (-1 before 0).

    Inside a node the path is the compact order, so conv_pred[i, j] = i-(W-1)+j; only the first
    W-1 tokens of each node need a walk along predecessors (O(T) fill + O(N W^2) walk)."""
    cols = max(conv_width - 1, 0)
    total = token_pred.size
    table = np.arange(total, dtype=np.int64)[:, None] + np.arange(-cols, 0, dtype=np.int64)
    if cols == 0 or total == 0:
        return table.reshape(total, cols)
    offsets = np.arange(cols, dtype=np.int64)
    near = (node_start[:, None] + offsets)[offsets[None, :] < node_length[:, None]]
    current = token_pred[near]
    for j in range(cols - 1, -1, -1):
        table[near, j] = current
        current = np.where(current >= 0, token_pred[np.maximum(current, 0)], -1)
    return table


def log_prob_targets(token_pred: np.ndarray, token_ids: np.ndarray):
    """Distinct (source, next token) pairs: one per compact token that has a predecessor (every
    token except a tree's first one is predicted by exactly its path predecessor; in a canonical
    forest the pairs are distinct). Returns target_src, target_token, token_target."""
    has_pred = token_pred >= 0
    token_target = np.full(token_pred.size, -1, np.int64)
    token_target[has_pred] = np.arange(int(has_pred.sum()), dtype=np.int64)
    return token_pred[has_pred], token_ids[has_pred], token_target


def subtree_node_end(node_parent: np.ndarray) -> np.ndarray:
    """For nodes in preorder: exclusive end of each node's subtree in node order."""
    n = node_parent.size
    size = [1] * n
    parents = node_parent.tolist()
    for v in range(n - 1, -1, -1):
        p = parents[v]
        if p >= 0:
            size[p] += size[v]
    return np.arange(n, dtype=np.int64) + np.asarray(size, np.int64)


def trajectory_runs(node_parent, node_start, node_length, node_cont_child, traj_end_node):
    """Run-length gather map: trajectory j's compact indices are the ranges
    [run_start[r], run_start[r] + run_length[r]) for r in traj_run_ptr[j]:traj_run_ptr[j+1].
    One run per heavy-path segment (a chain of continuation children is one compact range)."""
    parents = node_parent.tolist()
    cont = node_cont_child.tolist()
    head = list(range(len(parents)))
    for v in range(len(parents)):  # preorder: parents first
        p = parents[v]
        if p >= 0 and cont[p] == v:
            head[v] = head[p]
    starts = node_start.tolist()
    ends = (node_start + node_length).tolist()
    ptr = [0]
    run_start, run_length = [], []
    for v in traj_end_node.tolist():
        segment = []
        while v >= 0:
            h = head[v]
            segment.append((starts[h], ends[v] - starts[h]))
            v = parents[h]
        for s, n in reversed(segment):
            run_start.append(s)
            run_length.append(n)
        ptr.append(len(run_start))
    return (np.asarray(ptr, np.int64), np.asarray(run_start, np.int64),
            np.asarray(run_length, np.int64))


def layout_tables(node_parent, node_tree, node_start, node_length, node_position,
                  node_cont_child, traj_end_node, num_trees, with_token_tables=True) -> dict:
    """All stored Forest fields that follow from a laid-out (preorder) node table.

    The conv predecessor table and the log-prob target table are not stored batch-wide (they are
    3 and 3 more int64 arrays of T rows): `Forest.conv_pred()` / `Forest.targets()` derive them
    from token_pred on demand, and codegen builds them per microbatch."""
    node_end = subtree_node_end(node_parent)
    bounds = np.append(node_start, int(node_length.sum()))
    subtree_end = bounds[node_end]
    token_pred = token_predecessor(node_parent, node_start, node_length)
    ptr, run_start, run_length = trajectory_runs(node_parent, node_start, node_length,
                                                 node_cont_child, traj_end_node)
    roots = np.flatnonzero(node_parent < 0)
    tree_start = np.zeros(num_trees, np.int64)
    tree_end = np.zeros(num_trees, np.int64)
    tree_start[node_tree[roots]] = node_start[roots]
    tree_end[node_tree[roots]] = subtree_end[roots]
    tables = dict(
        node_subtree_end=subtree_end,
        node_multiplicity=multiplicity(node_parent, node_position, traj_end_node),
        token_pred=token_pred,
        traj_run_ptr=ptr, run_start=run_start, run_length=run_length,
        tree_start=tree_start, tree_end=tree_end)
    if with_token_tables:
        tables["token_node"], tables["token_position"] = token_node_and_position(
            node_start, node_length, node_position)
    return tables
