"""Trajectory-wise baseline: every trajectory its own sequence, through the same runtime code.

`trajectory_wise(model, batch)` is what verification and benchmarks compare tree mode against: no
token is shared, every sequence starts from the zero state in one round, and the tree mask
degenerates to per-trajectory causal masks (`codegen.index.trajectory_index`).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from harts_compiler.codegen.index import trajectory_index

from .model import TreeModel, TreeOutput


def trajectory_token_lists(batch) -> tuple[list[np.ndarray], list[str]]:
    """Token lists and ids from a TreeBatch, a {id: tokens} mapping or a sequence of token lists."""
    if hasattr(batch, "tokens") and hasattr(batch, "offsets") and hasattr(batch, "ids"):  # TreeBatch
        offsets = np.asarray(batch.offsets)
        tokens = np.asarray(batch.tokens)
        lists = [tokens[offsets[j]:offsets[j + 1]] for j in range(len(offsets) - 1)]
        return lists, [str(i) for i in batch.ids]
    if isinstance(batch, Mapping):
        return [np.asarray(t, dtype=np.int64) for t in batch.values()], [str(k) for k in batch]
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        return [np.asarray(t, dtype=np.int64) for t in batch], [str(i) for i in range(len(batch))]
    raise TypeError(f"trajectory_wise: cannot read trajectories from {type(batch).__name__} "
                    "(give a TreeBatch, a {id: tokens} dict or a list of token lists)")


def trajectory_wise(model: TreeModel, batch, *, chunk_size: int = 64, **forward_kwargs) -> TreeOutput:
    """Run every trajectory of `batch` as its own sequence; same TreeOutput as tree mode."""
    token_lists, ids = trajectory_token_lists(batch)
    index = trajectory_index(token_lists, ids, chunk_size=chunk_size, conv_width=model.conv_width)
    return model(index, **forward_kwargs)


def trajectory_packs(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Trajectory numbers grouped, in input order, into packs of at most `max_tokens` tokens (a longer
    trajectory is a pack of its own): the trajectory-wise baseline run one pack at a time, so its memory
    is bounded by the budget, not by the batch."""
    packs: list[list[int]] = []
    current, tokens = [], 0
    for number, length in enumerate(lengths):
        if current and tokens + int(length) > max_tokens:
            packs.append(current)
            current, tokens = [], 0
        current.append(number)
        tokens += int(length)
    if current:
        packs.append(current)
    return packs


def pack_index(token_lists: Sequence[np.ndarray], ids: Sequence[str], pack: Sequence[int], *, chunk_size: int,
               conv_width: int):
    """The MicrobatchIndex of one pack: each of its trajectories its own sequence."""
    return trajectory_index([token_lists[j] for j in pack], [ids[j] for j in pack], chunk_size=chunk_size,
                            conv_width=conv_width)
