"""Input: JSONL trajectories and explicit trees, validation errors naming line/tree/node/field."""
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import harts_compiler as hc
from harts_compiler import InputError, TreeBatch


def load_lines(*objects):
    return TreeBatch.from_jsonl_lines([o if isinstance(o, str) else json.dumps(o) for o in objects])


def problems_of(*objects):
    with pytest.raises(InputError) as info:
        load_lines(*objects)
    return info.value.problems


def test_flat_trajectories_and_default_ids():
    batch = TreeBatch.from_trajectories([[1, 2], [3]])
    assert batch.ids == ("0", "1") and batch.trajectory(1).tolist() == [3]
    batch = TreeBatch.from_trajectories([np.array([5, 6], np.int32)], ids=["x"])
    assert batch.tokens.dtype == np.int64 and batch.ids == ("x",)


def test_explicit_tree_expands_to_root_to_node_paths():
    tree = {"id": "t", "nodes": [{"id": 0, "parent": None, "tokens": [1, 2]},
                                 {"id": "b", "parent": 0, "tokens": [3]},
                                 {"id": 2, "parent": 0, "tokens": [4, 5]}]}
    batch = load_lines(tree)  # trajectories omitted: every leaf is one
    assert [batch.trajectory(j).tolist() for j in range(len(batch))] == [[1, 2, 3], [1, 2, 4, 5]]
    assert batch.ids == ("t/b", "t/2") and batch.groups == ("t", "t")
    tree["trajectories"] = [{"id": "inner", "node": 0}, {"id": "leaf", "node": 2}]
    batch = load_lines(tree, {"id": "flat", "tokens": [9]})
    assert batch.ids == ("inner", "leaf", "flat")
    assert batch.trajectory(0).tolist() == [1, 2] and batch.lines.tolist() == [1, 1, 2]


def _naive_paths(nodes, ends):
    """Each end's tokens by walking its parents: what tree expansion must equal."""
    by_id = {node["id"]: node for node in nodes}
    out = []
    for end in ends:
        path, node_id = [], end
        while node_id is not None:
            path.append(by_id[node_id]["tokens"])
            node_id = by_id[node_id]["parent"]
        out.append([t for tokens in reversed(path) for t in tokens])
    return out


@settings(max_examples=60, deadline=None)
@given(parents=st.lists(st.integers(0, 10**6), min_size=1, max_size=30), data=st.data())
def test_tree_expansion_matches_parent_walks(parents, data):
    # node j > 0 hangs under a random earlier node; trajectories end at random nodes (repeats, inner nodes)
    nodes = [{"id": j, "parent": None if j == 0 else p % j, "tokens": [j, 100 + j][: 1 + j % 2]}
             for j, p in enumerate(parents)]
    ends = data.draw(st.lists(st.integers(0, len(nodes) - 1), min_size=1, max_size=12))
    tree = {"id": "t", "nodes": nodes, "trajectories": [{"id": f"r{i}", "node": e} for i, e in enumerate(ends)]}
    batch = load_lines(tree)
    assert [batch.trajectory(j).tolist() for j in range(len(batch))] == _naive_paths(nodes, ends)
    leaves = [node["id"] for node in nodes if node["id"] not in {n["parent"] for n in nodes}]
    batch = load_lines({"id": "t", "nodes": nodes})
    assert [batch.trajectory(j).tolist() for j in range(len(batch))] == _naive_paths(nodes, leaves)


def test_chain_with_a_trajectory_at_every_node():
    # 3,000 nodes in a row, a trajectory ending at each: 4.5 M trajectory tokens from 3,000 in the file
    n = 3000
    nodes = [{"id": j, "parent": j - 1 if j else None, "tokens": [j]} for j in range(n)]
    tree = {"id": "comb", "nodes": nodes, "trajectories": [{"id": f"r{j}", "node": j} for j in range(n)]}
    batch = load_lines(tree)
    assert batch.tokens.size == n * (n + 1) // 2
    assert batch.trajectory(n - 1).tolist() == list(range(n)) and batch.trajectory(9).tolist() == list(range(10))


def test_save_load_round_trip(tmp_path):
    tree = {"id": "t", "nodes": [{"id": 0, "parent": None, "tokens": [1, 2]},
                                 {"id": 1, "parent": 0, "tokens": [3]}],
            "trajectories": [{"id": "a", "node": 1}]}
    batch = load_lines({"id": "x", "tokens": [4, 4]}, tree)
    batch.save(tmp_path / "b.jsonl")
    again = TreeBatch.load(tmp_path / "b.jsonl")
    assert again.ids == batch.ids and np.array_equal(again.tokens, batch.tokens)
    assert again.groups == batch.groups


@pytest.mark.parametrize("record, expected", [
    ({"id": "a", "tokens": []}, "line 1 (trajectory): field tokens: empty token list"),
    ({"id": "a", "tokens": [1, 2.5]}, "field tokens[1]"),
    ({"id": "a", "tokens": [1, "2"]}, "field tokens[1]"),
    ({"id": "a", "tokens": [1, -3]}, "field tokens[1]: Input should be greater than or equal to 0"),
    ({"id": 7, "tokens": [1]}, "field id"),
    ({"id": "a"}, "field tokens: Field required"),
    ({"id": "a", "tokens": [1], "reward": [1]}, "field reward"),
    ("{not json", "line 1: invalid JSON"),
    ({"id": "a", "tokens": [2**63]}, "field tokens[0]: Input should be less than or equal to"),
    ('{"id": "a", "nodes": "\xff"}', "line 1"),
    ({"id": "a", "tokens": [1], "nodes": []}, "line 1 (tree 'a'): field tokens: a record is a tree (nodes) or a "
                                              "trajectory (tokens), not both"),
])
def test_bad_trajectory(record, expected):
    problems = problems_of(record)
    assert len(problems) == 1 and expected in problems[0], problems


def node(i, parent, tokens=(1,)):
    return {"id": i, "parent": parent, "tokens": list(tokens)}


@pytest.mark.parametrize("nodes, trajectories, expected", [
    ([node(0, None), node(1, 9)], None, "field nodes[1].parent: node 1 names unknown parent 9"),
    ([node(1, 0), node(2, 0), node(3, 1)], None,                    # the root left out: one line for it
     "field nodes[0].parent: node 1 names unknown parent 0 (as do 1 more node)"),
    ([node(0, None), node(1, 2), node(2, 1)], None, "lies on a parent cycle"),
    ([node(0, None), node(1, 0), node(1, None)], None,
     "nodes[2].parent: node 1 has several parents (0 and None; also listed as nodes[1])"),
    ([node(0, None), node(1, 0), node(1, 0)], None, "field nodes[2].id: duplicate node id 1 (first as nodes[1])"),
    ([node(0, None), node(1, 0, [])], None, "field nodes[1].tokens: empty token list"),
    ([node(0, None)], [{"id": "a", "node": 5}],
     "field trajectories[0].node: trajectory 'a' names unknown node 5"),
    ([node(0, None, [1, -1])], None, "field nodes[0].tokens[1]"),
    ([node(0, None, [2**64])], None, "field nodes[0].tokens[0]"),
])
def test_bad_tree(nodes, trajectories, expected):
    tree = {"id": "T", "nodes": nodes}
    if trajectories is not None:
        tree["trajectories"] = trajectories
    problems = problems_of({"id": "ok", "tokens": [1]}, tree)
    assert len(problems) == 1 and expected in problems[0], problems
    assert all(p.startswith("line 2") for p in problems), problems


def test_duplicate_trajectory_ids_across_records():
    problems = problems_of({"id": "a", "tokens": [1]},
                           {"id": "T", "nodes": [node(0, None)], "trajectories": [{"id": "a", "node": 0}]})
    assert len(problems) == 1 and "duplicate trajectory id 'a'" in problems[0]
    assert problems[0].startswith("line 2") and "first at line 1" in problems[0]
    with pytest.raises(InputError, match="duplicate trajectory id"):
        TreeBatch.from_trajectories([[1], [2]], ids=["x", "x"])


def test_every_problem_reported_once_per_line():
    problems = problems_of({"id": "a", "tokens": []}, {"id": "b", "tokens": [1]},
                           {"id": "c", "tokens": [-1]})
    assert [p.split(":")[0] for p in problems] == ["line 1 (trajectory)", "line 3 (trajectory)"]


def test_python_api_errors():
    with pytest.raises(InputError, match="empty trajectory"):
        TreeBatch.from_trajectories([[1], []])
    with pytest.raises(InputError, match=r"tokens\[1\]: negative token -2"):
        TreeBatch.from_trajectories([[1, -2]])
    with pytest.raises(InputError, match="non-integer"):
        TreeBatch.from_trajectories([[1.5]])
    with pytest.raises(InputError, match="no trajectories"):
        TreeBatch.from_trajectories([])
    with pytest.raises(InputError, match="no trajectories"):
        TreeBatch.from_jsonl_lines(["", "  "])


def test_vocab_bound():
    batch = load_lines({"id": "a", "tokens": [1, 2]}, {"id": "b", "tokens": [1, 99, 100]})
    with pytest.raises(InputError) as info:
        hc.compile(batch, hc.CompileOptions(vocab_size=99))
    assert info.value.problems == ["line 2: trajectory 'b': field tokens[1]: token 99 >= vocab_size 99"]
    hc.compile(batch, hc.CompileOptions(vocab_size=101))


def test_tree_larger_than_microbatch_budget_runs_as_pieces():
    batch = TreeBatch.from_trajectories([[1, 2, 3, 4], [5, 6]], ids=["big", "small"])
    plan = hc.compile(batch, hc.CompileOptions(microbatch_tokens=3, chunk_size=2))
    assert plan.stats["pieces"]["pieces"] == 2 and plan.stats["pieces"]["split_trees"] == 1
    with pytest.raises(InputError, match="microbatch_tokens=3 is smaller than one chunk"):
        hc.CompileOptions.checked(microbatch_tokens=3)


def test_bad_options():
    with pytest.raises(InputError, match="option chunk_size"):
        hc.CompileOptions.checked(chunk_size=0)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=12), st.lists(st.one_of(st.integers(0, 2**70), st.integers(-5, -1),
                                                 st.floats(allow_nan=False, allow_infinity=False)),
                                       max_size=6),
       st.sampled_from(['{"id": %s, "tokens": %s}', '{"tokens": %s, "id": %s}']))
def test_fast_line_parser_agrees_with_pydantic(record_id, tokens, template):
    """The numpy fast path either returns exactly what pydantic validation returns, or declines."""
    from harts_compiler.batch import _fast_trajectory
    from harts_compiler.records import TrajectoryRecord
    from pydantic import ValidationError

    parts = (json.dumps(record_id), json.dumps(tokens))
    line = (template % (parts if template.startswith('{"id"') else parts[::-1])).encode()
    fast = _fast_trajectory(line)
    try:
        record = TrajectoryRecord.model_validate_json(line)
        reference = (record.id, record.tokens)
    except ValidationError:
        reference = None
    if fast is not None:
        assert reference is not None and fast[0] == reference[0]
        assert fast[1].tolist() == reference[1]
    elif reference is not None:
        assert any(t >= 2**63 - 1 for t in reference[1])  # the only valid input it declines
