"""(rank, slot) assignment: budgets, completeness, determinism, time limit, exact optimum."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_compiler.passes.assign import (OBJECTIVES, assign, greedy_assign, lower_bound,
                                          plan_objective)


def _brute_force(tokens, cost, budget, dp_size, num_slots, objective):
    best = np.inf
    for cells in itertools.product(range(dp_size * num_slots), repeat=len(tokens)):
        cells = np.asarray(cells)
        rank, slot = cells % dp_size, cells // dp_size
        used = np.zeros((dp_size, num_slots))
        np.add.at(used, (rank, slot), tokens)
        if (used <= budget).all():
            best = min(best, plan_objective(cost, rank, slot, dp_size, num_slots, objective))
    return best


def _check_plan(a, tokens, cost, budget, dp_size):
    assert a.rank.shape == a.slot.shape == tokens.shape  # every item assigned exactly once
    assert ((0 <= a.rank) & (a.rank < dp_size)).all()
    assert ((0 <= a.slot) & (a.slot < a.num_slots)).all()
    used = np.zeros((dp_size, a.num_slots), dtype=np.int64)
    np.add.at(used, (a.rank, a.slot), tokens)
    assert np.array_equal(used, a.slot_tokens)
    assert (used <= budget).all()
    assert a.slot_cost.sum() == pytest.approx(cost.sum())
    assert a.objective == pytest.approx(
        plan_objective(cost, a.rank, a.slot, dp_size, a.num_slots, a.objective_kind))
    assert a.lower_bound <= a.objective * (1 + 1e-9)
    assert a.objective <= a.greedy_objective * (1 + 1e-12)


def _instance(seed, n, low=100, high=5000):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(low, high, n)
    return tokens, tokens * (1.0 + 0.2 * rng.random(n)) + 50.0


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("n,dp_size,budget", [(40, 2, 9000), (300, 4, 20000)])
def test_budgets_respected_and_every_item_assigned(objective, n, dp_size, budget):
    tokens, cost = _instance(n, n)
    a = assign(tokens, cost, token_budget=budget, dp_size=dp_size, objective=objective,
               time_limit_s=0.3)
    _check_plan(a, tokens, cost, budget, dp_size)
    assert a.status in ("OPTIMAL", "FEASIBLE", "GREEDY_FALLBACK")


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("n", [10, 200])  # whole-problem model, and local search + LNS
def test_same_input_same_plan(objective, n):
    tokens, cost = _instance(7, n)
    runs = [assign(tokens, cost, token_budget=12000, dp_size=4, objective=objective,
                   time_limit_s=3.0, seed=3) for _ in range(2)]
    assert all(r.deterministic for r in runs)  # else the wall clock, not the budget, stopped it
    assert np.array_equal(runs[0].rank, runs[1].rank)
    assert np.array_equal(runs[0].slot, runs[1].slot)
    assert runs[0].objective == runs[1].objective


def test_tiny_time_limit_returns_the_greedy_plan_in_time():
    tokens, cost = _instance(11, 400)
    assign(tokens[:5], cost[:5], token_budget=None, dp_size=3, time_limit_s=0.05)  # warm import
    a = assign(tokens, cost, token_budget=15000, dp_size=8, time_limit_s=1e-4)
    rank, slot = greedy_assign(tokens, cost, 15000, 8, None, "sum_of_slot_max")
    assert a.status == "GREEDY_FALLBACK" and a.method == "greedy"
    assert np.array_equal(a.rank, rank) and np.array_equal(a.slot, slot)
    assert a.wall_time_s < 0.5  # the greedy itself; no solver step was started
    b = assign(tokens, cost, token_budget=15000, dp_size=8, time_limit_s=0.2)
    assert b.wall_time_s < 0.2 + 0.15


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(3, 6), st.integers(1, 3), st.integers(1, 2),
       st.sampled_from(OBJECTIVES))
def test_optimal_on_small_instances(seed, n, dp_size, num_slots, objective):
    rng = np.random.default_rng(seed)
    if (dp_size * num_slots) ** n > 4096:
        n = 4
    tokens = rng.integers(1, 10, n)
    cost = rng.integers(1, 30, n).astype(float)
    budget = int(max(tokens.max(), -(-tokens.sum() // (dp_size * num_slots)) + 4))
    a = assign(tokens, cost, token_budget=budget, dp_size=dp_size, num_slots=num_slots,
               objective=objective, time_limit_s=5.0, seed=seed)
    _check_plan(a, tokens, cost, budget, dp_size)
    assert a.objective == pytest.approx(_brute_force(tokens, cost, budget, dp_size, num_slots,
                                                     objective))
    assert a.status == "OPTIMAL"


def test_improves_on_greedy_lpt_trap_and_cp_sat_beats_local_search():
    # Two ranks, one slot: LPT puts 3,3 apart then 2,2,2 -> 7; the optimum is 3+3 | 2+2+2 = 6.
    cost = np.array([3.0, 3.0, 2.0, 2.0, 2.0])
    a = assign(np.ones(5, dtype=np.int64), cost, token_budget=None, dp_size=2, time_limit_s=5.0)
    assert a.greedy_objective == 7.0 and a.objective == 6.0 and a.status == "OPTIMAL"
    # Here no single move or swap helps (greedy 72), only the exact model finds 71 = sum / 2.
    cost = np.array([23.0, 33, 17, 30, 4, 21, 14])
    a = assign(np.ones(7, dtype=np.int64), cost, token_budget=None, dp_size=2, time_limit_s=5.0)
    assert a.greedy_objective == 72.0 and a.objective == 71.0
    assert a.status == "OPTIMAL" and a.method == "cp-sat"


def test_small_problems_get_the_lns_before_the_whole_model():
    # Items that nearly fill a (rank, slot) each (like trees in pieces): the whole model alone
    # (one worker, a fraction of a second) rarely improves the local search, so small problems
    # run regrouping, the local search and LNS steps first, then the whole model (>= 2 solves).
    from harts_compiler.passes.assign_local import local_search
    rng = np.random.default_rng(5)
    tokens = np.minimum(rng.integers(5000, 66000, 44), 65000)
    cost = tokens * (0.09 + 0.07 * rng.random(44))
    a = assign(tokens, cost, token_budget=65536, dp_size=8, time_limit_s=0.5)
    assert len(tokens) * 8 * a.num_slots <= 3000  # the whole-model size class
    rank, slot = greedy_assign(tokens, cost, 65536, 8, None, "sum_of_slot_max")
    n_slots = int(slot.max()) + 1
    local_search(tokens, cost, 65536, rank, slot, 8, n_slots, float("inf"), 10_000)
    local = plan_objective(cost, rank, slot, 8, n_slots, "sum_of_slot_max")
    assert a.objective < local * (1 - 1e-3) and a.solver_steps >= 2


def test_lower_bounds_are_valid_and_staircase_is_tight_for_big_items():
    # One item per (rank, slot) fits: slots group 4 items each; the optimum sums every 4th cost.
    cost = np.array([10.0, 9, 8, 7, 6, 5, 4, 3])
    tokens = np.full(8, 60)
    bound = lower_bound(tokens, cost, 100, 4, "sum_of_slot_max")
    assert bound == pytest.approx(10 + 6)
    assert cost.sum() / 4 < bound
    a = assign(tokens, cost, token_budget=100, dp_size=4)
    assert a.objective == pytest.approx(16) and a.status == "OPTIMAL"


def test_staircase_counts_cells_with_the_bin_packing_bound():
    # Top 3 by cost have 4, 8, 7 tokens (budget 10): by tokens (19) they would fit one slot of
    # two cells, but no two of them share a cell, so they need 3 cells = 2 slots (L2 sees it):
    # bound = (14-13) + (13-10) + 2 (10-8) + 2 (8-1) + 2 * 1 = 24, which is the optimum.
    tokens, cost = np.array([7, 2, 4, 7, 8]), np.array([8.0, 1, 14, 10, 13])
    bound = lower_bound(tokens, cost, 10, 2, "sum_of_slot_max")
    assert bound == pytest.approx(24)
    assert bound == pytest.approx(_brute_force(tokens, cost, 10, 2, 3, "sum_of_slot_max"))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=6), st.integers(20, 30))
def test_martello_toth_bound_is_valid_and_at_least_the_simple_ones(sizes, budget):
    from harts_compiler.passes.assign_objective import _martello_toth_l2
    sizes = np.asarray(sizes)
    bins = _martello_toth_l2(sizes, budget)
    assert bins >= max(-(-int(sizes.sum()) // budget), int((2 * sizes > budget).sum()))
    fewest = min(k for k in range(1, len(sizes) + 1)  # brute force: fewest bins that fit
                 if any(np.bincount(bin_of, weights=sizes, minlength=k).max() <= budget
                        for bin_of in itertools.product(range(k), repeat=len(sizes))))
    assert bins <= fewest


def test_empty_cells_are_allowed_and_no_budget_means_one_slot():
    a = assign(np.array([5, 5]), np.array([1.0, 1.0]), token_budget=None, dp_size=4)
    assert a.num_slots == 1 and (a.slot_cost == 0).sum() == 2 and a.objective == 1.0


def test_bad_input_names_the_offending_field():
    with pytest.raises(ValueError, match="item 1: 30 tokens exceed token_budget 20"):
        assign(np.array([10, 30]), np.array([1.0, 1.0]), token_budget=20, dp_size=2)
    with pytest.raises(ValueError, match="item_cost: item 0"):
        assign(np.array([1]), np.array([np.nan]), token_budget=None, dp_size=1)
    with pytest.raises(ValueError, match="dp_size"):
        assign(np.array([1]), np.array([1.0]), token_budget=None, dp_size=0)
    with pytest.raises(ValueError, match="objective"):
        assign(np.array([1]), np.array([1.0]), token_budget=None, dp_size=1, objective="fast")
    with pytest.raises(ValueError, match="same length"):
        assign(np.array([1, 2]), np.array([1.0]), token_budget=None, dp_size=1)
    with pytest.raises(ValueError, match="num_slots: item"):
        assign(np.array([6, 6, 6]), np.ones(3), token_budget=10, dp_size=1, num_slots=2)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 60), st.integers(1, 4))
def test_local_search_never_worsens_and_keeps_budgets(seed, n, dp_size):
    from harts_compiler.passes.assign_local import local_search
    tokens, cost = _instance(seed, n, 1, 50)
    budget = 120
    rank, slot = greedy_assign(tokens, cost, budget, dp_size, None, "sum_of_slot_max")
    n_slots = int(slot.max()) + 1
    before = plan_objective(cost, rank, slot, dp_size, n_slots, "sum_of_slot_max")
    local_search(tokens, cost, budget, rank, slot, dp_size, n_slots, float("inf"), 10_000)
    used = np.zeros((dp_size, n_slots), dtype=np.int64)
    np.add.at(used, (rank, slot), tokens)
    assert (used <= budget).all() and ((0 <= slot) & (slot < n_slots)).all()
    after = plan_objective(cost, rank, slot, dp_size, n_slots, "sum_of_slot_max")
    assert after <= before * (1 + 1e-12)
    assert after >= lower_bound(tokens, cost, budget, dp_size, "sum_of_slot_max") * (1 - 1e-9)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 5), st.integers(1, 6))
def test_regrouping_cells_by_cost_is_optimal_for_fixed_cells(seed, dp_size, n_slots):
    from harts_compiler.passes.assign_local import regroup_slots
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 3 * dp_size * n_slots + 1))
    cost = rng.random(n) * 10
    rank, slot = rng.integers(0, dp_size, n), rng.integers(0, n_slots, n)
    before = plan_objective(cost, rank, slot, dp_size, n_slots, "sum_of_slot_max")
    cells_before = {frozenset(np.flatnonzero((rank == r) & (slot == s)).tolist())
                    for r in range(dp_size) for s in range(n_slots)} - {frozenset()}
    regroup_slots(cost, rank, slot, dp_size, n_slots)
    cells_after = {frozenset(np.flatnonzero((rank == r) & (slot == s)).tolist())
                   for r in range(dp_size) for s in range(n_slots)} - {frozenset()}
    assert cells_after == cells_before  # items stay together, so budgets still hold
    after = plan_objective(cost, rank, slot, dp_size, n_slots, "sum_of_slot_max")
    cell_cost = np.sort([cost[list(c)].sum() for c in cells_before])[::-1]
    assert after <= before * (1 + 1e-12)
    assert after == pytest.approx(cell_cost[::dp_size].sum())  # every dp_size-th largest cell


def test_planner_benchmark_runs_on_a_small_batch(tmp_path):
    import importlib.util
    import json
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "bench" / "planner.py"
    spec = importlib.util.spec_from_file_location("bench_planner", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.json"
    bench.main(["--presets", "grpo", "tau2", "--trees", "40", "--dp-size", "4", "--budget", "16384",
                "--time-limit", "0.2", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert len(rows) == 4
    for row in rows:
        assert row["items"] >= 40 and row["objective"] >= row["lower_bound"] > 0
        assert row["objective"] <= row["greedy_objective"] * (1 + 1e-12)
    # The bench's items are the schedule pass's: same greedy plan value as its note.
    from harts_compiler import CompileOptions, TreeBatch, compile
    from harts_compiler.generator import generate
    options = CompileOptions(microbatch_tokens=16384, dp_size=4, schedule_time_limit_s=0.05)
    ids, lists = zip(*generate("grpo", 0, tasks=40).trajectories)
    note = compile(TreeBatch.from_trajectories(list(lists), list(ids)), options).program.note(
        "schedule")
    tokens, cost = bench.planner_items("grpo", 40, options, seed=0)
    greedy = assign(tokens, cost, token_budget=16384, dp_size=4, time_limit_s=0.05)
    assert len(tokens) == note["items"]
    assert greedy.greedy_objective == pytest.approx(note["greedy_objective"], rel=1e-12)


def test_slots_emptied_on_every_rank_are_dropped_unless_fixed():
    # The greedy opens 3 slots; the optimum (30) uses 2 of them.
    tokens, cost = np.array([4, 4, 6, 8, 9, 3]), np.array([5.0, 11, 12, 5, 7, 18])
    free = assign(tokens, cost, token_budget=10, dp_size=2, time_limit_s=2.0)
    greedy_rank, greedy_slot = greedy_assign(tokens, cost, 10, 2, None, "sum_of_slot_max")
    assert greedy_slot.max() + 1 == 3 and free.greedy_objective == 34.0
    assert free.objective == 30.0 and free.status == "OPTIMAL"
    assert free.num_slots == 2 and set(free.slot.tolist()) == {0, 1}
    fixed = assign(tokens, cost, token_budget=10, dp_size=2, num_slots=4, time_limit_s=2.0)
    assert fixed.num_slots == 4 and fixed.objective == 30.0
