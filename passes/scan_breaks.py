"""Sequence breaks: end a linear-attention sequence before its continuation child where that shortens the scans.

A tree's scans run round after round, and a round lasts as long as its longest sequence (in chunks), so a tree's
scan time is the sum over its rounds of their longest sequence. The min-rounds continuation children
(`rounds.py`) extend a node's sequence through one child's chain; when that sequence is the longest of its round,
the chain lengthens the round although the child could run beside its siblings one round later. A break at node
v ends v's sequence at v's end: the continuation child starts a sequence of its own at the chunk boundary before
that point (replaying the < C rows after it, like any other child), and its subtree's sequences run one round
later. The layout does not change (the child stays first in preorder); only the sequences do.

GRPO groups are the plain case: the prompt's sequence continued into one response makes the other responses wait
for a whole trajectory, whereas with a break the prompt runs alone and every response after it. Breaks cut the
scans' critical path by 10% on the generated swe batch, 12% on grpo and 26% on the six agentic trees of the GDN
benchmarks, for 0-1.1% more chunks (`bench/gdn_batch.py --chunks-only`, "scan ratio").
"""
from __future__ import annotations

import numpy as np

# the search's work per tree: at most this many evaluations of its sequences, and of node visits over them (an
# evaluation visits every node of the tree: ~3.5 us each in CPython), so a tree of thousands of nodes stays under
# a second; trees stop far earlier in practice (0.1 ms a tree on bench/compile_speed.py's batch)
MAX_EVALUATIONS = 256
MAX_NODE_VISITS = 300_000


def choose_breaks(node_parent: np.ndarray, node_position: np.ndarray, node_length: np.ndarray,
                  node_cont_child: np.ndarray, chunk_size: int) -> np.ndarray:
    """Per node of a laid-out forest (preorder: a tree's nodes run from its root to the next root): whether its
    continuation child starts a sequence of its own. Greedy per tree: among the breaks on the chains of each
    round's longest sequences, take the one that cuts the summed longest sequences most (then the chunks), as
    long as the tree keeps its number of rounds; repeat until none helps."""
    n = node_parent.size
    breaks = np.zeros(n, bool)
    parent, cont = node_parent.tolist(), node_cont_child.tolist()
    pos = node_position.tolist()
    end = (node_position + node_length).tolist()
    roots = np.flatnonzero(node_parent < 0).tolist()
    for root, next_root in zip(roots, roots[1:] + [n]):
        tree = _TreeScans(root, next_root, parent, cont, pos, end, chunk_size)
        for v in tree.search():
            breaks[v] = True
    return breaks


class _TreeScans:
    """One tree's sequences under a set of breaks, and the greedy search over them."""

    def __init__(self, lo, hi, parent, cont, pos, end, chunk_size):
        self.lo, self.hi, self.C = lo, hi, chunk_size
        self.parent, self.cont, self.pos, self.end = parent, cont, pos, end

    def evaluate(self, breaks: set) -> tuple:
        """(rounds, summed longest sequence per round, chunks, the chains of each round's longest sequence)."""
        C, parent, cont, pos, end = self.C, self.parent, self.cont, self.pos, self.end
        seq_of, sigma, rounds, last_end, chain = {}, [], [], [], []
        for v in range(self.lo, self.hi):  # preorder: a parent before its children
            p = parent[v]
            if p >= 0 and cont[p] == v and p not in breaks:
                s = seq_of[p]
                last_end[s] = end[v]
                chain[s].append(v)
            else:
                s = len(sigma)
                sigma.append(pos[v] // C * C)
                if p < 0:
                    rounds.append(0)
                else:
                    ps = seq_of[p]
                    # a branch in the parent sequence's first chunk starts from that sequence's own source
                    rounds.append(rounds[ps] if end[p] // C * C == sigma[ps] else rounds[ps] + 1)
                last_end.append(end[v])
                chain.append([v])
            seq_of[v] = s
        longest: dict[int, tuple[int, int]] = {}  # round -> (chunks, sequence)
        chunks = 0
        for s, (first, last, r) in enumerate(zip(sigma, last_end, rounds)):
            count = -(-(last - first) // C)
            chunks += count
            if count > longest.get(r, (-1, -1))[0]:
                longest[r] = (count, s)
        critical = sum(count for count, _ in longest.values())
        return len(longest), critical, chunks, [chain[s] for _, s in longest.values()]

    def search(self) -> set:
        breaks: set = set()
        rounds, critical, chunks, chains = self.evaluate(breaks)
        evaluations, limit = 1, max(2, min(MAX_EVALUATIONS, MAX_NODE_VISITS // (self.hi - self.lo)))
        while evaluations < limit:
            best = None
            for chain_nodes in chains:
                for v in chain_nodes[:-1]:  # a link v -> its continuation child on a longest sequence
                    if evaluations >= limit:
                        break
                    trial = self.evaluate(breaks | {v})
                    evaluations += 1
                    if trial[0] <= rounds and trial[1:3] < (critical, chunks) and (best is None
                                                                                  or trial[1:3] < best[1][1:3]):
                        best = (v, trial)
            if best is None:
                break
            breaks.add(best[0])
            _, critical, chunks, chains = best[1]
        return breaks
