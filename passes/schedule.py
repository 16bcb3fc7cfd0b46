"""`schedule`: trees -> microbatches on data-parallel (rank, slot) pairs."""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from harts_compiler.errors import InputError
from harts_compiler.ir import Microbatches, Program

from .assign import OBJECTIVES, assign
from .base import Pass
from .cost_model import (CostModelError, LayerCounts, default_cost_model, load_cost_model,
                         tree_costs)


@dataclass(frozen=True)
class Schedule(Pass):
    """Sequenced program -> + microbatches.

    Items are the trees. Item cost is the cost model's predicted fwd+bwd time of the tree alone
    (`cost_model.tree_costs`, for a model with `linear_layers` / `full_layers`; `cost_model` names a
    fitted JSON file, "default" the built-in guesses, None the repository's fit if any), less the
    per-microbatch constant, which packed trees share. A tree that runs as pieces (`cut-pieces`) fills
    its (rank, slot), and pays the constant once per piece after the first. `assign.assign` places
    every item on one (rank, slot) with at most `microbatch_tokens` compact tokens per (rank,
    slot), minimising `objective` (`sum_of_slot_max`: ranks run slots in lockstep; or
    `max_rank_total`) with a greedy warm start, CP-SAT under `time_limit_s` (deterministic work
    budget, fixed `seed` and `workers`: the same input gives the same plan) and the greedy plan
    as the fallback. Without a budget every rank gets one slot. Each non-empty (rank, slot) is one
    microbatch, its trees in tree order; a rank may have empty slots (it still joins that slot's
    collectives at run time).

    Riders: a tree in pieces leaves its smallest piece's room under the budget free. When there are
    such trees, the plan is also made with whole trees packed into that room first (first-fit
    decreasing; they run in that piece's forward, `codegen/riders.py`), and the plan whose objective
    is lower once every non-empty (rank, slot) pays the per-microbatch constant is kept (a rider saves
    a forward where it empties a cell, and can lengthen a slot where it does not). The solver's
    status, objective, lower bound, greedy objective, time and the riders go into the program's
    notes (`Program.note("schedule")`).

    Output invariants (`Microbatches.verify`): every tree in exactly one non-empty microbatch,
    ranks in range, at most one microbatch per (rank, slot), every slot used by some rank,
    budgets respected.
    Complexity: O(trees) features and greedy (x ranks x slots), then the solver's time limit.
    """

    name = "schedule"
    microbatch_tokens: int | None = None  # None or 0 = no limit
    dp_size: int = 1
    objective: str = "sum_of_slot_max"
    time_limit_s: float = 0.2
    seed: int = 0
    workers: int = 1
    cost_model: str | None = None
    linear_layers: int | None = None  # None: LayerCounts.stated's reference model
    full_layers: int | None = None

    def run(self, program: Program) -> Program:
        budget = self.microbatch_tokens or 0
        forest = program.forest
        self.require(forest is not None and forest.laid_out and program.sequences is not None,
                     "a sequenced program (run replay-min)")
        self.require(self.dp_size >= 1, "dp_size >= 1")
        self.require(self.objective in OBJECTIVES, f"objective in {OBJECTIVES}")
        try:
            model = (default_cost_model() if self.cost_model == "default"
                     else load_cost_model(self.cost_model))
        except CostModelError as error:
            raise InputError(f"option cost_model: {error}") from None
        layers = LayerCounts.stated(self.linear_layers, self.full_layers)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused just below, not warned about
            sizes, cost = schedule_items(program, budget, model, layers)
        if not np.all(np.isfinite(cost)):  # huge coefficients or layer counts overflow a float
            raise InputError(f"option cost_model: {model.source}: a tree's predicted time is not a finite number "
                             f"({layers.linear} linear, {layers.full} full layers; coefficients too large?)")
        constant = model.coefficients.get("microbatch", 0.0)
        groups = rider_groups(program, sizes, budget)
        best = None
        for riders in ([], groups) if groups else ([],):
            items, item_sizes, item_cost = _group_items(sizes, cost, riders)
            result = assign(item_sizes, item_cost, token_budget=budget or None, dp_size=self.dp_size,
                            num_slots=None if budget else 1, objective=self.objective,
                            time_limit_s=self.time_limit_s, seed=self.seed, workers=self.workers)
            total = _objective_with_constant(result, constant, self.objective)
            if best is None or total < best[0] - 1e-9:
                best = (total, result, items, riders)
        total, result, items, riders = best
        rank = np.empty(sizes.size, np.int64)
        slot = np.empty(sizes.size, np.int64)
        for i, members in enumerate(items):
            rank[members], slot[members] = result.rank[i], result.slot[i]
        microbatches = _microbatches(rank, slot, self.dp_size, budget)
        note = {**result.summary(), "items": len(items), "trees": int(sizes.size),
                "riders": int(sum(len(group) - 1 for group in riders)),
                "objective_with_microbatch_cost": total,
                "cost_model": {"source": model.source, "device": model.device,
                               "date": model.date}}
        return program.replace(microbatches=microbatches,
                               notes=program.notes + ((self.name, json.dumps(note)),))


def rider_groups(program, sizes: np.ndarray, budget: int) -> list[list[int]]:
    """[tree in pieces, riders...] per tree in pieces that takes any: whole trees, largest first, each into the
    first tree in pieces whose smallest piece leaves it room (first-fit decreasing; O(trees x pieced))."""
    pieces = program.pieces
    if pieces is None or not budget:
        return []
    pieced = np.unique(pieces.piece_tree)
    room = {int(t): budget - int(pieces.piece_tokens[pieces.rider_piece(int(t))]) for t in pieced}
    whole = np.setdiff1d(np.arange(sizes.size), pieced)
    groups = {int(t): [int(t)] for t in pieced}
    for t in whole[np.lexsort((whole, -sizes[whole]))].tolist():
        for host in groups:
            if sizes[t] <= room[host]:
                groups[host].append(t)
                room[host] -= int(sizes[t])
                break
    return [group for group in groups.values() if len(group) > 1]


def _group_items(sizes, cost, groups) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """The planner's items: each group as one item (its tokens those of its first tree, a tree in pieces
    that fills its cell; its cost the sum), every other tree alone."""
    grouped = {t for group in groups for t in group}
    items = [np.asarray(group, np.int64) for group in groups]
    items += [np.asarray([t], np.int64) for t in range(sizes.size) if t not in grouped]
    item_sizes = np.asarray([sizes[members[0]] for members in items], np.int64)
    item_cost = np.asarray([cost[members].sum() for members in items], np.float64)
    return items, item_sizes, item_cost


def _objective_with_constant(result, constant: float, objective: str) -> float:
    """The plan's objective when every non-empty (rank, slot) also pays the per-microbatch constant."""
    cells = result.slot_cost + constant * (result.slot_tokens > 0)
    if objective == "max_rank_total":
        return float(cells.sum(axis=1).max(initial=0.0))
    return float(cells.max(axis=0, initial=0.0).sum())


def schedule_items(program, budget: int, model, layers: LayerCounts) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, cost) of the program's trees as planner items. A tree that runs as pieces fills its
    (rank, slot) (each piece is up to a budget; riders, see `Schedule`, use its smallest piece's room), so
    its tokens count as the budget. A tree alone would pay the per-microbatch constant; packed trees share
    it, so it is not an item's cost (it is about the same for every non-empty (rank, slot)); a tree in k
    pieces pays it k - 1 more times."""
    forest = program.forest
    sizes = forest.tree_end - forest.tree_start
    pieced = np.zeros(sizes.size, bool)
    if program.pieces is not None:
        pieced[program.pieces.piece_tree] = True
    if budget and sizes.size and sizes[~pieced].max(initial=0) > budget:
        too_big = np.flatnonzero((sizes > budget) & ~pieced)[:5].tolist()
        raise InputError([f"tree {forest.tree_ids[t]!r}: {int(sizes[t])} compact tokens exceed "
                          f"--microbatch-tokens {budget} (run cut-pieces first)" for t in too_big])
    constant = model.coefficients.get("microbatch", 0.0)
    cost = np.maximum(tree_costs(program, layers, model) - constant, 0.0)
    if program.pieces is not None:  # each piece after the first is one more forward + backward
        cost += constant * (np.bincount(program.pieces.piece_tree, minlength=sizes.size) - pieced)
    return np.where(pieced, budget, sizes).astype(np.int64), cost


def _microbatches(rank: np.ndarray, slot: np.ndarray, dp_size: int, budget: int) -> Microbatches:
    """One microbatch per non-empty (rank, slot), ordered by (rank, slot); trees in tree order."""
    cell = rank * (int(slot.max(initial=0)) + 1) + slot
    order = np.lexsort((np.arange(cell.size), cell))
    cells, first, counts = np.unique(cell[order], return_index=True, return_counts=True)
    ptr = np.zeros(cells.size + 1, np.int64)
    np.cumsum(counts, out=ptr[1:])
    head = order[first]
    return Microbatches(dp_size=dp_size, microbatch_tokens=budget,
                        mb_rank=rank[head].astype(np.int64), mb_slot=slot[head].astype(np.int64),
                        mb_tree_ptr=ptr, mb_trees=order.astype(np.int64))


def first_fit_decreasing(sizes: list[int], budget: int) -> list[list[int]]:
    """Bins of item indices, largest first into the first bin with room (used by the benches
    as the naive packing baseline)."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for t in sorted(range(len(sizes)), key=lambda t: (-sizes[t], t)):
        for b, load in enumerate(loads):
            if load + sizes[t] <= budget:
                bins[b].append(t)
                loads[b] += sizes[t]
                break
        else:
            bins.append([t])
            loads.append(sizes[t])
    return bins
