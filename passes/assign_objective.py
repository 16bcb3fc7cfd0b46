"""Evaluation of (rank, slot) plans for `assign`: item order, per-cell loads, the objectives and the
lower bounds (see `assign.py`'s module docstring for the bounds).

Shared by `assign.py` (the greedy warm start, the final plan), `assign_local.py` (the local searches)
and `assign_cpsat.py` (the CP-SAT stages); it imports none of them.
"""
from __future__ import annotations

import numpy as np


def item_order(tokens: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """Largest cost first; ties: more tokens, then lower index (deterministic)."""
    return np.lexsort((np.arange(len(cost)), -tokens, -cost))


def slot_totals(tokens, cost, rank, slot, dp_size, n_slots):
    """([dp_size, n_slots] tokens, [dp_size, n_slots] cost) of a plan: the per-cell loads that
    the objectives, the local searches and the LNS all start from."""
    cell = rank * n_slots + slot
    size = dp_size * n_slots
    slot_tokens = np.bincount(cell, weights=tokens, minlength=size).astype(np.int64)
    slot_cost = np.bincount(cell, weights=cost, minlength=size)
    return slot_tokens.reshape(dp_size, n_slots), slot_cost.reshape(dp_size, n_slots)


def plan_objective(cost, rank, slot, dp_size: int, n_slots: int, objective: str) -> float:
    _, slot_cost = slot_totals(np.zeros(len(cost)), cost, rank, slot, dp_size, n_slots)
    if objective == "sum_of_slot_max":
        return float(slot_cost.max(axis=0).sum())
    return float(slot_cost.sum(axis=1).max())


def lower_bound(tokens, cost, budget: int, dp_size: int, objective: str) -> float:
    """The best of the averaging bound, the largest item and (sum_of_slot_max) the staircase
    bound; see `assign.py`'s module docstring."""
    if len(cost) == 0:
        return 0.0
    bound = max(float(cost.sum()) / dp_size, float(cost.max()))
    if objective != "sum_of_slot_max":
        return bound
    order = item_order(tokens, cost)
    c, t = cost[order], tokens[order]
    k = np.arange(1, len(c) + 1)
    smallest = np.maximum(np.minimum.accumulate(t), 1)  # min tokens among the top k
    per_cell = np.minimum(budget // smallest, k)        # most of them in one cell
    cells = np.maximum(np.ceil(k / np.maximum(per_cell, 1)), _bin_packing_bounds(t, budget))
    slots_needed = np.ceil(cells / dp_size)
    steps = c - np.append(c[1:], 0.0)
    return max(bound, float((steps * slots_needed).sum()))


L2_CHECKPOINTS = 256  # prefixes at which the Martello-Toth bound is evaluated (cost O(n log n))


def _bin_packing_bounds(tokens: np.ndarray, budget: int) -> np.ndarray:
    """[n] lower bound on the (rank, slot) cells that items 0..k-1 need by their tokens: the
    Martello-Toth L2 bound (which includes ceil(tokens / budget)) at up to L2_CHECKPOINTS
    prefixes, carried forward to the prefixes in between (a prefix needs at least the cells of
    a shorter one)."""
    n = len(tokens)
    stride = max(1, -(-n // L2_CHECKPOINTS))
    checkpoints = np.unique(np.append(np.arange(stride, n + 1, stride), n))
    cells = np.zeros(n + 1)
    cells[checkpoints] = [_martello_toth_l2(tokens[:m], budget) for m in checkpoints]
    return np.maximum.accumulate(cells)[1:]


def _martello_toth_l2(tokens: np.ndarray, budget: int) -> int:
    """L2 of Martello and Toth (1990): for a threshold a <= budget / 2, items > budget - a each
    need a bin no item >= a can share, items in (budget / 2, budget - a] each need their own
    bin, and items in [a, budget / 2] fill the room those leave before opening new bins.
    Maximised over a in {0} and every item size <= budget / 2, vectorised."""
    size = np.sort(tokens)                               # ascending
    total = np.concatenate([[0], np.cumsum(size)])       # total[j] = sum of the j smallest
    n = len(size)
    alpha = np.concatenate([[0], np.unique(size[2 * size <= budget])])
    n_half = n - np.searchsorted(size, budget // 2, side="right")   # items > budget / 2
    n_big = n - np.searchsorted(size, budget - alpha, side="right")  # items > budget - a
    n_mid = n_half - n_big                                           # (budget / 2, budget - a]
    sum_mid = total[n - n_big] - total[n - n_half]
    first_small = np.searchsorted(size, alpha, side="left")          # items >= a start here
    sum_small = total[n - n_half] - total[first_small]
    spill = np.ceil((sum_small - (n_mid * budget - sum_mid)) / budget)
    return int(np.max(n_big + n_mid + np.maximum(spill, 0)))
