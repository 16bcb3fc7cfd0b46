"""`replay-min`: choose continuation children for the minimum number of rounds; record sequences."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts_compiler.ir import Forest, Program, Sequences

from .base import Pass, PassError
from .layout import lay_out, subtree_tokens
from .rounds import optimal_continuations


@dataclass(frozen=True)
class ReplayMin(Pass):
    """Laid-out forest -> same forest (re-laid out if the continuation choice changes) + sequences.

    Continuation children come from the linear-time min-rounds DP (passes/rounds.py); when they
    differ from the layout's, the forest is laid out again with them (same `lay_out` code), so
    the layout invariant — every heavy path is one contiguous compact range — still holds.
    Then one top-down sweep records every sequence (docs/INTERFACES.md section 2): a sequence is
    a root or non-continuation child plus its chain of continuation children; it starts at
    σ = floor(pos/C)*C, replays the < C ancestor tokens at positions [σ, pos), and takes its
    initial state from its parent's sequence at local offset β_parent - σ_parent (one round
    later), or, when the branch lies in the parent sequence's first chunk (β_parent = σ_parent),
    from the parent's own source in the parent's round.

    Output invariants: `Sequences.verify` (own ranges partition the tokens, replay rows are the
    path ancestors, every state source ran in an earlier round, exports = offsets others start
    from), and tree_rounds == 1 + f(root, A) of the DP.
    Complexity: O(N) DP, O(T) vectorised re-layout when needed, O(S * C) vectorised replay.
    """

    name = "replay-min"
    chunk_size: int = 64

    def run(self, program: Program) -> Program:
        forest = program.forest
        self.require(forest is not None and forest.laid_out, "a laid-out forest (run layout)")
        self.require(self.chunk_size >= 1, "chunk_size >= 1")
        children = forest.children()
        cont, f_a, _ = optimal_continuations(forest.node_parent, forest.node_position,
                                             forest.node_length, subtree_tokens(forest),
                                             self.chunk_size, children)
        if not np.array_equal(cont, forest.node_cont_child):
            forest = lay_out(forest, forest.conv_width, cont)
        sequences = record_sequences(forest, self.chunk_size)
        roots = np.flatnonzero(forest.node_parent < 0)
        optimum = np.zeros(forest.num_trees, np.int64)
        optimum[forest.node_tree[roots]] = 1 + f_a[_old_roots(program.forest)]
        if not np.array_equal(sequences.tree_rounds, optimum):
            raise PassError(f"pass {self.name}: recorded rounds {sequences.tree_rounds.tolist()} "
                            f"differ from the DP optimum {optimum.tolist()} (compiler bug)")
        return program.replace(forest=forest, sequences=sequences)


def _old_roots(forest: Forest) -> np.ndarray:
    """Roots of the forest the DP ran on, in tree order (re-layout keeps tree numbers)."""
    roots = np.flatnonzero(forest.node_parent < 0)
    return roots[np.argsort(forest.node_tree[roots])]


def record_sequences(forest: Forest, chunk_size: int) -> Sequences:
    """Sequences of a laid-out forest under its continuation children (top-down sweep)."""
    C = chunk_size
    parents = forest.node_parent.tolist()
    cont = forest.node_cont_child.tolist()
    pos = forest.node_position.tolist()
    end = (forest.node_position + forest.node_length).tolist()
    seq_of = [0] * forest.num_nodes
    sigma, rounds, init_seq, init_off, heads = [], [], [], [], []
    for v in range(forest.num_nodes):  # preorder: parents first, heads in compact order
        p = parents[v]
        if p >= 0 and cont[p] == v:
            seq_of[v] = seq_of[p]
            continue
        s = len(heads)
        seq_of[v] = s
        heads.append(v)
        sigma.append(pos[v] // C * C)
        if p < 0:
            rounds.append(0); init_seq.append(-1); init_off.append(0)
            continue
        ps = seq_of[p]
        boundary = end[p] // C * C  # == sigma[s]
        if boundary == sigma[ps]:  # branch in the parent sequence's first chunk
            rounds.append(rounds[ps]); init_seq.append(init_seq[ps]); init_off.append(init_off[ps])
        else:
            rounds.append(rounds[ps] + 1); init_seq.append(ps); init_off.append(boundary - sigma[ps])
    S = len(heads)
    head = np.asarray(heads, np.int64)
    own_start = forest.node_start[head]
    own_end = np.zeros(S, np.int64)
    np.maximum.at(own_end, np.asarray(seq_of, np.int64), forest.node_start + forest.node_length)
    sigma_arr = np.asarray(sigma, np.int64)
    replay_ptr, replay = _replay_rows(forest.token_pred, own_start,
                                      forest.node_position[head] - sigma_arr)
    init_seq_arr, init_off_arr = np.asarray(init_seq, np.int64), np.asarray(init_off, np.int64)
    export_ptr, export_offset = _exports(S, init_seq_arr, init_off_arr)
    seq_tree = forest.node_tree[head]
    round_arr = np.asarray(rounds, np.int64)
    tree_rounds = np.zeros(forest.num_trees, np.int64)
    np.maximum.at(tree_rounds, seq_tree, round_arr + 1)
    return Sequences(chunk_size=C, seq_tree=seq_tree, seq_round=round_arr,
                     seq_start_position=sigma_arr, seq_own_start=own_start, seq_own_end=own_end,
                     seq_init_seq=init_seq_arr, seq_init_offset=init_off_arr,
                     replay_ptr=replay_ptr, replay=replay, export_ptr=export_ptr,
                     export_offset=export_offset, tree_rounds=tree_rounds)


def _replay_rows(token_pred: np.ndarray, own_start: np.ndarray, count: np.ndarray):
    """Replay rows of every sequence: the `count[s]` path predecessors of own_start[s], oldest
    first, as one CSR array. Vectorised over sequences, one step per position (count < C)."""
    ptr = np.zeros(own_start.size + 1, np.int64)
    np.cumsum(count, out=ptr[1:])
    replay = np.empty(int(ptr[-1]), np.int64)
    current = own_start.copy()
    for step in range(1, int(count.max(initial=0)) + 1):
        current = token_pred[np.maximum(current, 0)]
        active = count >= step
        replay[ptr[1:][active] - step] = current[active]
    return ptr, replay


def _exports(S: int, init_seq: np.ndarray, init_off: np.ndarray):
    """Sorted unique export offsets per source sequence, CSR."""
    used = init_seq >= 0
    pairs = np.unique(np.stack([init_seq[used], init_off[used]]), axis=1) if used.any() else \
        np.zeros((2, 0), np.int64)
    ptr = np.zeros(S + 1, np.int64)
    np.cumsum(np.bincount(pairs[0], minlength=S), out=ptr[1:])
    return ptr, pairs[1].astype(np.int64)
