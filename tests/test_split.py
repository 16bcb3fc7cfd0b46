"""split-oversize: parts fit the budget, keep every trajectory whole, recompute only root paths,
and cost close to the brute-force optimum on small trees (model-level exactness: test_split_model)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import harts_compiler as hc
from harts_compiler.driver import program_from_batch
from harts_compiler.passes import build_pipeline, run_passes
from harts_compiler.passes.split_oversize import SplitOversize
from harts_compiler.testing import random_batch, token_lists_strategy

UP_TO_SPLIT = ["prefix-compress", "layout", "split-oversize"]


def laid_out(batch):
    program, _ = run_passes(program_from_batch(batch), build_pipeline(hc.CompileOptions(),
                                                                      ["prefix-compress", "layout"]))
    return program


def trajectory_tokens(forest):
    return {tid: forest.token_ids[forest.trajectory_compact_indices(j)].tolist()
            for j, tid in enumerate(forest.traj_ids)}


def check_split(before, after, budget):
    """Every invariant a user relies on, from the outside."""
    f0, f1 = before.forest, after.forest
    f1.verify()
    sizes = f1.tree_end - f1.tree_start
    assert sizes.max() <= budget
    assert f1.traj_ids == f0.traj_ids
    assert trajectory_tokens(f1) == trajectory_tokens(f0)  # each trajectory whole in one part
    # every compact token of a part lies on the path of a trajectory of that part
    assert f1.node_multiplicity.min() >= 1
    source = f1.tree_source if f1.tree_source is not None else np.arange(f1.num_trees)
    for t1 in range(f1.num_trees):  # a part is the prefix tree of its trajectories
        t0 = source[t1]
        mine = np.flatnonzero(f1.node_tree[f1.traj_end_node] == t1)
        assert (f0.node_tree[f0.traj_end_node[mine]] == t0).all()
        paths = {tuple(trajectory_tokens(f1)[f1.traj_ids[j]][:p + 1])
                 for j in mine for p in range(f1.traj_length[j])}
        assert len(paths) == sizes[t1]
    fits = (f0.tree_end - f0.tree_start) <= budget
    kept = [f0.tree_ids[t] for t in np.flatnonzero(fits)]
    assert set(kept) <= set(f1.tree_ids)  # trees that fit keep their names (and nodes)
    note = after.note("split-oversize")
    if note is not None:
        assert note["recomputed_tokens"] == f1.num_tokens - f0.num_tokens
        assert note["parts"] == int(np.isin(source, np.flatnonzero(~fits)).sum())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_lists_strategy(max_traj=12, max_len=25), st.data())
def test_parts_fit_and_keep_trajectories_whole(token_lists, data):
    program = laid_out(hc.TreeBatch.from_trajectories(token_lists))
    f = program.forest
    longest = int(f.traj_length.max())
    largest = int((f.tree_end - f.tree_start).max())
    budget = data.draw(st.integers(longest, max(longest, largest)))
    after = SplitOversize(microbatch_tokens=budget).run(program)
    check_split(program, after, budget)


def test_sibling_subtrees_share_one_part_and_its_context():
    """Root of 10 tokens, four 5-token children, budget 20: two parts of root + two children
    (one root path recomputed), not four parts."""
    lists = [[1] * 10 + [10 + k] * 5 for k in range(4)]
    program = laid_out(hc.TreeBatch.from_trajectories(lists))
    after = SplitOversize(microbatch_tokens=20).run(program)
    check_split(program, after, 20)
    assert (after.forest.tree_end - after.forest.tree_start).tolist() == [20, 20]
    assert after.note("split-oversize")["recomputed_tokens"] == 10


def test_a_part_takes_an_ancestors_subtree_into_its_spare_room():
    """R(2) -> u(6) -> {a(4), b(4)}, R -> {c(2), d(2)}; budget 14. u must cut a (part R u a,
    12 tokens); c then rides along in that part for free (14), and R u b d is the top part (14):
    8 recomputed tokens, where opening a new part at R would recompute 10."""
    R, u = [1, 1], [2] * 6
    lists = [R + u + [3] * 4, R + u + [4] * 4, R + [5, 5], R + [6, 6]]
    program = laid_out(hc.TreeBatch.from_trajectories(lists))
    after = SplitOversize(microbatch_tokens=14).run(program)
    check_split(program, after, 14)
    assert after.note("split-oversize")["recomputed_tokens"] == 8
    assert sorted((after.forest.tree_end - after.forest.tree_start).tolist()) == [14, 14]


def test_no_budget_or_all_fit_is_a_no_op():
    program = laid_out(random_batch(1, n_traj=10, max_len=20))
    for budget in (None, 0, 10_000):
        after = SplitOversize(microbatch_tokens=budget).run(program)
        assert after.forest is program.forest and after.note("split-oversize") is None


def test_trajectory_longer_than_the_budget_is_named():
    program = laid_out(hc.TreeBatch.from_trajectories([[1, 2, 3, 4, 5], [1, 2, 9]]))
    with pytest.raises(hc.InputError, match="tree '0': 6 compact tokens exceed --microbatch-tokens "
                                            "4 and cannot be split: its trajectory '0' alone has 5"):
        SplitOversize(microbatch_tokens=4).run(program)


def optimal_recompute(forest, budget):
    """Brute force: every partition of the distinct end nodes into groups whose union of root
    paths fits; minimum total tokens minus compact tokens (one tree)."""
    ends = sorted(set(forest.traj_end_node.tolist()))
    paths = {}
    for e in ends:
        path, v = set(), e
        while v >= 0:
            path.add(v)
            v = int(forest.node_parent[v])
        paths[e] = path
    length = forest.node_length

    def size(group):
        return int(length[sorted(set().union(*(paths[e] for e in group)))].sum())

    best = np.inf
    for labels in _partitions(len(ends)):
        groups = [[ends[i] for i in range(len(ends)) if labels[i] == g] for g in set(labels)]
        sizes = [size(g) for g in groups]
        if max(sizes) <= budget:
            best = min(best, sum(sizes))
    return best - forest.num_tokens


def _partitions(n):
    """Restricted growth strings: every set partition of range(n) once."""
    def grow(prefix, top):
        if len(prefix) == n:
            yield prefix
            return
        for label in range(top + 2):
            yield from grow(prefix + [label], max(top, label))
    yield from grow([], -1)


@pytest.mark.parametrize("time_limit", [0.0, 0.3])
def test_close_to_the_brute_force_optimum_on_small_trees(time_limit):
    """Recompute vs the optimum over all trajectory partitions (<= 8 end nodes, budgets in the
    lower half between the longest trajectory and the tree). The greedy alone (time limit 0),
    measured on 300 such cases (seed 1): optimal in 99%, at worst 5 tokens (22% of the longest
    path) and 6% of the total above the optimum; 600 smaller trees (<= 7 end nodes): always
    optimal. With the CP-SAT stage every case here is optimal. Asserted with slack."""
    rng = np.random.default_rng(1)
    checked = optimal_count = 0
    while checked < 100:
        lists = [[99] + t for t in hc.testing.random_token_lists(
            rng, n_traj=int(rng.integers(5, 10)), vocab=3, max_len=int(rng.integers(6, 30)))]
        program = laid_out(hc.TreeBatch.from_trajectories(lists))
        f = program.forest
        longest = int(f.traj_length.max())
        budget = int(rng.integers(longest, longest + (f.num_tokens - longest) // 2 + 1))
        if len(set(f.traj_end_node.tolist())) > 8 or budget >= f.num_tokens:
            continue
        after = SplitOversize(microbatch_tokens=budget, time_limit_s=time_limit).run(program)
        check_split(program, after, budget)
        got = after.forest.num_tokens - f.num_tokens
        best = optimal_recompute(f, budget)
        assert best <= got <= best + longest, (checked, got, best)
        if after.note("split-oversize")["trees_optimal"]:  # proven by the solver or by the lower bound
            assert got == best, (checked, got, best)
        assert got + f.num_tokens <= 1.1 * (best + f.num_tokens), (checked, got, best)
        checked += 1
        optimal_count += got == best
    assert optimal_count >= (100 if time_limit else 90), optimal_count


def test_split_program_round_trips_and_schedules(tmp_path):
    batch = random_batch(4, n_traj=30, max_len=60)
    options = hc.CompileOptions(chunk_size=8, microbatch_tokens=90, dp_size=2)
    plan = hc.compile(batch, options, dump_ir=tmp_path)
    assert plan.program.forest.tree_source is not None
    assert all(mb.compact_tokens <= 90 for mb in plan.microbatches())
    again = hc.compile(batch, options)
    assert [(m.rank, m.slot, m.trees) for m in again.microbatches()] == \
        [(m.rank, m.slot, m.trees) for m in plan.microbatches()]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_lists_strategy(max_traj=10, max_len=30), st.sampled_from([1, 4, 64]), st.data())
def test_microbatch_indices_of_split_plans_restore_every_trajectory(token_lists, chunk, data):
    """Codegen on split plans: each trajectory is one row of one microbatch, its predecessors and
    targets are its own tokens, and multiplicities add up to the trajectory tokens."""
    batch = hc.TreeBatch.from_trajectories(token_lists)
    f = laid_out(batch).forest
    budget = data.draw(st.integers(int(f.traj_length.max()), max(int(f.traj_length.max()),
                                                                   f.num_tokens)))
    plan = hc.compile(batch, hc.CompileOptions(chunk_size=chunk, microbatch_tokens=budget,
                                               dp_size=data.draw(st.integers(1, 3))))
    rows_seen = []
    for mb in plan.microbatches():
        index = mb.build_index()
        index.check()
        assert index.num_tokens == mb.compact_tokens <= budget
        assert int(index.multiplicity.sum()) == int(index.lengths.sum())
        for r, tid in enumerate(index.trajectory_ids):
            traj = token_lists[int(tid)]
            n = len(traj)
            assert int(index.lengths[r]) == n
            pred = index.row_pred[r, 1:n]
            assert index.token_ids[pred].tolist() == traj[:-1]
            assert index.target_token[index.row_target[r, 1:n]].tolist() == traj[1:]
            assert index.positions[pred].tolist() == list(range(n - 1))
        rows_seen += index.trajectory_ids
    assert sorted(rows_seen, key=int) == [str(j) for j in range(len(token_lists))]


def test_solver_stage_time_limit_and_determinism():
    """time limit 0: the greedy split, reported as unproven; with time: the same split twice and
    never more recompute than the greedy (this tight case is not proven optimal in 0.5 s);
    a small case is proven optimal."""
    program = laid_out(random_batch(6, n_traj=40, max_len=80))
    budget = int(program.forest.traj_length.max()) + 20
    greedy = SplitOversize(microbatch_tokens=budget, time_limit_s=0).run(program)
    note = greedy.note("split-oversize")
    assert note["split_trees"] >= 1 and note["trees_optimal"] == note["trees_improved"] == 0
    assert note["trees_greedy"] == note["split_trees"] and note["solver_time_s"] == 0
    first, second = (SplitOversize(microbatch_tokens=budget, time_limit_s=0.5).run(program)
                     for _ in range(2))
    assert first.forest.tree_ids == second.forest.tree_ids
    assert np.array_equal(first.forest.traj_end_node, second.forest.traj_end_node)
    solved = first.note("split-oversize")
    assert solved["deterministic"] and 0 < solved["solver_time_s"] < 1.0
    assert solved["recomputed_tokens"] <= note["recomputed_tokens"]
    check_split(program, first, budget)
    small = laid_out(hc.TreeBatch.from_trajectories([[1] * 10 + [10 + k] * 5 for k in range(4)]))
    proven = SplitOversize(microbatch_tokens=20, time_limit_s=0.5).run(small)
    assert proven.note("split-oversize")["trees_optimal"] == 1
    # a prompt and its branches: the greedy meets the lower bound (one extra trunk per extra part), so
    # no solver runs (GRPO and shared-prompt batches spent the whole time limit proving it)
    assert proven.note("split-oversize")["solver_time_s"] == 0
    assert proven.note("split-oversize")["recomputed_tokens"] == 10
