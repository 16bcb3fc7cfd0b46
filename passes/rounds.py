"""Minimum rounds in linear time (docs/design.md section 6) and the sequences it implies.

Values per node v, when v's sequence started at v's own aligned boundary α_v (state A) or
earlier (state O); leaves have 0; β_v = floor(end(v)/C)*C is the boundary all children start at:

    f(v, A) = min over continuation child c* of
              max( f(c*, A if β_v == α_v else O),  [β_v != α_v] + max_{c != c*} f(c, A) )
    f(v, O) = min over c* of max( f(c*, O),  1 + max_{c != c*} f(c, A) )
    rounds(tree) = 1 + f(root, A)

`max_{c != c*} f(c, A)` comes from the top two of f(·, A), so each node costs O(children).
Ties between optimal continuation children go to the smallest subtree, then to the current
layout order (so a layout that is already optimal is kept). Rounds and replays do not depend on the
tie, but the scans' critical path does: a round lasts as long as its longest sequence, and a
continuation chain extends its parent's sequence, so continuing the smallest subtree and starting the
large ones as their own sequences in the next round shortens the rounds' summed longest sequences
(`bench/gdn_batch.py --chunks-only`, "scan ratio": 16-24% fewer chunk steps on generated swe, tau2 and
grpo batches).
"""
from __future__ import annotations

import numpy as np

NONE = -(1 << 60)  # max over no children


def optimal_continuations(node_parent: np.ndarray, node_position: np.ndarray,
                          node_length: np.ndarray, subtree_size: np.ndarray, chunk_size: int,
                          children: list[list[int]]):
    """Return (cont_child, f_A, f_O) per node, for any node numbering (nodes are visited by position, which
    puts every parent before its children: laid out or straight from prefix-compress).

    cont_child[v] is the optimal continuation child for the state v actually has when every
    node above chose optimally (the root starts in state A)."""
    n = node_parent.size
    C = chunk_size
    pos = node_position.tolist()
    end = (node_position + node_length).tolist()
    size = subtree_size.tolist()
    f_a, f_o = [0] * n, [0] * n
    best_a, best_o = [-1] * n, [-1] * n
    order = np.argsort(node_position, kind="stable").tolist()  # a child starts where its parent ends
    for v in reversed(order):  # children first
        kids = children[v]
        if not kids:
            continue
        alpha, beta = pos[v] // C * C, end[v] // C * C
        delta = int(beta != alpha)
        top1, top1_child, top2 = NONE, -1, NONE
        for c in kids:
            if f_a[c] > top1:
                top1, top1_child, top2 = f_a[c], c, top1
            elif f_a[c] > top2:
                top2 = f_a[c]
        cont_table = f_a if beta == alpha else f_o
        cost_a, cost_o = {}, {}
        for c in kids:
            others = top2 if c == top1_child else top1
            cost_a[c] = max(cont_table[c], delta + others)
            cost_o[c] = max(f_o[c], 1 + others)
        rank = {c: k for k, c in enumerate(kids)}
        best_a[v] = min(kids, key=lambda c: (cost_a[c], size[c], rank[c]))
        best_o[v] = min(kids, key=lambda c: (cost_o[c], size[c], rank[c]))
        f_a[v], f_o[v] = cost_a[best_a[v]], cost_o[best_o[v]]
    # Top-down: which state each node really has, hence which argmin applies.
    cont = np.full(n, -1, np.int64)
    aligned = [True] * n
    parents = node_parent.tolist()
    for v in order:
        p = parents[v]
        if p >= 0:
            if cont[p] == v:
                beta_p, alpha_p = end[p] // C * C, pos[p] // C * C
                aligned[v] = aligned[p] and beta_p == alpha_p
            else:
                aligned[v] = True
        if children[v]:
            cont[v] = best_a[v] if aligned[v] else best_o[v]
    return cont, np.asarray(f_a, np.int64), np.asarray(f_o, np.int64)
