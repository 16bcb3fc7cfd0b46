"""The host plan of the chunked log-prob op: which compact tokens predict what, in chunks.

Built once per microbatch from its target tables (docs/INTERFACES.md section 3) and uploaded with the rest
of the launch plan; forward and backward walk the same chunks. Checks here, on the host, every value the
op relies on (the Triton backward writes each (src, token) entry once, so pairs must be distinct).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RowSums:
    """Where the backward of a gather into [rows, max_len] sums: value dst[d] gets the gradient entries
    src[bounds[d]:bounds[d + 1]] (flat positions of the grid, in order); values no position reads are absent."""
    dst: np.ndarray     # [D] distinct value indices, ascending
    bounds: np.ndarray  # [D + 1]
    src: np.ndarray     # [J] flat positions, grouped by value, ascending within a group


def row_sums(index: np.ndarray) -> RowSums:
    """The RowSums of `index` [rows, max_len] (-1 = nothing gathered). O(J log J); a trajectory's row reads
    ascending values (its path in layout order), so the stable sort merges `rows` sorted runs."""
    flat = np.asarray(index, np.int64).reshape(-1)
    positions = np.flatnonzero(flat >= 0)
    src = positions[np.argsort(flat[positions], kind="stable")]
    keys = flat[src]
    dst, starts = np.unique(keys, return_index=True)
    return RowSums(dst=dst.astype(np.int64), bounds=np.append(starts, keys.size).astype(np.int64), src=src)


@dataclass(frozen=True)
class TargetPlan:
    num_tokens: int
    needed: np.ndarray            # [N] compact tokens that predict at least one target, sorted
    token_bounds: tuple[int, ...]  # chunk c covers needed[token_bounds[c]:token_bounds[c+1]]
    target_order: np.ndarray      # [P] targets sorted by their src's position in `needed`
    target_slot: np.ndarray       # [P] position in `needed` of each sorted target's src
    target_token: np.ndarray      # [P] token id of each sorted target
    target_bounds: tuple[int, ...]  # chunk c owns sorted targets target_bounds[c]:target_bounds[c+1]
    row_target: np.ndarray        # [rows, max_len] target of (row, p), -1 at p = 0 and in padding
    row_needed: np.ndarray        # [rows, max_len] position in `needed` of the token predicting (row, p), or -1
    # the backward sums of the row_target / row_needed gathers on the Triton path (None: torch's own gather
    # backward, the CPU and float64 path)
    target_sums: RowSums | None = None
    needed_sums: RowSums | None = None


def check_targets(target_src, target_token, row_target, row_pred, lengths, num_tokens: int, vocab: int, *,
                  partial_rows: bool = False) -> None:
    """Range and consistency checks of the target tables; ValueError names the field. O(P log P + rows x len).
    `partial_rows`: rows may leave positions to other pieces of their tree (valid only inside 1 <= p < length)."""
    for name, table in (("target_src", target_src), ("target_token", target_token), ("row_target", row_target),
                        ("row_pred", row_pred), ("lengths", lengths)):
        if not np.issubdtype(np.asarray(table).dtype, np.integer):
            raise ValueError(f"MicrobatchIndex.{name} must be an integer array, got {np.asarray(table).dtype}")
    src, tok = np.asarray(target_src, np.int64), np.asarray(target_token, np.int64)
    row_target, row_pred, lengths = (np.asarray(a, np.int64) for a in (row_target, row_pred, lengths))
    n_targets = src.size
    problems = []
    if src.size and (src.min() < 0 or src.max() >= num_tokens):
        problems.append(f"target_src has values outside [0, T={num_tokens})")
    if tok.size and (tok.min() < 0 or tok.max() >= vocab):
        bad = int(tok.min() if tok.min() < 0 else tok.max())
        problems.append(f"target_token holds token id {bad}, outside the vocabulary [0, V={vocab})")
    if row_target.size and (row_target.min() < -1 or row_target.max() >= n_targets):
        problems.append(f"row_target has values outside [-1, P={n_targets})")
    valid = row_target >= 0
    if not problems and (not np.array_equal(valid, row_pred >= 0)
                         or not np.array_equal(row_pred[valid], src[row_target[valid]])):
        problems.append("row_pred disagrees with target_src[row_target]")
    max_len = row_target.shape[1] if row_target.ndim == 2 else 0
    expected = (np.arange(max_len)[None, :] >= 1) & (np.arange(max_len)[None, :] < lengths[:, None])
    if valid.shape != expected.shape or not np.array_equal(valid, expected & valid if partial_rows else expected):
        where = "only inside" if partial_rows else "exactly at"
        problems.append(f"row_target is not valid {where} 1 <= p < lengths[row]")
    if np.unique(src * max(vocab, 1) + tok).size != n_targets:
        problems.append("target_src/target_token hold repeated (src, token) pairs")
    if problems:
        raise ValueError("MicrobatchIndex: " + "; ".join(problems))


def plan_targets(target_src, target_token, row_target, row_pred, num_tokens: int,
                 chunk_tokens: int = 4096, *, triton: bool = False) -> TargetPlan:
    """Chunks of `chunk_tokens` predicting tokens and the targets each chunk owns (O(P log P)); with `triton`, the
    row gathers' backward sums too (O(rows x max_len))."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"token_logprobs: chunk_tokens must be a positive int, got {chunk_tokens!r}")
    src, tok = np.asarray(target_src, np.int64), np.asarray(target_token, np.int64)
    needed, slot = np.unique(src, return_inverse=True)
    order = np.argsort(slot, kind="stable")
    slot_sorted = slot[order]
    token_bounds = tuple(range(0, needed.size, chunk_tokens)) + (needed.size,)
    target_bounds = tuple(int(x) for x in np.searchsorted(slot_sorted, token_bounds))
    to_needed = np.full(max(num_tokens, 1), -1, np.int64)
    to_needed[needed] = np.arange(needed.size)
    row_pred = np.asarray(row_pred, np.int64)
    row_needed = np.where(row_pred >= 0, to_needed[np.maximum(row_pred, 0)], -1)
    row_target = np.asarray(row_target, np.int64)
    return TargetPlan(num_tokens=num_tokens, needed=needed.astype(np.int64), token_bounds=token_bounds,
                      target_order=order.astype(np.int64), target_slot=slot_sorted.astype(np.int64),
                      target_token=tok[order], target_bounds=target_bounds,
                      row_target=row_target, row_needed=row_needed,
                      target_sums=row_sums(row_target) if triton else None,
                      needed_sums=row_sums(row_needed) if triton else None)
