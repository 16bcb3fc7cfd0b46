"""layout: preorder with continuation first, contiguous subtrees and heavy paths, exact restoration
of every trajectory, tree mask = ancestor-or-self, conv predecessors and log-prob targets."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import harts_compiler as hc
from harts_compiler.driver import program_from_batch
from harts_compiler.passes.layout import Layout, lay_out
from harts_compiler.passes.prefix_compress import PrefixCompress
from harts_compiler.testing import brute_force_prefix_ids, random_token_lists, token_lists_strategy


def laid_out(token_lists, conv_width=4):
    program = program_from_batch(hc.TreeBatch.from_trajectories(token_lists))
    program = Layout(conv_width=conv_width).run(PrefixCompress().run(program))
    program.verify()
    return program.forest


def check_layout(token_lists, conv_width=4):
    forest = laid_out(token_lists, conv_width)
    distinct, per_traj = brute_force_prefix_ids(token_lists)
    T = forest.num_tokens
    prefix_of = [None] * T  # the distinct prefix each compact token stands for
    conv = forest.conv_pred()
    target_src, target_token, token_target = forest.targets()
    assert target_src.size == T - forest.num_trees
    assert len(set(zip(target_src.tolist(), target_token.tolist()))) == target_src.size
    for j, tokens in enumerate(token_lists):
        rows = forest.trajectory_compact_indices(j)
        # exact restoration: tokens, positions, one prefix per compact token
        assert forest.token_ids[rows].tolist() == list(tokens)
        assert forest.token_position[rows].tolist() == list(range(len(tokens)))
        for p, i in enumerate(rows.tolist()):
            assert prefix_of[i] in (None, per_traj[j][p])
            prefix_of[i] = per_traj[j][p]
            expect = [rows[q] if q >= 0 else -1 for q in range(p - conv_width + 1, p)]
            assert conv[i].tolist() == expect
            if p == 0:
                assert token_target[i] == -1
            else:
                t = token_target[i]
                assert (target_src[t], target_token[t]) == (rows[p - 1], tokens[p])
        assert forest.traj_run_ptr[j + 1] - forest.traj_run_ptr[j] >= 1
    assert None not in prefix_of and len(set(prefix_of)) == T == len(distinct)
    # tree mask: k visible from q iff k's prefix is a prefix of q's (ancestor-or-self)
    end = forest.node_subtree_end[forest.token_node]
    for q in range(T):
        for k in range(T):
            ancestor = prefix_of[q][:len(prefix_of[k])] == prefix_of[k]
            assert (k <= q < end[k]) == ancestor
    # multiplicity of a token: trajectories through it
    counts = {}
    for prefixes in per_traj:
        for prefix in prefixes:
            counts[prefix] = counts.get(prefix, 0) + 1
    mult = forest.node_multiplicity[forest.token_node]
    assert [counts[prefix_of[i]] for i in range(T)] == mult.tolist()
    return forest


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_lists_strategy())
def test_layout_properties(token_lists):
    check_layout(token_lists)


@pytest.mark.parametrize("conv_width", [1, 2, 4, 5])
def test_conv_widths(conv_width):
    check_layout(random_token_lists(np.random.default_rng(conv_width), n_traj=10), conv_width)


def test_heavy_paths_contiguous_and_continuation_first():
    forest = check_layout([[1, 2, 3, 4, 5, 6], [1, 2, 7], [1, 2, 3, 8], [9, 9]])
    for v in range(forest.num_nodes):
        c = forest.node_cont_child[v]
        if c >= 0:
            assert forest.node_start[c] == forest.node_start[v] + forest.node_length[v]
    # default continuation = smallest subtree: [7] (1 token) before [3 4 5 6] (5 tokens incl. 8)
    root_cont = forest.node_cont_child[0]
    assert forest.token_ids[forest.node_start[root_cont]] == 7


def test_relayout_with_given_continuations_keeps_trajectories():
    token_lists = [[1, 2, 3], [1, 2, 4, 4], [1, 5]]
    forest = laid_out(token_lists)
    children = forest.children()
    cont = forest.node_cont_child.copy()
    for v, kids in enumerate(children):
        if len(kids) > 1:
            cont[v] = kids[-1]
    relaid = lay_out(forest, forest.conv_width, cont)
    relaid.verify()
    assert not np.array_equal(relaid.token_ids, forest.token_ids)
    for j, tokens in enumerate(token_lists):
        assert relaid.token_ids[relaid.trajectory_compact_indices(j)].tolist() == tokens
