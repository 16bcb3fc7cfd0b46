"""Whole trees riding with a piece: one forward computes a piece of a split tree and some whole trees.

A tree in pieces fills its microbatch's cell, but its smallest piece often leaves most of the budget free (a
tree 38 tokens over the budget has a piece of 38 tokens: a whole forward and backward of the model for them).
The schedule may put whole trees (*riders*) in that cell; they run in the same forward as the piece. Riders
read nothing from the pieces and nothing reads them, so the merged index is the piece's index with the riders'
tables appended:

- rows: the piece's own T tokens, then the riders' R tokens, then the piece's carried rows (conv inputs,
  replay rows), so every carried-row reference of the piece moves up by R;
- attention keys: the piece's context keys, its own tokens, then the riders'; a rider key's subtree end lies
  in its own tree, and no key of the piece reaches a rider query (their subtree ends stop at the piece's end);
- linear attention: round r packs the piece's round r and the riders' round r; the riders' state banks follow
  the piece's;
- log-prob targets and trajectory rows follow the piece's.

Cost: O(T + R) numpy.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .index import LinearRound, MicrobatchIndex


def append_riders(piece: MicrobatchIndex, riders: MicrobatchIndex) -> MicrobatchIndex:
    """`piece` (a piece's index, with its context) and `riders` (whole trees, no context) as one index."""
    if piece.context is None or riders.context is not None:
        raise ValueError("append_riders: a piece's index and a whole-tree index are expected")
    if (piece.chunk_size, piece.conv_width) != (riders.chunk_size, riders.conv_width):
        raise ValueError("append_riders: chunk size or conv width differ")
    T, R = piece.num_tokens, riders.num_tokens
    keys_before = piece.context.num_keys + T  # rider keys follow the context's and the piece's own keys

    def carried_up(rows: np.ndarray) -> np.ndarray:  # the piece's carried rows sit after the riders
        return np.where(rows >= T, rows + R, rows)

    conv_piece = carried_up(piece.conv_pred)
    conv_riders = np.where(riders.conv_pred >= 0, riders.conv_pred + T, -1)
    conv_pred = np.concatenate([conv_piece[:T], conv_riders, conv_piece[T:]])

    rounds = []
    for r in range(max(len(piece.rounds), len(riders.rounds))):
        a = piece.rounds[r] if r < len(piece.rounds) else None
        b = riders.rounds[r] if r < len(riders.rounds) else None
        rounds.append(_merge_round(a, b, T, R, piece.num_states))

    n_targets = piece.target_src.size
    width = max(piece.row_target.shape[1], riders.row_target.shape[1])
    shifted_target = np.where(riders.row_target >= 0, riders.row_target + n_targets, -1)
    shifted_pred = np.where(riders.row_pred >= 0, riders.row_pred + T, -1)
    merged = MicrobatchIndex(
        trajectory_ids=piece.trajectory_ids + riders.trajectory_ids,
        token_ids=np.concatenate([piece.token_ids, riders.token_ids]),
        positions=np.concatenate([piece.positions, riders.positions]),
        multiplicity=np.concatenate([piece.multiplicity, riders.multiplicity]),
        conv_pred=conv_pred,
        subtree_end=np.concatenate([piece.subtree_end, riders.subtree_end + keys_before]),
        rounds=rounds, num_states=piece.num_states + riders.num_states,
        target_src=np.concatenate([piece.target_src, riders.target_src + T]),
        target_token=np.concatenate([piece.target_token, riders.target_token]),
        row_target=np.concatenate([_pad(piece.row_target, width), _pad(shifted_target, width)]),
        row_pred=np.concatenate([_pad(piece.row_pred, width), _pad(shifted_pred, width)]),
        lengths=np.concatenate([piece.lengths, riders.lengths]),
        chunk_size=piece.chunk_size, conv_width=piece.conv_width, context=piece.context)
    merged.check()
    return merged


def _merge_round(a: LinearRound | None, b: LinearRound | None, T: int, R: int, piece_states: int) -> LinearRound:
    """Round r of the piece (`a`, carried rows moved up by R) followed by the riders' round r (`b`, rows moved
    past the piece's T tokens, state banks past the piece's)."""
    empty = np.zeros(0, np.int64)
    if a is None:
        a = LinearRound(cu_seqlens=np.zeros(1, np.int64), row_src=empty, own_rows=empty, own_dst=empty,
                        init_state=empty, export_seq=empty, export_offset=empty, export_bank=empty)
    a = dataclasses.replace(a, row_src=np.where(a.row_src >= T, a.row_src + R, a.row_src),
                            own_dst=np.where(a.own_dst >= T, a.own_dst + R, a.own_dst))
    if b is None:
        return a
    packed = int(a.cu_seqlens[-1])
    return LinearRound(
        cu_seqlens=np.concatenate([a.cu_seqlens, b.cu_seqlens[1:] + packed]),
        row_src=np.concatenate([a.row_src, b.row_src + T]),
        own_rows=np.concatenate([a.own_rows, b.own_rows + packed]),
        own_dst=np.concatenate([a.own_dst, b.own_dst + T]),
        init_state=np.concatenate([a.init_state, np.where(b.init_state >= 0, b.init_state + piece_states,
                                                          b.init_state)]),
        export_seq=np.concatenate([a.export_seq, b.export_seq + a.num_sequences]),
        export_offset=np.concatenate([a.export_offset, b.export_offset]),
        export_bank=np.concatenate([a.export_bank, b.export_bank + piece_states]))


def _pad(rows: np.ndarray, width: int) -> np.ndarray:
    return np.pad(rows, ((0, 0), (0, width - rows.shape[1])), constant_values=-1)
