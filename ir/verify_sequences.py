"""`verify_sequences`: invariants of replay-min's sequences against a laid-out forest.

- own ranges partition [0, T); each starts at a sequence head (a root or a non-continuation
  child) and is one contiguous path segment (every token's predecessor is the previous one);
- start_position is floor(pos(own_start)/C)*C and the replay rows are exactly the path tokens at
  positions [start_position, pos(own_start)), fewer than C;
- the zero state is used iff start_position == 0; otherwise the source sequence lies in the same
  tree, ran in an earlier round, exports at a positive multiple of C no larger than its row count,
  its row before that offset is this sequence's path token at position start_position - 1;
- each sequence's exports are exactly the offsets other sequences start from;
- tree_rounds = 1 + the largest round in the tree.
Complexity O(T + S log S), vectorised except for the exports check (O(S)).
"""
from __future__ import annotations

import numpy as np

from .errors import IRError


def _check(condition, message: str) -> None:
    if not bool(condition):
        raise IRError(f"Sequences: {message}")


def verify_sequences(seqs, forest) -> None:
    S, T, C = seqs.num_sequences, forest.num_tokens, seqs.chunk_size
    _check(C >= 1, "chunk_size must be positive")
    for name in ("seq_round", "seq_start_position", "seq_own_start", "seq_own_end",
                 "seq_init_seq", "seq_init_offset"):
        _check(getattr(seqs, name).shape == (S,), f"{name} has the wrong shape")
    _check(seqs.replay_ptr.shape == (S + 1,) and seqs.export_ptr.shape == (S + 1,),
           "pointer arrays have the wrong shape")
    own_start, own_end = seqs.seq_own_start, seqs.seq_own_end
    order = np.argsort(own_start, kind="stable")
    _check(np.array_equal(order, np.arange(S)), "sequences are not ordered by own_start")
    _check(S == 0 or (own_start[0] == 0 and own_end[-1] == T), "own ranges do not cover [0, T)")
    _check(np.array_equal(own_start[1:], own_end[:-1]), "own ranges overlap or leave gaps")
    _check(np.all(own_end > own_start), "empty own range")
    pred = forest.token_pred
    breaks = np.cumsum(pred != np.arange(-1, T - 1))  # path breaks up to each token
    _check(np.all((pred[own_start] != own_start - 1) | (pred[own_start] < 0)),
           "a sequence starts inside a heavy path")
    _check(np.all(breaks[own_end - 1] - breaks[own_start] == 0),
           "an own range is not one contiguous path segment")
    node = forest.token_node[own_start]
    _check(np.array_equal(seqs.seq_tree, forest.node_tree[node]), "seq_tree disagrees with forest")
    pos = forest.token_position[own_start]
    sigma = seqs.seq_start_position
    _check(np.array_equal(sigma, pos // C * C), "start_position is not floor(pos/C)*C")
    replay_len = np.diff(seqs.replay_ptr)
    _check(np.array_equal(replay_len, pos - sigma), "replay length is not pos - start_position")
    # Replay rows: the last is own_start's predecessor, each earlier one the next one's predecessor.
    if seqs.replay.size:
        last_of_seq = seqs.replay_ptr[1:] - 1
        nxt = np.empty(seqs.replay.size, np.int64)
        nxt[:-1] = seqs.replay[1:]
        has_replay = replay_len > 0
        nxt[last_of_seq[has_replay]] = own_start[has_replay]
        _check(np.array_equal(pred[nxt], seqs.replay), "replay rows are not the path ancestors")
    _verify_states(seqs, forest, sigma)


def _verify_states(seqs, forest, sigma) -> None:
    S, C = seqs.num_sequences, seqs.chunk_size
    init, offset = seqs.seq_init_seq, seqs.seq_init_offset
    zero = init < 0
    _check(np.array_equal(zero, sigma == 0), "zero initial state iff start_position == 0")
    _check(np.all(offset[zero] == 0), "zero-state sequences must have init_offset 0")
    src = init[~zero]
    me = np.flatnonzero(~zero)
    _check(np.all(src < S), "init_seq out of range")
    _check(np.all(seqs.seq_tree[src] == seqs.seq_tree[me]), "state source in another tree")
    _check(np.all(seqs.seq_round[src] < seqs.seq_round[me]), "state source not in an earlier round")
    off = offset[me]
    _check(np.all((off > 0) & (off % C == 0)), "init_offset is not a positive multiple of C")
    _check(np.all(off <= seqs.seq_length[src]), "init_offset beyond the source sequence's rows")
    _check(np.array_equal(sigma[src] + off, sigma[me]), "source boundary is not start_position")
    # The source's row just before the boundary must lie on this sequence's path.
    row = _row_compact_index(seqs, src, off - 1)
    x = seqs.seq_own_start[me]
    _check(np.all(forest.token_position[row] == sigma[me] - 1), "source row at wrong position")
    _check(np.all((row <= x) & (x < forest.node_subtree_end[forest.token_node[row]])),
           "source state is not on the sequence's path")
    expected = [set() for _ in range(S)]
    for s, o in zip(src.tolist(), off.tolist()):
        expected[s].add(o)
    for s in range(S):
        _check(seqs.exports_of(s).tolist() == sorted(expected[s]),
               f"exports of sequence {s} are not the offsets other sequences start from")
    rounds = np.zeros(forest.num_trees, np.int64)
    np.maximum.at(rounds, seqs.seq_tree, seqs.seq_round + 1)
    _check(np.array_equal(rounds, seqs.tree_rounds), "tree_rounds disagree with sequence rounds")


def _row_compact_index(seqs, s: np.ndarray, local: np.ndarray) -> np.ndarray:
    """Compact index of local row `local` of sequence `s` (replay rows first, then own rows)."""
    n_replay = seqs.replay_ptr[s + 1] - seqs.replay_ptr[s]
    in_replay = local < n_replay
    replay_index = np.minimum(seqs.replay_ptr[s] + local, max(seqs.replay.size - 1, 0))
    from_replay = seqs.replay[replay_index] if seqs.replay.size else np.zeros_like(local)
    return np.where(in_replay, from_replay, seqs.seq_own_start[s] + local - n_replay)
