"""CP-SAT stages of `assign.assign` (OR-Tools is imported only here, and only when called).

`improve` runs the local search of `assign_local.py`, then a large neighbourhood search whose steps
re-solve a few cells exactly, then (small problems) the whole problem as one CP-SAT model hinted
with the best plan so far. Every
stage keeps the best plan found so far, so the result is never worse than its input plan. Work is
granted in CP-SAT *deterministic* time and local-search tries (proportional to the time limit), so
the same input gives the same plan; the wall clock is only a safety stop (see `assign.py`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .assign_local import MOVES_PER_SECOND, local_search, local_search_total, regroup_slots
from .assign_objective import lower_bound, plan_objective, slot_totals

FULL_MODEL_MAX_VARS = 3000     # items x ranks x slots up to which the whole problem is one model
# Work granted per second of time_limit_s, sized to use about a third of it on the 2-core dev
# machine (one CP-SAT deterministic unit took 3.5-6 s of wall there; one local-search try ~0.2 ms),
# so the work budget, not the wall clock, ends the search (same plan) on a machine up to ~3x busier.
DET_UNITS_PER_SECOND = 0.035   # CP-SAT deterministic time
STEP_OVERHEAD_DET = 0.004      # model building per LNS step, charged to the deterministic budget
COST_RESOLUTION = 10_000_000   # total cost in integer units inside the models

@dataclass
class _Improved:
    rank: np.ndarray
    slot: np.ndarray
    bound: float = 0.0
    optimal: bool = False
    steps: int = 0
    method: str = "greedy"
    deterministic: bool = True


class _Budget:
    """Deterministic work budget (what decides the plan) with the wall clock as a safety stop."""

    def __init__(self, deadline: float, det_units: float):
        self.deadline, self.det_left, self.wall_stopped = deadline, det_units, False

    def left(self) -> tuple[float, float]:
        wall = self.deadline - time.perf_counter()
        if wall <= 0 and self.det_left > 0:
            self.wall_stopped = True
        return wall, self.det_left

    def solve(self, model, seed: int, workers: int, det_cap: float):
        from ortools.sat.python import cp_model
        wall, det = self.left()
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(wall, 1e-3)
        solver.parameters.max_deterministic_time = max(min(det, det_cap), 1e-4)
        solver.parameters.random_seed = seed
        solver.parameters.num_workers = workers
        status = solver.solve(model)
        used = solver.response_proto.deterministic_time
        self.det_left -= used + STEP_OVERHEAD_DET
        if solver.wall_time >= solver.parameters.max_time_in_seconds * 0.99 and used < det * 0.99:
            self.wall_stopped = True
        return solver, status


def improve(tokens, cost, budget, dp_size, n_slots, objective, rank, slot, *, deadline,
            time_limit_s, seed, workers) -> _Improved:
    """Local search, then the whole CP-SAT model (small problems) or the LNS, from the plan
    (rank, slot); returns the best plan found, the CP-SAT bound and how it was found."""
    units = np.maximum(np.rint(cost * (COST_RESOLUTION / max(cost.sum(), 1e-300))), 0)
    units = units.astype(np.int64)
    clock = _Budget(deadline, time_limit_s * DET_UNITS_PER_SECOND)
    out = _Improved(rank.copy(), slot.copy())
    # Regrouping cells into slots by cost is optimal for fixed cells and O(cells log cells);
    # like the local search it is skipped when the limit grants no search work at all.
    tries = int(MOVES_PER_SECOND * time_limit_s)
    lockstep = objective == "sum_of_slot_max"
    regrouped = lockstep and tries > 0 and regroup_slots(cost, out.rank, out.slot, dp_size,
                                                          n_slots)
    search = local_search if lockstep else local_search_total
    moved, cut = search(tokens, cost, budget, out.rank, out.slot, dp_size, n_slots, deadline,
                        tries)
    moved |= regrouped
    clock.wall_stopped |= cut
    out.method = "greedy+local" if moved else "greedy"
    small = len(tokens) * dp_size * n_slots <= FULL_MODEL_MAX_VARS
    # The LNS first, also on small problems: its exact few-cell steps find in a few hundredths
    # of a second what the whole model (one worker) does not find in seconds when items nearly
    # fill a cell each (swe parts: 4% better). Small problems keep half the budget for the
    # whole model, hinted with the LNS plan, which can still improve it or prove it optimal.
    if clock.left()[0] > 0.002 and _lns(clock, out, tokens, cost, units, budget, dp_size,
                                        n_slots, objective, seed, workers,
                                        det_reserve=clock.det_left / 2 if small else 0.0):
        out.method = "cp-sat-lns"
    if small and clock.left()[0] > 0.002 and clock.left()[1] > 0:
        solution = _solve_cells(clock, np.arange(len(tokens)), tokens, units, budget, dp_size,
                                n_slots, objective, out.rank, out.slot, seed, workers,
                                det_cap=np.inf)
        out.steps += 1
        if solution is not None:
            new_rank, new_slot, out.optimal, bound_units = solution
            # Back to cost units; each item's rounding moves a plan's value by <= half a unit.
            unit = max(cost.sum(), 1e-300) / COST_RESOLUTION
            out.bound = max(0.0, (bound_units - 0.5 * len(tokens)) * unit)
            if plan_objective(cost, new_rank, new_slot, dp_size, n_slots, objective) < \
                    plan_objective(cost, out.rank, out.slot, dp_size, n_slots, objective):
                out.rank, out.slot, out.method = new_rank, new_slot, "cp-sat"
    if lockstep and tries > 0 and regroup_slots(cost, out.rank, out.slot, dp_size, n_slots) \
            and out.method == "greedy":
        out.method = "greedy+local"
    out.deterministic = not clock.wall_stopped
    return out


def _lns(clock, out, tokens, cost, units, budget, dp_size, n_slots, objective, seed, workers,
         det_reserve: float = 0.0):
    """Large neighbourhood search: each step frees the items of a few cells and re-solves them
    exactly; a neighbourhood that did not improve is not tried again until the plan changes.

    sum_of_slot_max: in a slot with the largest excess (its max minus its mean rank cost), the
    slowest cell and the two least loaded, plus the slowest and least loaded cell of a partner
    slot (the nearest by max, so items of similar size meet, or a seeded random one); the other
    cells of those slots enter as constant floors of the slot maxima.
    max_rank_total: the busiest rank and a partner (least loaded, or random) over the two slots
    where their loads differ most; the other slots' loads enter as constants.
    Stops when `det_reserve` deterministic time is left (kept for the whole model).
    """
    rng = np.random.default_rng(seed)
    tried: set[tuple] = set()
    improved = False
    while clock.left()[0] > 0.002 and clock.left()[1] > det_reserve:
        _, cell_cost = slot_totals(tokens, cost, out.rank, out.slot, dp_size, n_slots)
        hood = _pick_neighbourhood(cell_cost, objective, tried, rng)
        if hood is None:
            return improved
        tried.add(hood)
        if objective == "sum_of_slot_max":
            sub = _solve_cell_group(clock, hood, out.rank, out.slot, tokens, units, budget,
                                    dp_size, n_slots, seed, workers)
        else:
            sub = _solve_rank_pair(clock, hood, out.rank, out.slot, tokens, cost, units, budget,
                                   cell_cost, seed, workers)
        out.steps += 1
        if sub is None:
            continue
        items, item_rank, item_slot = sub
        new_rank, new_slot = out.rank.copy(), out.slot.copy()
        new_rank[items], new_slot[items] = item_rank, item_slot
        before = plan_objective(cost, out.rank, out.slot, dp_size, n_slots, objective)
        after = plan_objective(cost, new_rank, new_slot, dp_size, n_slots, objective)
        if after < before * (1 - 1e-12):
            out.rank, out.slot = new_rank, new_slot
            tried.clear()
            improved = True
    return improved


def _pick_neighbourhood(cell_cost, objective, tried, rng):
    """The next LNS neighbourhood -- sum_of_slot_max: sorted (rank, slot) cells; max_rank_total:
    (ranks, slots) -- or None when every candidate failed since the plan last changed."""
    dp_size, n_slots = cell_cost.shape
    all_slots = tuple(range(n_slots))
    if objective == "sum_of_slot_max":
        worst = cell_cost.max(axis=0)
        excess = worst - cell_cost.mean(axis=0)
        for g in np.lexsort((np.arange(n_slots), -excess))[:8]:
            if excess[g] <= 0:
                return None
            by_load = [int(r) for r in np.argsort(cell_cost[:, g], kind="stable")]
            own = {(by_load[-1], int(g))} | {(r, int(g)) for r in by_load[:2]}
            nearest = [int(p) for p in np.argsort(np.abs(worst - worst[g]), kind="stable")
                       if p != g][:2]
            for p in nearest + [int(rng.integers(n_slots))]:
                if p == g:
                    continue
                partner = {(int(np.argmax(cell_cost[:, p])), p),
                           (int(np.argmin(cell_cost[:, p])), p)}
                hood = tuple(sorted(own | partner))
                if hood not in tried:
                    return hood
        return None
    totals = cell_cost.sum(axis=1)
    g = int(np.argmax(totals))
    for p in [int(q) for q in np.argsort(totals, kind="stable")[:2]] + [int(rng.integers(dp_size))]:
        if p == g:
            continue
        diff = cell_cost[g] - cell_cost[p]
        picks = [int(s) for s in np.argsort(-diff, kind="stable")[:2]]
        hood = (tuple(sorted({g, p})), tuple(sorted(set(picks))) if n_slots > 1 else all_slots)
        if hood not in tried:
            return hood
    return None


def _solve_rank_pair(clock, hood, rank, slot, tokens, cost, units, budget, cell_cost, seed,
                     workers):
    """max_rank_total step: re-solve the items of `ranks` x `slots` with the ranks' other
    slots as constant offsets. Returns (items, rank, slot) or None."""
    ranks, slots = hood
    items = np.flatnonzero(np.isin(rank, ranks) & np.isin(slot, slots))
    if len(items) == 0:
        return None
    rest = cell_cost.sum(axis=1) - cell_cost[:, list(slots)].sum(axis=1)
    offset = np.rint(rest[list(ranks)] * (COST_RESOLUTION / max(cost.sum(), 1e-300)))
    sub = _solve_cells(clock, items, tokens, units, budget, len(ranks), len(slots),
                       "max_rank_total", np.searchsorted(ranks, rank[items]),
                       np.searchsorted(slots, slot[items]), seed, workers, det_cap=0.01,
                       offset=offset.astype(np.int64))
    return None if sub is None else (items, np.asarray(ranks)[sub[0]], np.asarray(slots)[sub[1]])


def _solve_cell_group(clock, cells, rank, slot, tokens, units, budget, dp_size, n_slots, seed,
                      workers):
    """sum_of_slot_max step: re-solve the items of a few (rank, slot) cells exactly.

    Per involved slot u: m_u >= every involved cell's load in u, and m_u >= the largest load
    of u's other cells (a constant); minimise sum_u m_u. Involved cells of one slot are
    interchangeable, so their loads are ordered. Returns (items, rank, slot) or None."""
    from ortools.sat.python import cp_model
    cell_index = {cell: k for k, cell in enumerate(cells)}
    item_cell = rank * n_slots + slot
    wanted = np.array([r * n_slots + s for r, s in cells])
    items = np.flatnonzero(np.isin(item_cell, wanted))
    if len(items) == 0:
        return None
    unit_load = np.bincount(item_cell, weights=units, minlength=dp_size * n_slots)
    unit_load = unit_load.reshape(dp_size, n_slots)
    slots = sorted({s for _, s in cells})
    floor = {}
    for u in slots:
        others = [r for r in range(dp_size) if (r, u) not in cell_index]
        floor[u] = int(unit_load[others, u].max(initial=0))
    c, t = units[items].tolist(), tokens[items].tolist()
    model = cp_model.CpModel()
    x = [[model.new_bool_var("") for _ in cells] for _ in items]
    for row in x:
        model.add_exactly_one(row)
    cap = int(sum(c))
    load = [model.new_int_var(0, cap, "") for _ in cells]
    for k in range(len(cells)):
        column = [x[a][k] for a in range(len(items))]
        model.add(load[k] == cp_model.LinearExpr.weighted_sum(column, c))
        model.add(cp_model.LinearExpr.weighted_sum(column, t) <= budget)
    peak = {u: model.new_int_var(floor[u], floor[u] + cap, "") for u in slots}
    for u in slots:
        in_u = [k for k, (_, s) in enumerate(cells) if s == u]
        for k in in_u:
            model.add(peak[u] >= load[k])
        for k, k2 in zip(in_u, in_u[1:]):
            model.add(load[k] >= load[k2])
    model.minimize(sum(peak.values()))
    # Hint: the current plan, with each slot's involved cells relabelled by decreasing load.
    current = np.array([cell_index[(int(r), int(s))] for r, s in zip(rank[items], slot[items])])
    relabel = np.arange(len(cells))
    for u in slots:
        in_u = [k for k, (_, s) in enumerate(cells) if s == u]
        by_load = sorted(in_u, key=lambda k: -unit_load[cells[k]])
        relabel[by_load] = in_u
    hint = relabel[current]
    for a in range(len(items)):
        for k in range(len(cells)):
            model.add_hint(x[a][k], k == hint[a])
    hint_value = sum(max([floor[u]] + [int(unit_load[cells[k]]) for k, (_, s) in
                                       enumerate(cells) if s == u]) for u in slots)
    solver, status = clock.solve(model, seed, workers, det_cap=0.01)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE) or \
            solver.objective_value >= hint_value:
        return None
    chosen = np.array([next(k for k in range(len(cells)) if solver.boolean_value(x[a][k]))
                       for a in range(len(items))])
    cells_arr = np.asarray(cells)
    return items, cells_arr[chosen, 0], cells_arr[chosen, 1]


def _solve_cells(clock, items, tokens, units, budget, ranks, slots, objective, hint_rank,
                 hint_slot, seed, workers, det_cap, offset=None):
    """Exact model over `items` on `ranks` x `slots` cells: booleans x[i, r, s], the token
    budget per cell, symmetry breaking, the hint, and a lower bound on the objective.

    sum_of_slot_max: ranks are interchangeable inside each slot, so cell loads are ordered
    load[0, s] >= load[1, s] >= ..., making load[0, s] the slot's max; slots are ordered by it.
    max_rank_total: rank totals are ordered (total[0] is the max) and, inside a rank, slots are
    interchangeable, so its cells are ordered by tokens. With `offset` (constant cost of each
    rank outside these cells) ranks are no longer interchangeable and are not ordered.
    Returns (rank, slot, proven optimal, bound in units) or None if nothing better was found.
    """
    from ortools.sat.python import cp_model
    c, t = units[items].tolist(), tokens[items].tolist()
    n = len(items)
    model = cp_model.CpModel()
    x = [[[model.new_bool_var("") for _ in range(slots)] for _ in range(ranks)] for _ in range(n)]
    for a in range(n):
        model.add_exactly_one(v for row in x[a] for v in row)
    cap = int(sum(c))
    load = [[model.new_int_var(0, cap, "") for _ in range(slots)] for _ in range(ranks)]
    used = [[None] * slots for _ in range(ranks)]
    for r in range(ranks):
        for s in range(slots):
            cell = [x[a][r][s] for a in range(n)]
            model.add(load[r][s] == cp_model.LinearExpr.weighted_sum(cell, c))
            used[r][s] = cp_model.LinearExpr.weighted_sum(cell, t)
            if sum(t) > budget:
                model.add(used[r][s] <= budget)
    if objective == "sum_of_slot_max":
        for s in range(slots):
            for r in range(ranks - 1):
                model.add(load[r][s] >= load[r + 1][s])
            if s + 1 < slots:
                model.add(load[0][s] >= load[0][s + 1])
        value = sum(load[0][s] for s in range(slots))
    else:
        base = [0] * ranks if offset is None else [int(v) for v in offset]
        totals = [base[r] + sum(load[r]) for r in range(ranks)]
        value = model.new_int_var(0, cap + max(base), "")
        for r in range(ranks):
            model.add(value >= totals[r])
            for s in range(slots - 1):
                model.add(used[r][s] >= used[r][s + 1])
            if offset is None and r + 1 < ranks:
                model.add(totals[r] >= totals[r + 1])
    free = units[items].astype(np.float64)
    bound = int(np.ceil(lower_bound(tokens[items], free, budget, ranks, objective) - 1e-6))
    if offset is not None:
        bound = int(max(np.ceil((free.sum() + sum(base)) / ranks - 1e-6), max(base)))
    model.add(value >= bound)
    model.minimize(value)
    hint_rank, hint_slot, hint_value = _canonical(c, t, hint_rank, hint_slot, ranks, slots,
                                                  objective, base if offset is not None else None)
    for a in range(n):
        for r in range(ranks):
            for s in range(slots):
                model.add_hint(x[a][r][s], r == hint_rank[a] and s == hint_slot[a])
    solver, status = clock.solve(model, seed, workers, det_cap)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    optimal = status == cp_model.OPTIMAL
    if solver.objective_value >= hint_value and not optimal:
        return None
    rank = np.empty(n, dtype=np.int64)
    slot = np.empty(n, dtype=np.int64)
    for a in range(n):
        for r in range(ranks):
            for s in range(slots):
                if solver.boolean_value(x[a][r][s]):
                    rank[a], slot[a] = r, s
    return rank, slot, optimal, solver.best_objective_bound


def _canonical(c, t, rank, slot, ranks, slots, objective, offset=None):
    """Relabel a plan so that it satisfies the model's symmetry breaking (for the hint)."""
    load = np.zeros((ranks, slots), dtype=np.int64)
    used = np.zeros((ranks, slots), dtype=np.int64)
    np.add.at(load, (rank, slot), c)
    np.add.at(used, (rank, slot), t)
    rank, slot = np.asarray(rank).copy(), np.asarray(slot).copy()
    if objective == "sum_of_slot_max":
        rank_order = np.argsort(-load, axis=0, kind="stable")     # [ranks, slots]: new r -> old
        new_rank = np.argsort(rank_order, axis=0, kind="stable")  # old r -> new r, per slot
        rank = new_rank[rank, slot]
        slot_order = np.argsort(-load.max(axis=0), kind="stable")
        slot = np.argsort(slot_order, kind="stable")[slot]
        value = int(load.max(axis=0).sum())
    else:
        totals = load.sum(axis=1) + (0 if offset is None else np.asarray(offset))
        rank_order = np.argsort(-totals, kind="stable") if offset is None else np.arange(ranks)
        new_rank_of = np.argsort(rank_order, kind="stable")
        slot_order = np.argsort(-used, axis=1, kind="stable")     # per rank: new s -> old s
        new_slot = np.argsort(slot_order, axis=1, kind="stable")
        slot = new_slot[rank, slot]
        rank = new_rank_of[rank]
        value = int(totals.max())
    return rank, slot, value
