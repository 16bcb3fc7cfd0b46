"""Rollout-batch generator: determinism, preset statistics, JSONL validity, statistics oracle."""
import json
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_compiler.cli import main
from harts_compiler.generator import PRESETS, batch_stats, gen_main, generate, write_jsonl

# Test scale: every length x0.03 keeps the batch shape (turns, forks, edits) but is tiny.
SMALL = {"swe": dict(scale=0.03), "tau2": dict(tasks=16, scale=0.03),
         "grpo": dict(tasks=16, scale=0.1)}


def _expand_trees(records):
    """Trajectories of explicit-tree records, by id (independent of the compiler's loader)."""
    out = {}
    for tree in records:
        nodes = {n["id"]: n for n in tree["nodes"]}
        for traj in tree["trajectories"]:
            parts, node = [], traj["node"]
            while node is not None:
                parts.append(nodes[node]["tokens"])
                node = nodes[node]["parent"]
            out[traj["id"]] = [t for part in parts[::-1] for t in part]
    return out


def _brute_stats(token_lists):
    """Trie statistics by explicit tuple prefixes (the oracle for `batch_stats`)."""
    prefixes = {tuple(t[:k]) for t in token_lists for k in range(1, len(t) + 1)}
    children = {}
    for p in prefixes:
        children.setdefault(p[:-1], set()).add(p)
    ends = {tuple(t) for t in token_lists}
    boundary = {p for p in prefixes if len(children.get(p, ())) >= 2 or p in ends}
    nodes = len(children[()]) + sum(len(children.get(p, ())) for p in boundary)
    depth = [1 + sum(tuple(t[:k]) in boundary for k in range(1, len(t))) for t in token_lists]
    branching = [len(c) for p, c in children.items() if p != () and len(c) >= 2]
    return dict(compact=len(prefixes), trees=len(children[()]), nodes=nodes, depth_max=max(depth),
                depth_mean=float(np.mean(depth)), branch_points=len(branching),
                branching_max=max(branching, default=0))


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_same_seed_same_batch_other_seed_differs(preset):
    a, b = generate(preset, 3, **SMALL[preset]), generate(preset, 3, **SMALL[preset])
    assert [i for i, _ in a.trajectories] == [i for i, _ in b.trajectories]
    assert all(np.array_equal(x, y) for (_, x), (_, y) in zip(a.trajectories, b.trajectories))
    assert a.trees == b.trees
    c = generate(preset, 4, **SMALL[preset])
    same_shape = len(c.trajectories) == len(a.trajectories) and all(
        np.array_equal(x, y) for (_, x), (_, y) in zip(a.trajectories, c.trajectories))
    assert not same_shape


@pytest.mark.parametrize("preset,low,high", [("swe", 5.0, 6.2), ("tau2", 8.0, 10.0)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compression_within_documented_range(preset, low, high, seed):
    stats = batch_stats(generate(preset, seed, **SMALL[preset]).trajectories)
    assert low <= stats.compression <= high


def test_grpo_compression_is_prompt_sharing_only():
    batch = generate("grpo", 5, **SMALL["grpo"])
    stats = batch_stats(batch.trajectories)
    assert stats.trees == 16 and stats.trajectories == 16 * 8
    # Each tree: one prompt node with 8 response children; compression follows from their sizes.
    traj, compact = 0, 0
    for tree in batch.trees:
        prompt = [n for n in tree["nodes"] if n["parent"] is None]
        responses = [n for n in tree["nodes"] if n["parent"] is not None]
        assert len(prompt) == 1 and len(responses) == 8
        p = len(prompt[0]["tokens"])
        traj += sum(p + len(r["tokens"]) for r in responses)
        compact += p + sum(len(r["tokens"]) for r in responses)
    assert stats.compression == pytest.approx(traj / compact)
    assert 1.0 < stats.compression < 2.0
    assert stats.depth_max == 2 and stats.branching_max == 8


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_trees_hold_the_same_trajectories_and_siblings_differ_at_first_token(preset):
    batch = generate(preset, 1, **SMALL[preset])
    expanded = _expand_trees(batch.trees)
    assert set(expanded) == {i for i, _ in batch.trajectories}
    for traj_id, tokens in batch.trajectories:
        assert expanded[traj_id] == tokens.tolist()
    for tree in batch.trees:
        first = {}
        for node in tree["nodes"]:
            first.setdefault(node["parent"], []).append(node["tokens"][0])
        assert all(len(set(v)) == len(v) for v in first.values())
    # Merged chains: the tree's nodes are exactly the compact trie's nodes.
    stats = batch_stats(batch.trajectories)
    assert stats.nodes == sum(len(t["nodes"]) for t in batch.trees)
    assert stats.compact_tokens == sum(len(n["tokens"]) for t in batch.trees for n in t["nodes"])
    assert stats.trees == len(batch.trees)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_each_preset_is_fast_at_test_scale(preset):
    start = time.perf_counter()
    batch_stats(generate(preset, 0, **SMALL[preset]).trajectories)
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize("form", ["flat", "trees"])
def test_jsonl_is_valid_input(tmp_path, form):
    batch = generate("swe", 0, tasks=3, scale=0.02, vocab_size=1000)
    path = tmp_path / "batch.jsonl"
    write_jsonl(batch, path, form)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    if form == "flat":
        assert [r["id"] for r in records] == [i for i, _ in batch.trajectories]
        assert all(set(r) == {"id", "tokens"} and r["tokens"] for r in records)
        tokens = [t for r in records for t in r["tokens"]]
    else:
        assert all(set(r) == {"id", "nodes", "trajectories"} for r in records)
        tokens = [t for r in records for n in r["nodes"] for t in n["tokens"]]
        assert len(_expand_trees(records)) == len(batch.trajectories)
    assert all(isinstance(t, int) and 0 <= t < 1000 for t in tokens)
    loader = pytest.importorskip("harts_compiler.batch")  # the compiler's validating loader
    loaded = loader.TreeBatch.load(path)
    assert list(loaded.ids) == [i for i, _ in batch.trajectories] or form == "trees"
    assert sorted(loaded.ids) == sorted(i for i, _ in batch.trajectories)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=12))
def test_batch_stats_match_brute_force_trie(token_lists):
    stats = batch_stats([np.array(t) for t in token_lists])
    oracle = _brute_stats(token_lists)
    assert stats.compact_tokens == oracle["compact"]
    assert stats.trees == oracle["trees"]
    assert stats.nodes == oracle["nodes"]
    assert stats.depth_max == oracle["depth_max"]
    assert stats.depth_mean == pytest.approx(oracle["depth_mean"])
    assert stats.branch_points == oracle["branch_points"]
    assert stats.branching_max == oracle["branching_max"]
    assert stats.trajectory_tokens == sum(map(len, token_lists))


def test_bad_parameters_name_the_field():
    with pytest.raises(ValueError, match="preset"):
        generate("nope")
    with pytest.raises(ValueError, match="unknown parameter.*'turn_count'"):
        generate("swe", 0, turn_count=3)
    with pytest.raises(ValueError, match="turns"):
        generate("swe", 0, turns=(5, 2))
    with pytest.raises(ValueError, match="trajectories"):
        batch_stats([])


def test_gen_main_writes_and_prints_statistics(tmp_path, capsys):
    out = tmp_path / "b.jsonl"
    assert gen_main(["--preset", "tau2", "--tasks", "4", "--scale", "0.02", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    for word in ("trajectories", "tokens", "compression", "depth", "branching"):
        assert word in text
    n_traj = int(text.split("trajectories")[1].split()[0])
    assert n_traj == len(out.read_text().splitlines())
    assert main(["gen", "--preset", "swe", "--turns", "9", "3"]) == 2
    assert "harts gen: turns" in capsys.readouterr().err


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_tree_summary_matches_the_tree_records(preset):
    batch = generate(preset, 2, **SMALL[preset])
    summary = batch.tree_summary()
    assert len(summary["compact_tokens"]) == len(batch.trees)
    for t, tree in enumerate(batch.trees):
        nodes = {n["id"]: n for n in tree["nodes"]}

        def start(node_id):  # position of the node's first token
            parent = nodes[node_id]["parent"]
            return 0 if parent is None else start(parent) + len(nodes[parent]["tokens"])

        lengths = {i: len(n["tokens"]) for i, n in nodes.items()}
        pairs = sum(sum(range(start(i) + 1, start(i) + length + 1))
                    for i, length in lengths.items())
        assert summary["compact_tokens"][t] == sum(lengths.values())
        assert summary["attention_pairs"][t] == pairs
        assert summary["trajectories"][t] == len(tree["trajectories"])
    assert summary["trajectory_tokens"].sum() == sum(len(x) for _, x in batch.trajectories)


@pytest.mark.parametrize("form", ["flat", "trees"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_generated_batch_compiles_to_the_same_trie(tmp_path, capsys, preset, form):
    from harts_compiler.cli import main as harts_main
    batch = generate(preset, 6, **dict(SMALL[preset], tasks=3))
    path = tmp_path / "batch.jsonl"
    write_jsonl(batch, path, form)
    capsys.readouterr()
    assert harts_main(["compile", "--json", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    stats = batch_stats(batch.trajectories)
    assert report["trajectories"] == stats.trajectories
    assert report["compact_tokens"] == stats.compact_tokens
    assert report["nodes"] == stats.nodes
    assert report["trees"] == stats.trees


def test_tiny_vocab_is_a_clear_error_not_a_hang():
    with pytest.raises(ValueError, match="vocab_size"):
        generate("grpo", 0, tasks=2, vocab_size=4)  # 8 responses need 8 distinct first tokens
    batch = generate("grpo", 0, tasks=2, vocab_size=9, scale=0.01)
    assert max(int(t.max()) for _, t in batch.trajectories) < 9
