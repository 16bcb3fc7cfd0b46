"""prefix-compress: canonical forest, compact tokens = distinct prefixes, merges across groups."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import harts_compiler as hc
from harts_compiler.ir import IRError, Program
from harts_compiler.passes.prefix_compress import PrefixCompress, lexicographic_order
from harts_compiler.driver import program_from_batch
from harts_compiler.testing import brute_force_prefix_ids, random_token_lists, token_lists_strategy


def compress(token_lists, ids=None):
    program = PrefixCompress().run(program_from_batch(hc.TreeBatch.from_trajectories(token_lists, ids)))
    program.verify()
    return program.forest


def node_path_tokens(forest, v):
    parts = []
    while v >= 0:
        s, n = forest.node_start[v], forest.node_length[v]
        parts.append(forest.token_ids[s:s + n])
        v = forest.node_parent[v]
    return np.concatenate(parts[::-1]).tolist()


def check_against_brute_force(token_lists):
    forest = compress(token_lists)
    distinct, _ = brute_force_prefix_ids(token_lists)
    assert forest.num_tokens == len(distinct)
    assert forest.num_trees == len({t[0] for t in token_lists})
    for j, tokens in enumerate(token_lists):
        assert node_path_tokens(forest, forest.traj_end_node[j]) == list(tokens)
        assert forest.traj_length[j] == len(tokens)
    # multiplicity of a node = trajectories having the node's full path as a prefix
    for v in range(forest.num_nodes):
        path = node_path_tokens(forest, v)
        expected = sum(1 for t in token_lists if list(t[:len(path)]) == path)
        assert forest.node_multiplicity[v] == expected


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_lists_strategy())
def test_compact_tokens_equal_distinct_prefixes(token_lists):
    check_against_brute_force(token_lists)


@pytest.mark.parametrize("seed", range(20))
def test_seeded_random_batches(seed):
    check_against_brute_force(random_token_lists(np.random.default_rng(seed), n_traj=12, max_len=40))


def test_canonical_shapes():
    # identical trajectories share their end node; a strict prefix ends at an inner node
    forest = compress([[1, 2, 3], [1, 2, 3], [1, 2], [1, 2, 4, 5], [9]])
    assert forest.traj_end_node[0] == forest.traj_end_node[1]
    inner = forest.traj_end_node[2]
    assert forest.node_length[inner] == 2 and forest.node_multiplicity[inner] == 4
    assert forest.num_trees == 2 and forest.num_tokens == 2 + 1 + 2 + 1
    assert forest.tree_ids == ["0", "4"]


def test_merges_across_groups_and_names_trees_after_first_record():
    batch = hc.TreeBatch.from_jsonl_lines([
        '{"id": "t1", "nodes": [{"id": 0, "parent": null, "tokens": [7, 7, 1]}, '
        '{"id": 1, "parent": 0, "tokens": [2]}, {"id": 2, "parent": 0, "tokens": [3]}]}',
        '{"id": "t2", "nodes": [{"id": "a", "parent": null, "tokens": [7, 7]}, '
        '{"id": "b", "parent": "a", "tokens": [1, 2, 9]}]}',
    ])
    forest = PrefixCompress().run(program_from_batch(batch)).forest
    assert forest.num_trees == 1 and forest.tree_ids == ["t1"]
    # explicit trees are canonicalised: [7,7,1] and [7,7],[1,2,9] share 7 7 1 2
    assert forest.num_tokens == len(brute_force_prefix_ids(
        [[7, 7, 1, 2], [7, 7, 1, 3], [7, 7, 1, 2, 9]])[0])


def test_lexicographic_order_matches_python_sort():
    rng = np.random.default_rng(3)
    lists = [rng.integers(0, 2**33, rng.integers(1, 6)).tolist() for _ in range(50)]
    lists += [[5], [5, 0], [5, 0, 0]]
    tokens = np.concatenate([np.asarray(t, np.int64) for t in lists])
    offsets = np.concatenate([[0], np.cumsum([len(t) for t in lists])])
    order = lexicographic_order(tokens, offsets)
    assert [lists[i] for i in order] == sorted(lists)


def test_verify_rejects_non_canonical_forest():
    forest = compress([[1, 2, 3], [1, 2, 4]])
    # split the root into two single-child nodes: still a valid tree, but not maximal
    broken = forest.replace(node_length=np.array([1, 1, 1, 1]), node_parent=np.array([-1, 0, 3, 3]),
                            node_position=np.array([0, 1, 2, 2]))
    with pytest.raises(IRError):
        Program(forest=broken).verify()


def test_requires_input_trajectories():
    forest = compress([[1, 2]])
    with pytest.raises(ValueError, match="prefix-compress"):
        PrefixCompress().run(Program(forest=forest))
