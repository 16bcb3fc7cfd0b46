"""schedule (cost model + CP-SAT assignment) and the pass manager: budgets, ranks/slots,
determinism, time limit and fallback, notes, verify, dumps."""
import time

import numpy as np
import pytest

import harts_compiler as hc
from harts_compiler.ir import IRError
from harts_compiler.driver import program_from_batch
from harts_compiler.passes import PASSES, build_pipeline, run_passes
from harts_compiler.passes.base import Pass
from harts_compiler.passes.schedule import Schedule, first_fit_decreasing
from harts_compiler.testing import random_token_lists


def batch_of_trees(sizes):
    """One tree per size (distinct first tokens, one trajectory each)."""
    return hc.TreeBatch.from_trajectories([[1000 + t] + [0] * (n - 1) for t, n in enumerate(sizes)])


def _cells(plan):
    return [(mb.rank, mb.slot, mb.trees) for mb in plan.microbatches()]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_budget_ranks_and_slots(seed, dp_size):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 50, int(rng.integers(1, 20))).tolist()
    budget = max(sizes) + int(rng.integers(0, 40))
    plan = hc.compile(batch_of_trees(sizes), hc.CompileOptions(microbatch_tokens=budget, dp_size=dp_size, chunk_size=4))
    mbs = plan.microbatches()
    assert sorted(t for mb in mbs for t in mb.trees) == list(range(len(sizes)))
    assert all(mb.compact_tokens <= budget for mb in mbs)
    assert len({(mb.rank, mb.slot) for mb in mbs}) == len(mbs)
    assert {mb.slot for mb in mbs} == set(range(max(mb.slot for mb in mbs) + 1))
    note = plan.program.note("schedule")
    assert note["status"] in ("OPTIMAL", "FEASIBLE", "GREEDY_FALLBACK")
    assert note["lower_bound"] <= note["objective"] * (1 + 1e-9)
    assert note["objective"] <= note["greedy_objective"] * (1 + 1e-9)


def test_no_budget_one_microbatch_per_rank():
    sizes = [40, 30, 20, 10, 5, 5]
    plan = hc.compile(batch_of_trees(sizes), hc.CompileOptions(dp_size=2))
    mbs = plan.microbatches()
    assert [(mb.rank, mb.slot) for mb in mbs] == [(0, 0), (1, 0)]
    assert sum(mb.compact_tokens for mb in mbs) == sum(sizes)
    assert plan.microbatches(rank=1)[0].rank == 1
    assert plan.program.note("schedule")["num_slots"] == 1


def test_same_input_same_plan_and_note_in_json():
    rng = np.random.default_rng(7)
    sizes = rng.integers(5, 200, 60).tolist()
    options = hc.CompileOptions(microbatch_tokens=400, dp_size=4)
    first, second = (hc.compile(batch_of_trees(sizes), options) for _ in range(2))
    assert _cells(first) == _cells(second)
    assert first.stats["schedule"]["objective"] == second.stats["schedule"]["objective"]
    assert first.stats["schedule"]["deterministic"]


def test_time_limit_zero_falls_back_to_the_greedy_plan():
    rng = np.random.default_rng(3)
    sizes = rng.integers(5, 200, 80).tolist()
    options = dict(microbatch_tokens=300, dp_size=4)
    plan = hc.compile(batch_of_trees(sizes), hc.CompileOptions(schedule_time_limit_s=0, **options))
    note = plan.program.note("schedule")
    assert note["status"] in ("GREEDY_FALLBACK", "OPTIMAL")  # OPTIMAL only if greedy hits the bound
    assert note["method"] == "greedy" and note["objective"] == note["greedy_objective"]
    assert note["wall_time_s"] < 0.5
    solved = hc.compile(batch_of_trees(sizes), hc.CompileOptions(schedule_time_limit_s=0.3, **options))
    assert solved.program.note("schedule")["objective"] <= note["objective"] * (1 + 1e-9)


def test_time_limit_is_honoured():
    rng = np.random.default_rng(5)
    sizes = rng.integers(5, 300, 400).tolist()
    program = hc.compile(batch_of_trees(sizes), hc.CompileOptions(microbatch_tokens=900),
                         passes=["prefix-compress", "layout", "replay-min", "cut-pieces"]).program
    Schedule(microbatch_tokens=900, dp_size=8, time_limit_s=0.05).run(program)  # OR-Tools import
    for limit in (0.05, 0.3):
        start = time.perf_counter()
        out = Schedule(microbatch_tokens=900, dp_size=8, time_limit_s=limit).run(program)
        elapsed = time.perf_counter() - start
        assert elapsed < limit + 0.5, (limit, elapsed)
        assert out.note("schedule")["wall_time_s"] < limit + 0.25


def test_objective_option_and_cli_validation():
    sizes = list(range(10, 40))
    plan = hc.compile(batch_of_trees(sizes), hc.CompileOptions(microbatch_tokens=60, dp_size=3, chunk_size=4,
                                                               objective="max_rank_total"))
    assert plan.program.note("schedule")["objective_kind"] == "max_rank_total"
    with pytest.raises(hc.InputError, match="objective"):
        hc.CompileOptions.checked(objective="fastest")
    with pytest.raises(hc.InputError, match="schedule_time_limit_s"):
        hc.CompileOptions.checked(schedule_time_limit_s=-1)
    with pytest.raises(hc.InputError, match="option cost_model: .*no-such.json: no such"):
        hc.compile(batch_of_trees(sizes), hc.CompileOptions(cost_model="/nonexistent/no-such.json"))


def test_tree_over_budget_without_pieces_is_a_clear_error():
    sizes = [30, 10]
    program = hc.compile(batch_of_trees(sizes), passes=["prefix-compress", "layout",
                                                        "replay-min"]).program
    with pytest.raises(hc.InputError, match="run cut-pieces"):
        Schedule(microbatch_tokens=20).run(program)


def test_first_fit_helper():
    assert first_fit_decreasing([5, 4, 3, 2, 1], 6) == [[0, 4], [1, 3], [2]]


def test_registry_is_the_pipeline_order():
    assert list(PASSES) == ["prefix-compress", "layout", "replay-min", "cut-pieces", "schedule"]
    pipeline = build_pipeline(hc.CompileOptions(chunk_size=8, conv_width=3, dp_size=4,
                                                microbatch_tokens=99, objective="max_rank_total"))
    assert [p.name for p in pipeline] == list(PASSES)
    assert pipeline[1].conv_width == 3 and pipeline[2].chunk_size == 8 and pipeline[4].dp_size == 4
    assert pipeline[3].microbatch_tokens == 99 and pipeline[4].objective == "max_rank_total"
    with pytest.raises(KeyError, match="unknown pass"):
        build_pipeline(hc.CompileOptions(), ["nope"])


def test_manager_verifies_between_passes_and_times(tmp_path):
    class Corrupt(Pass):
        name = "corrupt"

        def run(self, program):
            f = program.forest
            return program.replace(forest=f.replace(traj_length=f.traj_length + 1))

    batch = hc.TreeBatch.from_trajectories(random_token_lists(np.random.default_rng(0)))
    passes = build_pipeline(hc.CompileOptions(), ["prefix-compress"]) + [Corrupt()]
    with pytest.raises(IRError, match="traj_length"):
        run_passes(program_from_batch(batch), passes)
    program, timings = run_passes(program_from_batch(batch), passes, verify=False, dump_dir=tmp_path)
    assert [t.name for t in timings] == ["prefix-compress", "corrupt"]
    assert [name for name, _ in program.provenance] == ["prefix-compress", "corrupt"]
    assert sorted(p.name for p in tmp_path.glob("*.hir")) == ["00-input.hir", "01-prefix-compress.hir",
                                                             "02-corrupt.hir"]


def test_passes_are_pure():
    batch = hc.TreeBatch.from_trajectories([[1, 2, 3], [1, 2, 4], [5]])
    start = program_from_batch(batch)
    program = start
    for p in build_pipeline(hc.CompileOptions(chunk_size=2)):
        before = program
        snapshot = {k: v.copy() for k, v in vars(before.forest).items()
                    if isinstance(v, np.ndarray)} if before.forest is not None else {}
        program = p.run(program)
        assert program is not before
        for k, v in snapshot.items():
            assert np.array_equal(getattr(before.forest, k), v), f"{p.name} mutated {k}"
    assert start.forest is None and start.trajectories is not None


def test_pass_order_errors():
    batch = hc.TreeBatch.from_trajectories([[1, 2]])
    with pytest.raises(ValueError, match="layout: needs a forest"):
        build_pipeline(hc.CompileOptions(), ["layout"])[0].run(program_from_batch(batch))
