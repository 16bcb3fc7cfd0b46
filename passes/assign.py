"""Assignment of planner items (trees or tree parts) to data-parallel (rank, slot) pairs.

This file: the public API (`assign`, `Assignment`) and the greedy warm start; `assign_objective.py`:
the plan objectives, per-cell loads and lower bounds; `assign_local.py`: the local searches;
`assign_cpsat.py`: the CP-SAT models (whole problem, LNS). Imports run one way: assign ->
assign_cpsat -> assign_local -> assign_objective (OR-Tools only inside the functions that solve).

A pure function over two arrays, independent of the IR: item `i` has `item_tokens[i]` compact
tokens and an estimated cost `item_cost[i]` (time, any unit). Every rank runs its slots in
lockstep with the other ranks (one microbatch per slot, as FSDP does), so a slot lasts as long as
its slowest rank. Objectives:

* `sum_of_slot_max` (default): sum over slots of the largest rank cost in that slot;
* `max_rank_total`: the largest total cost of one rank over all its slots.

Constraints: every item in exactly one (rank, slot); tokens of a (rank, slot) <= `token_budget`.
An empty (rank, slot) is allowed (the rank still takes part in that slot's collectives).

Method (`assign`):

1. greedy warm start: items by cost, largest first (ties: more tokens, lower index), each into
   the least-loaded (rank, slot) with room for its tokens, opening a slot when none has room
   (the slot count is the greedy's unless `num_slots` fixes it; without `num_slots`, slots the
   search empties on every rank are dropped at the end);
2. sum_of_slot_max: regroup the (rank, slot) cells into slots by decreasing cost (optimal for
   fixed cells; again at the end); a local search (sum_of_slot_max: move or swap an item off a
   slot's slowest rank, best improving step first), then a CP-SAT large neighbourhood search
   whose steps re-solve a few cells of two slots (max_rank_total: two ranks over two slots)
   exactly as small models;
3. small problems (items x ranks x slots <= FULL_MODEL_MAX_VARS; the LNS leaves them half the
   budget): the whole problem as one CP-SAT model, hinted with the best plan so far;
4. status OPTIMAL when the plan reaches a lower bound or the whole model is proven optimal
   (exact up to rounding costs to 1e-7 of their total, and for the slot count it was given: a
   plan with more slots than the greedy opened is not searched), FEASIBLE when CP-SAT improved the warm
   start, GREEDY_FALLBACK when it found nothing better in time: the plan is then the greedy one
   (after the local search, if `method` says greedy+local).

Lower bounds (documented because the benchmark's gap is measured against them):

* averaging / LP bound `sum(cost) / dp_size` (a slot's max is at least its mean rank cost; the
  slowest rank's total at least the mean total), and `max(cost)`;
* for `sum_of_slot_max`, a staircase bound: with costs sorted c_1 >= c_2 >= ..., the k largest
  items lie in slots whose max is >= c_k, and need at least N_k = ceil(M_k / dp_size) slots, M_k
  a lower bound on the (rank, slot) cells they fill by tokens: the larger of ceil(k / q_k) (q_k
  the most of them one cell can hold) and the Martello-Toth L2 bin-packing bound (items over
  half the budget need a cell each, smaller ones fill what those leave; it includes ceil(tokens /
  budget)), evaluated at up to L2_CHECKPOINTS prefixes; as sum_s max_s = integral over t of
  #{s: max_s >= t}, the objective is >= sum_k (c_k - c_{k+1}) N_k. It is tight when items are
  large (about one per (rank, slot), e.g. trees in pieces), where the averaging bound is
  loose (8% below the optimum on 45 `swe` items that L2 proves optimal);
* the CP-SAT bound when the whole problem was one model.

Determinism: ties are broken by index; CP-SAT runs with a fixed seed, a fixed number of workers
and a *deterministic* time budget, and the local search tries a fixed number of items (both
proportional to `time_limit_s`); the wall-clock limit is a safety stop. A plan is the same for
the same input unless the wall clock stopped the search first on a slow or busy machine (then
`Assignment.deterministic` is False). The first solver call in a process also pays the OR-Tools
import (about 1 s cold); it is not charged to the limit (`wall_time_s` includes it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .assign_cpsat import improve
from .assign_objective import item_order, lower_bound, plan_objective, slot_totals

OBJECTIVES = ("sum_of_slot_max", "max_rank_total")


@dataclass(frozen=True)
class Assignment:
    rank: np.ndarray          # [n] int64
    slot: np.ndarray          # [n] int64
    slot_tokens: np.ndarray   # [dp_size, num_slots] int64
    slot_cost: np.ndarray     # [dp_size, num_slots] float64
    objective: float          # in cost units, of this plan
    lower_bound: float
    greedy_objective: float   # objective of the greedy warm start
    status: str               # OPTIMAL (proven), FEASIBLE (CP-SAT improved the warm start),
    #                           GREEDY_FALLBACK (CP-SAT found nothing better in time)
    method: str               # greedy, greedy+local (local search), cp-sat, cp-sat-lns
    wall_time_s: float        # whole call, including a first OR-Tools import
    deterministic: bool       # False if the wall clock (not the deterministic budget) stopped it
    objective_kind: str
    solver_steps: int = 0     # CP-SAT solves run

    @property
    def num_slots(self) -> int:
        return self.slot_tokens.shape[1]

    @property
    def gap(self) -> float:
        """Relative distance to the lower bound (0 = proven optimal)."""
        return self.objective / self.lower_bound - 1.0 if self.lower_bound > 0 else 0.0

    def summary(self) -> dict:
        return {"status": self.status, "method": self.method, "objective": self.objective,
                "lower_bound": self.lower_bound, "gap": self.gap,
                "greedy_objective": self.greedy_objective, "num_slots": self.num_slots,
                "wall_time_s": self.wall_time_s, "deterministic": self.deterministic,
                "solver_steps": self.solver_steps, "objective_kind": self.objective_kind}


def assign(item_tokens, item_cost, *, token_budget: int | None, dp_size: int,
           num_slots: int | None = None, objective: str = "sum_of_slot_max",
           time_limit_s: float = 0.5, seed: int = 0, workers: int = 1) -> Assignment:
    """Assign every item to one (rank, slot); see the module docstring."""
    start = time.perf_counter()
    tokens, cost = _check_inputs(item_tokens, item_cost, token_budget, dp_size, num_slots,
                                 objective, time_limit_s, workers)
    budget = int(token_budget) if token_budget is not None else int(max(tokens.sum(), 1))
    greedy_rank, greedy_slot = greedy_assign(tokens, cost, budget, dp_size, num_slots, objective)
    n_slots = num_slots if num_slots is not None else int(greedy_slot.max(initial=-1)) + 1
    n_slots = max(n_slots, 1)
    bound = lower_bound(tokens, cost, budget, dp_size, objective)
    greedy_value = plan_objective(cost, greedy_rank, greedy_slot, dp_size, n_slots, objective)
    rank, slot, status, method = greedy_rank, greedy_slot, "GREEDY_FALLBACK", "greedy"
    steps, deterministic = 0, True
    if greedy_value <= bound * (1 + 1e-9):
        status = "OPTIMAL"
    elif len(tokens) > 0:
        # The OR-Tools import (first call in a process, ~1 s cold) is not charged to the limit:
        # charging it would make a process's first plan differ from later ones.
        before_import = time.perf_counter()
        from ortools.sat.python import cp_model  # noqa: F401
        deadline = start + time_limit_s + (time.perf_counter() - before_import)
        result = improve(tokens, cost, budget, dp_size, n_slots, objective, greedy_rank,
                          greedy_slot, deadline=deadline, time_limit_s=time_limit_s,
                          seed=seed, workers=workers)
        steps, deterministic = result.steps, result.deterministic
        bound = max(bound, result.bound)
        # The result is never worse than the greedy plan (every stage keeps the best plan).
        value = plan_objective(cost, result.rank, result.slot, dp_size, n_slots, objective)
        if value < greedy_value * (1 - 1e-12):
            rank, slot, method = result.rank, result.slot, result.method
        if result.optimal or value <= bound * (1 + 1e-9):
            status = "OPTIMAL"
        elif method.startswith("cp-sat"):
            status = "FEASIBLE"
    if num_slots is None and len(slot):  # drop slots the search emptied on every rank
        used_slots, slot = np.unique(slot, return_inverse=True)
        n_slots = len(used_slots)
    slot_tokens, slot_cost = slot_totals(tokens, cost, rank, slot, dp_size, n_slots)
    value = plan_objective(cost, rank, slot, dp_size, n_slots, objective)
    if bound > value and bound <= value * (1 + 1e-9):  # summation-order noise, not a real gap
        bound = value
    return Assignment(
        rank=rank, slot=slot, slot_tokens=slot_tokens, slot_cost=slot_cost,
        objective=value, lower_bound=float(bound), greedy_objective=float(greedy_value),
        status=status,
        method=method, wall_time_s=time.perf_counter() - start, deterministic=deterministic,
        objective_kind=objective, solver_steps=steps)


def _check_inputs(item_tokens, item_cost, token_budget, dp_size, num_slots, objective,
                  time_limit_s, workers):
    tokens = np.asarray(item_tokens)
    cost = np.asarray(item_cost, dtype=np.float64)
    if tokens.ndim != 1 or cost.shape != tokens.shape:
        raise ValueError(f"item_tokens, item_cost: need two 1-D arrays of the same length "
                         f"(got shapes {tokens.shape} and {cost.shape})")
    if tokens.size and (not np.issubdtype(tokens.dtype, np.integer) or tokens.min() < 0):
        raise ValueError("item_tokens: need non-negative integers")
    if cost.size and (not np.all(np.isfinite(cost)) or cost.min() < 0):
        bad = int(np.flatnonzero(~np.isfinite(cost) | (cost < 0))[0])
        raise ValueError(f"item_cost: item {bad} has cost {cost[bad]} (need finite and >= 0)")
    if not isinstance(dp_size, (int, np.integer)) or dp_size < 1:
        raise ValueError(f"dp_size: need an integer >= 1 (got {dp_size!r})")
    if token_budget is not None:
        if token_budget < 1:
            raise ValueError(f"token_budget: need >= 1 or None (got {token_budget})")
        over = np.flatnonzero(tokens > token_budget)
        if over.size:
            i = int(over[0])
            raise ValueError(f"item {i}: {int(tokens[i])} tokens exceed token_budget "
                             f"{token_budget} ({over.size} item(s) too large; split them first)")
    if num_slots is not None and num_slots < 1:
        raise ValueError(f"num_slots: need >= 1 or None (got {num_slots})")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective: expected one of {OBJECTIVES}, got {objective!r}")
    if not time_limit_s >= 0:
        raise ValueError(f"time_limit_s: need >= 0 (got {time_limit_s})")
    if workers < 1:
        raise ValueError(f"workers: need >= 1 (got {workers})")
    return tokens.astype(np.int64), cost


def greedy_assign(tokens, cost, budget: int, dp_size: int, num_slots: int | None,
                  objective: str) -> tuple[np.ndarray, np.ndarray]:
    """Largest first into the least-loaded (rank, slot) with room, opening slots as needed.

    `sum_of_slot_max` balances every (rank, slot); `max_rank_total` balances rank totals and
    puts the item into the rank's first slot with room. The first slot count tried is the
    fewest that can hold the tokens (or `num_slots`); if `num_slots` is fixed and an item fits
    nowhere, the items are packed first-fit by tokens instead (ValueError if that fails too).
    """
    n = len(tokens)
    slots = num_slots or max(1, -(-int(tokens.sum()) // (dp_size * budget)))
    load = np.zeros((dp_size, slots))
    used = np.zeros((dp_size, slots), dtype=np.int64)
    rank = np.zeros(n, dtype=np.int64)
    slot = np.zeros(n, dtype=np.int64)
    for i in item_order(tokens, cost):
        room = used + tokens[i] <= budget
        if not room.any():
            if num_slots is not None:  # cost-balancing got stuck: pack by tokens instead
                return _first_fit_by_tokens(tokens, budget, dp_size, num_slots)
            load = np.hstack([load, np.zeros((dp_size, 1))])
            used = np.hstack([used, np.zeros((dp_size, 1), dtype=np.int64)])
            room = used + tokens[i] <= budget
        if objective == "sum_of_slot_max":
            # Least-loaded cell with room; ties: lowest slot, then lowest rank.
            flat = np.where(room, load, np.inf).T.ravel()
            s, r = divmod(int(np.argmin(flat)), dp_size)
        else:
            totals = np.where(room.any(axis=1), load.sum(axis=1), np.inf)
            r = int(np.argmin(totals))
            s = int(np.argmax(room[r]))
        rank[i], slot[i] = r, s
        load[r, s] += cost[i]
        used[r, s] += tokens[i]
    return rank, slot


def _first_fit_by_tokens(tokens, budget: int, dp_size: int, num_slots: int):
    """Most tokens first into the first (slot, rank) with room; ValueError if one fits nowhere."""
    used = np.zeros(num_slots * dp_size, dtype=np.int64)  # cell = slot * dp_size + rank
    cell = np.zeros(len(tokens), dtype=np.int64)
    for i in np.lexsort((np.arange(len(tokens)), -tokens)):
        fits = np.flatnonzero(used + tokens[i] <= budget)
        if not fits.size:
            raise ValueError(f"num_slots: item {i} ({tokens[i]} tokens) fits in no (rank, slot) "
                             f"with {num_slots} slots of {dp_size} ranks x {budget} tokens "
                             f"(first fit by tokens); allow more slots")
        cell[i] = fits[0]
        used[fits[0]] += tokens[i]
    return cell % dp_size, cell // dp_size
