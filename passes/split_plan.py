"""Where to cut one oversize tree (`split-oversize`): a bottom-up greedy over its nodes.

Problem. Group the tree's trajectories into parts; a part holds the prefix tree of its
trajectories (the union of their root paths), and must have at most B compact tokens. Minimise the
total tokens of the parts, i.e. the *recomputed* tokens (nodes held by several parts). A part
that holds subtrees hanging below node u pays u's root path, D(u) = end position of u, once,
however many sibling subtrees of u (or subtrees of u's ancestors) it holds. The problem contains
bin packing (one root of length D with many leaf children: minimise parts x D), so it is NP-hard;
this is a heuristic with the guarantees below.

Greedy, children before parents (reverse preorder). Every node v keeps a *residual* r(v): the
tokens of v's subtree not yet placed in a part (v itself plus its unplaced children's residuals;
0 when no trajectory ends in what is left, so v is held only as other parts' context). Whatever
part finally holds v also holds v's root path, so v's residual must satisfy D(v) + sum r(kept
children) <= B; at v, with the children sorted by residual, largest first:

1. *free placements*: a child's residual goes into an existing part below v (built under another
   child of v) when it has room: that part already holds v's root path, so this costs nothing;
2. if v's residual still does not fit, open the fewest new parts at v (context D(v), room
   B - D(v)) into which first-fit decreasing moves at least the excess; given that count, FFD
   moves every child that fits (free as well), which shrinks the residuals the ancestors see.

Guarantees: every part fits (a child's residual fits beside D(v) because it fitted beside its own
path; a trajectory alone is at most B, checked before); a node is cut only when its residual
cannot fit anywhere (cuts are *forced*, as in Kundu-Misra's minimum-component tree partition,
which this reduces to when contexts cost nothing and no part shares); per node, the number of new
parts is FFD's, at most 11/9 OPT + 6/9 of the bin-packing optimum for those children. Not
optimal in general: an extra part at a deep node can save several parts higher up, and a child
is not merged into a part built in its own subtree. Measured against brute force over all
trajectory partitions (tests/test_split.py): optimal on 99% of 300 random trees with <= 8 end
nodes and budgets in the lower half, at worst 6% more total tokens; optimal on 600 smaller ones.
Complexity: O(sum over nodes of children x parts built below the node) Python, typically
O(N log N).
"""
from __future__ import annotations

import numpy as np


def plan_tree_split(root: int, root_end: int, node_parent: np.ndarray, node_length: np.ndarray,
                    node_position: np.ndarray, ends: np.ndarray, children: list[list[int]],
                    node_end: np.ndarray, budget: int) -> np.ndarray:
    """Part label of every node of the tree whose preorder node range is [root, root_end):
    `owner[v - root]` = 0 for the top part (the root's residual), k >= 1 for the k-th part opened,
    -1 for a node no part owns (it is only another part's context; no trajectory ends there).
    `ends[v]`: trajectories ending at v; `node_end`: preorder subtree ends."""
    n = root_end - root
    B = int(budget)
    depth = (node_position[root:root_end] + node_length[root:root_end]).tolist()  # D(v)
    length = node_length[root:root_end].tolist()
    end = (node_end[root:root_end] - root).tolist()
    ends_at = ends[root:root_end].tolist()
    residual = [0] * n
    part_of = [-1] * n          # part holding the residual of a cut child (its component root)
    part_size: list[int] = []   # tokens of every opened part
    parts_after = [0] * (n + 1)  # parts opened once node v was done (reverse preorder)

    def parts_below(v: int) -> tuple[int, int]:
        """Index range of the parts opened inside v's subtree (a contiguous range)."""
        return (parts_after[end[v]] if end[v] < n else 0), parts_after[v]

    for v in range(n - 1, -1, -1):
        kids = sorted((c - root for c in children[v + root] if residual[c - root] > 0),
                      key=lambda c: (-residual[c], c))
        start = parts_below(v)[0] if kids else len(part_size)
        kept = []
        for c in kids:  # 1. free placements into parts under v's other children
            lo, hi = parts_below(c)
            target = next((p for p in [*range(start, lo), *range(hi, len(part_size))]
                           if part_size[p] + residual[c] <= B), -1)
            if target >= 0:
                part_size[target] += residual[c]
                part_of[c] = target
            else:
                kept.append(c)
        excess = depth[v] + sum(residual[c] for c in kept) - B
        if excess > 0:  # 2. the fewest new parts at v that FFD can make it fit with
            room = B - depth[v]
            count = -(-excess // room)
            while True:
                loads, placed = _first_fit(kept, residual, room, count)
                if sum(loads) >= excess:
                    break
                count += 1
            first_new = len(part_size)
            part_size += [depth[v] + load for load in loads if load > 0]
            new_index = np.cumsum([load > 0 for load in loads]) - 1 + first_new
            for c, b in placed.items():
                part_of[c] = int(new_index[b])
            kept = [c for c in kept if c not in placed]
        if kept or ends_at[v] > 0:
            residual[v] = length[v] + sum(residual[c] for c in kept)
        parts_after[v] = len(part_size)
    return _owners(part_of, residual, node_parent[root:root_end] - root)


def _first_fit(items: list[int], size: list[int], room: int, count: int):
    """First fit of `items` (already largest first) into `count` bins of `room`: (loads,
    {item: bin}); items that fit nowhere stay out."""
    loads = [0] * count
    placed = {}
    for c in items:
        for b in range(count):
            if loads[b] + size[c] <= room:
                loads[b] += size[c]
                placed[c] = b
                break
    return loads, placed


def _owners(part_of: list[int], residual: list[int], parent: np.ndarray) -> np.ndarray:
    """Top-down: a cut child starts its part's component, other nodes join their parent's."""
    owner = np.full(len(part_of), -1, np.int64)
    parent = parent.tolist()
    for v in range(len(part_of)):  # preorder: parents first
        if residual[v] == 0:
            continue
        if part_of[v] >= 0:
            owner[v] = part_of[v] + 1
        elif v > 0:
            owner[v] = owner[parent[v]]
        else:
            owner[v] = 0
    return owner
