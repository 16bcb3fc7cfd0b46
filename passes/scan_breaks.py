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

from .rounds import walk_sequences

# the search's work per tree: at most this many evaluations of its sequences, and of node visits over them (an
# evaluation visits every node of the tree twice: ~0.4 us a node in CPython), so no tree takes more than ~0.15 s;
# trees stop far earlier in practice (0.2 ms a tree on bench/compile_speed.py's batch, 43 ms for a 3,669-node tree)
MAX_EVALUATIONS = 256
MAX_NODE_VISITS = 300_000


def choose_breaks(node_parent: np.ndarray, node_position: np.ndarray, node_length: np.ndarray,
                  node_cont_child: np.ndarray, chunk_size: int) -> set:
    """The nodes of a laid-out forest (preorder: a tree's nodes run from its root to the next root) whose
    continuation child starts a sequence of its own. Greedy per tree: among the breaks on the chains of each
    round's longest sequence, take the one that cuts the summed longest sequences most (then the chunks), as long
    as the tree keeps its number of rounds; repeat until none helps."""
    n = node_parent.size
    links = (node_parent.tolist(), node_cont_child.tolist(), node_position.tolist(),
             (node_position + node_length).tolist())
    roots = np.flatnonzero(node_parent < 0).tolist()
    breaks: set = set()
    for root, next_root in zip(roots, roots[1:] + [n]):
        breaks |= _TreeScans(root, next_root, *links, chunk_size).search()
    return breaks


class _TreeScans:
    """One tree's sequences under a set of breaks, and the greedy search over them."""

    def __init__(self, lo, hi, parent, cont, pos, end, chunk_size):
        self.lo, self.hi, self.C = lo, hi, chunk_size
        self.parent, self.cont, self.pos, self.end = parent, cont, pos, end

    def evaluate(self, breaks: set) -> tuple:
        """(rounds, summed longest sequence per round, chunks, the chains of each round's longest sequence)."""
        seq_of, heads, sigma, rounds, _, _ = walk_sequences(self.lo, self.hi, self.parent, self.cont, breaks,
                                                            self.pos, self.end, self.C)
        last_end, chains = list(sigma), [[] for _ in heads]
        for v in range(self.lo, self.hi):  # a chain's nodes in preorder, each ending after the one before
            s = seq_of[v - self.lo]
            chains[s].append(v)
            last_end[s] = self.end[v]
        longest: dict[int, tuple[int, int]] = {}  # round -> (chunks, sequence)
        chunks = 0
        for s, (first, last, r) in enumerate(zip(sigma, last_end, rounds)):
            count = -(-(last - first) // self.C)
            chunks += count
            if count > longest.get(r, (-1, -1))[0]:
                longest[r] = (count, s)
        critical = sum(count for count, _ in longest.values())
        return len(longest), critical, chunks, [chains[s] for _, s in longest.values()]

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
