"""schedule (greedy first version) and the pass manager: budgets, ranks/slots, verify, dumps."""
import numpy as np
import pytest

import harts_compiler as hc
from harts_compiler.ir import IRError, Program
from harts_compiler.driver import program_from_batch
from harts_compiler.passes import PASSES, build_pipeline, run_passes
from harts_compiler.passes.base import Pass
from harts_compiler.passes.schedule import assign_largest_first, first_fit_decreasing
from harts_compiler.testing import random_token_lists


def batch_of_trees(sizes):
    """One tree per size (distinct first tokens, one trajectory each)."""
    return hc.TreeBatch.from_trajectories([[1000 + t] + [0] * (n - 1) for t, n in enumerate(sizes)])


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_budget_ranks_and_slots(seed, dp_size):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 50, int(rng.integers(1, 20))).tolist()
    budget = max(sizes) + int(rng.integers(0, 40))
    plan = hc.compile(batch_of_trees(sizes), hc.CompileOptions(microbatch_tokens=budget, dp_size=dp_size))
    mbs = plan.microbatches()
    assert sorted(t for mb in mbs for t in mb.trees) == list(range(len(sizes)))
    assert all(mb.compact_tokens <= budget for mb in mbs)
    for rank in range(dp_size):
        slots = sorted(mb.slot for mb in mbs if mb.rank == rank)
        assert slots == list(range(len(slots)))
    # first-fit decreasing: an item in a later bin did not fit into any earlier bin, and loads
    # only grow, so no two microbatches would fit into one
    loads = [mb.compact_tokens for mb in mbs]
    assert all(a + b > budget for i, a in enumerate(loads) for b in loads[i + 1:])


def test_no_budget_one_microbatch_per_rank_balanced():
    sizes = [40, 30, 20, 10, 5, 5]
    plan = hc.compile(batch_of_trees(sizes), hc.CompileOptions(dp_size=2))
    mbs = plan.microbatches()
    assert [(mb.rank, mb.slot) for mb in mbs] == [(0, 0), (1, 0)]
    assert sorted(mb.compact_tokens for mb in mbs) == [55, 55]
    assert plan.microbatches(rank=1)[0].rank == 1


def test_first_fit_and_largest_first_helpers():
    assert first_fit_decreasing([5, 4, 3, 2, 1], 6) == [[0, 4], [1, 3], [2]]
    ranks, slots, groups = assign_largest_first([[0], [1], [2]], [5, 3, 4], 2, merge_per_rank=False)
    assert list(zip(ranks, slots, groups)) == [(0, 0, [0]), (1, 0, [2]), (1, 1, [1])]


def test_registry_is_the_pipeline_order():
    assert list(PASSES) == ["prefix-compress", "layout", "replay-min", "schedule"]
    pipeline = build_pipeline(hc.CompileOptions(chunk_size=8, conv_width=3, dp_size=4))
    assert [p.name for p in pipeline] == list(PASSES)
    assert pipeline[1].conv_width == 3 and pipeline[2].chunk_size == 8 and pipeline[3].dp_size == 4
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
