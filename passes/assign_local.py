"""Local search over (rank, slot) plans: the plain-numpy improvement stage of `assign`.

`assign_cpsat.improve` runs it before the CP-SAT stages: moves and swaps of items off the slowest
rank (lockstep objective: the slowest rank of each slot; or the slowest rank's total), and an exact
regrouping of cells into slots. Every step keeps the token budget and never makes the plan worse.
Work is bounded by a count of tries (deterministic); the wall clock is only a safety stop.
"""
from __future__ import annotations

import time

import numpy as np

from .assign_objective import slot_totals

MOVES_PER_SECOND = 1_000       # local-search item tries granted per second of time_limit_s


def local_search(tokens, cost, budget, rank, slot, dp_size, n_slots, deadline,
                  max_tries: int) -> tuple[bool, bool]:
    """Local search for sum_of_slot_max, in place. For each item on a slot's slowest rank (slots
    by excess first) take the best of: moving it into any (rank, slot) with room -- typically
    into the slack under another slot's max, which costs nothing there -- or swapping it with a
    cheaper item anywhere; apply it if it lowers the objective. Stops when a pass finds nothing
    or after `max_tries` items (deterministic); the wall clock is only a safety stop.
    Returns (changed anything, stopped by the wall clock)."""
    used, load = slot_totals(tokens, cost, rank, slot, dp_size, n_slots)
    changed, improving, tries = False, True, 0
    while improving and tries < max_tries:
        if time.perf_counter() > deadline:
            return changed, True
        improving = False
        slot_max = load.max(axis=0)
        for s in np.lexsort((np.arange(n_slots), -(slot_max - load.mean(axis=0)))):
            r = int(np.argmax(load[:, s]))
            for i in np.flatnonzero((rank == r) & (slot == s)):
                tries += 1
                step = _best_step(i, r, s, tokens, cost, budget, rank, slot, load, used, slot_max)
                if step is None:
                    continue
                target_rank, target_slot, partner = step
                for item, r_from, s_from, r_to, s_to in (
                        [(i, r, s, target_rank, target_slot)]
                        + ([(partner, target_rank, target_slot, r, s)] if partner >= 0 else [])):
                    load[r_from, s_from] -= cost[item]
                    used[r_from, s_from] -= tokens[item]
                    load[r_to, s_to] += cost[item]
                    used[r_to, s_to] += tokens[item]
                    rank[item], slot[item] = r_to, s_to
                slot_max = load.max(axis=0)
                changed = improving = True
                break  # the slot's slowest rank may have changed
            if tries >= max_tries:
                break
    return changed, False


def regroup_slots(cost, rank, slot, dp_size: int, n_slots: int) -> bool:
    """sum_of_slot_max, in place: keep every (rank, slot) cell's items together but regroup the
    cells into slots by decreasing cost (cells 1..dp_size form slot 0, and so on). For fixed
    cells this is optimal: the k-th slot max is at least the (k dp_size + 1)-th largest cell
    cost, which sorted grouping attains. Applied only when it lowers the objective; returns
    whether it did. Ties keep the current order (stable), so it is deterministic."""
    cell = rank * n_slots + slot
    cell_cost = np.bincount(cell, weights=cost, minlength=dp_size * n_slots)
    current = cell_cost.reshape(dp_size, n_slots).max(axis=0).sum()
    by_cost = np.argsort(-cell_cost, kind="stable")
    position = np.empty_like(by_cost)
    position[by_cost] = np.arange(len(by_cost))
    regrouped = cell_cost[by_cost].reshape(n_slots, dp_size).max(axis=1).sum()
    if not regrouped < current * (1 - 1e-12):
        return False
    new_cell = position[cell]
    slot[:], rank[:] = np.divmod(new_cell, dp_size)
    return True


def local_search_total(tokens, cost, budget, rank, slot, dp_size, n_slots, deadline,
                        max_tries: int) -> tuple[bool, bool]:
    """Local search for max_rank_total, in place: move an item off the busiest rank into any
    cell with room, or swap it with a cheaper item, when the two ranks' larger total drops
    below the busiest rank's. Budgets and return values as `local_search`."""
    used, load = slot_totals(tokens, cost, rank, slot, dp_size, n_slots)
    changed, tries = False, 0
    while tries < max_tries:
        if time.perf_counter() > deadline:
            return changed, True
        total = load.sum(axis=1)
        g = int(np.argmax(total))
        best = (total[g] * (1 - 1e-12), -1, -1, -1, -1)  # (new max of the pair, i, r2, s2, j)
        for i in np.flatnonzero(rank == g):
            tries += 1
            s, c, t = slot[i], cost[i], tokens[i]
            room = used + t <= budget
            room[g] = False
            pair_max = np.maximum(total[g] - c, total[:, None] + c)  # [ranks, slots]
            cand = np.where(room, pair_max, np.inf)
            r2, s2 = np.unravel_index(int(np.argmin(cand)), cand.shape)
            if cand[r2, s2] < best[0]:
                best = (cand[r2, s2], i, int(r2), int(s2), -1)
            d = c - cost
            ok = (d > 0) & (rank != g) & (used[g, s] - t + tokens <= budget)
            ok &= used[rank, slot] + t - tokens <= budget
            if ok.any():
                js = np.flatnonzero(ok)
                swap_max = np.maximum(total[g] - d[js], total[rank[js]] + d[js])
                k = int(np.argmin(swap_max))
                if swap_max[k] < best[0]:
                    best = (swap_max[k], i, int(rank[js[k]]), int(slot[js[k]]), int(js[k]))
        if best[1] < 0:
            return changed, False
        _, i, r2, s2, j = best
        moves = [(i, g, slot[i], r2, s2)] + ([(j, r2, s2, g, slot[i])] if j >= 0 else [])
        for item, r_from, s_from, r_to, s_to in moves:
            load[r_from, s_from] -= cost[item]
            used[r_from, s_from] -= tokens[item]
            load[r_to, s_to] += cost[item]
            used[r_to, s_to] += tokens[item]
            rank[item], slot[item] = r_to, s_to
        changed = True
    return changed, False


def _best_step(i, r, s, tokens, cost, budget, rank, slot, load, used, slot_max):
    """Best improving move or swap of item i (on the slowest rank r of slot s), as
    (target rank, target slot, swap partner or -1), or None."""
    dp_size = load.shape[0]
    c, t = cost[i], tokens[i]
    column = load[:, s].copy()
    column[r] = -np.inf
    # Move: the source slot's max drops to max(load - c, other ranks); the target may rise.
    source_max = max(load[r, s] - c, column.max(initial=0.0))
    rise = np.maximum(load + c - slot_max, 0.0)
    rise[:, s] = np.maximum(load[:, s] + c - source_max, 0.0)
    room = used + t <= budget
    room[r, s] = False
    move = np.where(room, rise, np.inf) + source_max - slot_max[s]
    best_move = int(np.argmin(move.T))  # ties: lowest slot, then lowest rank
    ms, mr = divmod(best_move, dp_size)
    best = (move[mr, ms], mr, ms, -1)
    # Swap with a cheaper item j at (r2, s2): the source cell sheds d = c - c_j, the target gains d.
    d = c - cost
    r2, s2 = rank, slot
    ok = (d > 0) & ~((r2 == r) & (s2 == s))
    ok &= (used[r, s] - t + tokens <= budget) & (used[r2, s2] + t - tokens <= budget)
    if ok.any():
        js = np.flatnonzero(ok)
        dj, rj, sj = d[js], r2[js], s2[js]
        # Other slot: source max = max(load - d, other ranks); target max may rise.
        src = np.maximum(load[r, s] - dj, column.max(initial=0.0))
        gain = np.where(sj == s, 0.0, np.maximum(load[rj, sj] + dj - slot_max[sj], 0.0)) \
            + src - slot_max[s]
        same = sj == s
        if same.any():  # same slot: ranks r and rj both change
            # Max load of slot s over the ranks other than r and q, for every q.
            top = np.argsort(-column, kind="stable")
            first = column[top[0]]
            second = column[top[1]] if dp_size > 1 else -np.inf
            without = np.maximum(np.where(np.arange(dp_size) == top[0], second, first), 0.0)
            new_max = np.maximum.reduce([load[r, s] - dj[same], load[rj[same], s] + dj[same],
                                         without[rj[same]]])
            gain[same] = new_max - slot_max[s]
        k = int(np.argmin(gain))
        if gain[k] < best[0]:
            best = (gain[k], int(rj[k]), int(sj[k]), int(js[k]))
    if not best[0] < -1e-9 * slot_max[s]:
        return None
    return best[1], best[2], best[3]
