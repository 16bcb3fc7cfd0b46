"""`cut-pieces`: run trees larger than the microbatch budget as pieces that carry their path's state."""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from harts_compiler.ir import Pieces, Program

from .base import Pass

INF = np.iinfo(np.int64).max // 4


@dataclass(frozen=True)
class CutPieces(Pass):
    """Sequenced program -> + pieces (no-op without a budget or when every tree fits).

    A tree with more than `microbatch_tokens` compact tokens is cut into pieces: contiguous ranges of its
    compact tokens in layout (DFS preorder) order, each at most the budget. Every token is computed once, in
    its piece. Why contiguous preorder ranges: the earlier path tokens of any token of a piece [a, b) are
    either in the piece or on the root path of token a, so a piece's *context* is one chain, the root path of
    its first token, and it only ever reads from pieces before it. Per layer it reads from them the context's
    attention K/V, the conv inputs of its first tokens' predecessors, the linear-attention state at the
    chunk-aligned point each of its sequences starts from and the < C replay rows before it; gradients of those
    flow back into the pieces that made them (codegen/pieces.py builds the tables, the runtime runs them).

    Cuts: the fewest pieces (ceil(tokens / budget)), and among those the cuts whose context is shortest
    (the sum over cuts of the first token's position: the attention K/V a piece reads, the largest carried
    tensor), with a tie-break against cuts inside a chunk (they need replay rows). Exact by dynamic
    programming over cut positions, one sliding-window minimum per cut.

    Output invariants: `Pieces.verify` (a split tree's pieces are two or more consecutive ranges covering it,
    each within the budget; each records the context keys and cut replay rows its first token implies). A note
    records the split trees, pieces, context tokens and replay rows at cuts.
    Complexity: O(T * pieces) vectorised numpy over the tokens of split trees.
    """

    name = "cut-pieces"
    microbatch_tokens: int | None = None  # None or 0 = no limit

    def run(self, program: Program) -> Program:
        forest, seqs = program.forest, program.sequences
        self.require(forest is not None and forest.laid_out and seqs is not None,
                     "a sequenced program (run replay-min)")
        budget = self.microbatch_tokens or 0
        sizes = forest.tree_end - forest.tree_start
        oversize = np.flatnonzero(sizes > budget) if budget else np.zeros(0, np.int64)
        if oversize.size == 0:
            return program.replace(pieces=None)
        trees, starts, ends = [], [], []
        for t in oversize.tolist():
            lo, hi = int(forest.tree_start[t]), int(forest.tree_end[t])
            position = forest.token_position[lo:hi]
            cuts = best_cuts(position, budget, seqs.chunk_size)
            bounds = np.concatenate([[0], cuts, [hi - lo]]) + lo
            trees += [t] * (bounds.size - 1)
            starts.append(bounds[:-1])
            ends.append(bounds[1:])
        piece_start = np.concatenate(starts).astype(np.int64)
        piece_context = forest.token_position[piece_start].astype(np.int64)  # the first token's root path
        pieces = Pieces(budget=budget, piece_tree=np.asarray(trees, np.int64), piece_start=piece_start,
                        piece_end=np.concatenate(ends).astype(np.int64), piece_context=piece_context,
                        piece_replay=piece_context % seqs.chunk_size)
        note = {"budget": budget, "split_trees": int(oversize.size), "pieces": pieces.num_pieces,
                "context_tokens": int(piece_context.sum()), "cut_replay_rows": int(pieces.piece_replay.sum()),
                "max_piece_tokens": int(pieces.piece_tokens.max())}
        return program.replace(pieces=pieces, notes=program.notes + ((self.name, json.dumps(note)),))


def _window_min(values: np.ndarray, width: int) -> np.ndarray:
    """out[x] = min(values[max(0, x - width):x]) for x in [0, n] (INF for the empty window at x = 0).
    Van Herk / Gil-Werman: block prefix and suffix minima, O(n) vectorised."""
    n = values.size
    padded = np.concatenate([np.full(width, INF, np.int64), values])
    blocks = -(-padded.size // width)
    grid = np.full(blocks * width, INF, np.int64)
    grid[:padded.size] = padded
    grid = grid.reshape(blocks, width)
    prefix = np.minimum.accumulate(grid, axis=1).ravel()
    suffix = np.minimum.accumulate(grid[:, ::-1], axis=1)[:, ::-1].ravel()
    # window of `width` entries of `padded` starting at x (= values[x - width:x]), for x in [0, n]
    first = np.arange(n + 1)
    return np.minimum(suffix[first], prefix[first + width - 1])


def best_cuts(position: np.ndarray, budget: int, chunk_size: int) -> np.ndarray:
    """Cut points 0 < c_1 < ... < c_{k-1} < T of one tree's tokens (local indices, `position` their RoPE
    positions): k = ceil(T / budget) pieces of at most `budget` tokens, minimising the sum of
    cost(c) = 2 * position[c] + [position[c] % chunk_size != 0] (the context a cut's piece reads, then
    whether it replays)."""
    T = position.size
    k = -(-T // budget)
    cost = 2 * position.astype(np.int64) + (position % chunk_size != 0)
    layers = [np.full(T + 1, INF, np.int64)]
    layers[0][0] = 0  # dp_j[x]: the cheapest j pieces covering [0, x) with a cut at x (x < T)
    for _ in range(k - 1):
        reach = _window_min(layers[-1][:T], budget)  # best previous cut y in [x - budget, x)
        step = np.full(T + 1, INF, np.int64)
        ok = reach[:T] < INF
        step[:T][ok] = reach[:T][ok] + cost[ok]
        step[0] = INF
        layers.append(step)
    cuts, x = [], T
    for j in range(k - 1, 0, -1):  # back from the end: the best feasible previous cut of each layer
        lo = max(x - budget, 1)
        window = layers[j][lo:x]
        y = lo + int(np.argmin(window))
        if window.min() >= INF:
            raise AssertionError("cut-pieces: no feasible cut (compiler bug)")
        cuts.append(y)
        x = y
    return np.asarray(cuts[::-1], np.int64)
