"""Small random rollout batches for tests (seeded numpy, plus a hypothesis strategy).

Trajectories fork from earlier ones at random cut points over a tiny vocabulary, so batches have
deep sharing, accidental merges across groups, duplicates, strict prefixes, nodes shorter than a
conv width and branches on and off chunk boundaries.
"""
from __future__ import annotations

import numpy as np

from .batch import TreeBatch


def random_token_lists(rng: np.random.Generator, n_traj: int = 8, vocab: int = 3,
                       max_len: int = 24) -> list[list[int]]:
    out: list[list[int]] = []
    for _ in range(n_traj):
        if out and rng.random() < 0.8:
            parent = out[int(rng.integers(len(out)))]
            cut = int(rng.integers(0, len(parent) + 1))
            prefix = parent[:cut]
        else:
            prefix = []
        extra = int(rng.integers(0 if prefix else 1, max(2, max_len - len(prefix)) + 1))
        if rng.random() < 0.15:
            extra = 0 if prefix else 1  # duplicates and strict prefixes
        out.append(prefix + rng.integers(0, vocab, extra).tolist())
    return out


def random_batch(seed: int, **kwargs) -> TreeBatch:
    return TreeBatch.from_trajectories(random_token_lists(np.random.default_rng(seed), **kwargs))


def token_lists_strategy(max_traj: int = 8, vocab: int = 3, max_len: int = 20):
    """Hypothesis strategy of forking token lists (imported lazily: hypothesis is a test extra)."""
    from hypothesis import strategies as st

    @st.composite
    def build(draw):
        n = draw(st.integers(1, max_traj))
        out: list[list[int]] = []
        for k in range(n):
            if out and draw(st.booleans()):
                parent = out[draw(st.integers(0, len(out) - 1))]
                prefix = parent[:draw(st.integers(0, len(parent)))]
            else:
                prefix = []
            suffix = draw(st.lists(st.integers(0, vocab - 1), min_size=0 if prefix else 1,
                                   max_size=max_len))
            out.append(prefix + suffix)
        return out

    return build()


def brute_force_prefix_ids(token_lists) -> tuple[dict, list[list[tuple]]]:
    """Every distinct non-empty prefix, and per trajectory the prefix (tuple) of each position."""
    distinct: dict[tuple, int] = {}
    per_traj = []
    for tokens in token_lists:
        prefixes = [tuple(tokens[:p + 1]) for p in range(len(tokens))]
        for prefix in prefixes:
            distinct.setdefault(prefix, len(distinct))
        per_traj.append(prefixes)
    return distinct, per_traj
