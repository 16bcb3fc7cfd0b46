"""replay-min: rounds equal a brute force over all continuation choices (with an independent
round semantics), and the recorded schedule is feasible under an independent simulator."""
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import harts_compiler as hc
from harts_compiler.driver import program_from_batch
from harts_compiler.passes.layout import Layout
from harts_compiler.passes.prefix_compress import PrefixCompress
from harts_compiler.passes.replay_min import ReplayMin
from harts_compiler.testing import random_token_lists, token_lists_strategy

CHUNKS = [1, 2, 3, 4, 8, 64]


def compile_to(token_lists, chunk_size):
    program = program_from_batch(hc.TreeBatch.from_trajectories(token_lists))
    for p in (PrefixCompress(), Layout(), ReplayMin(chunk_size=chunk_size)):
        program = p.run(program)
        program.verify()
    return program


def min_rounds_brute_force(forest, chunk_size):
    """Minimum over every continuation assignment of the rounds needed, per tree, where a
    sequence starting at boundary b > 0 may run one round after any sequence whose rows cross
    position b-1 of the same path prefix (the state at b is produced there)."""
    children = forest.children()
    choosers = [v for v in range(forest.num_nodes) if children[v]]
    pos, length = forest.node_position.tolist(), forest.node_length.tolist()
    best = {}
    for choice in itertools.product(*[children[v] for v in choosers]):
        cont = dict(zip(choosers, choice))
        heads = [v for v in range(forest.num_nodes)
                 if forest.node_parent[v] < 0 or cont[forest.node_parent[v]] != v]
        seqs = []
        for h in heads:
            path, v = [], h  # node path from the root to the end of h's heavy chain
            u = forest.node_parent[h]
            while u >= 0:
                path.append(u)
                u = forest.node_parent[u]
            path = path[::-1]
            while True:
                path.append(v)
                if v not in cont:
                    break
                v = cont[v]
            tokens = [t for n in path for t in range(forest.node_start[n],
                                                     forest.node_start[n] + length[n])]
            seqs.append((pos[h] // chunk_size * chunk_size, tokens, forest.node_tree[h]))
        rounds = [0 if sigma == 0 else None for sigma, _, _ in seqs]
        changed = True
        while changed:
            changed = False
            for y, (b, path_y, _) in enumerate(seqs):
                for x, (sigma_x, path_x, _) in enumerate(seqs):
                    if rounds[x] is None or not (sigma_x < b <= len(path_x)):
                        continue
                    if path_x[:b] == path_y[:b] and (rounds[y] is None or rounds[x] + 1 < rounds[y]):
                        rounds[y] = rounds[x] + 1
                        changed = True
        assert None not in rounds
        per_tree = {}
        for (_, _, tree), r in zip(seqs, rounds):
            per_tree[tree] = max(per_tree.get(tree, 0), r + 1)
        for tree, r in per_tree.items():
            best[tree] = min(best.get(tree, r), r)
    return [best[t] for t in range(forest.num_trees)]


def path_tokens(forest, i):
    """Compact indices of the path ending at token i, by position."""
    out = []
    while i >= 0:
        out.append(i)
        i = forest.token_pred[i]
    return out[::-1]


def simulate(program):
    """Independent feasibility check of the recorded sequences."""
    forest, seqs = program.forest, program.sequences
    C = seqs.chunk_size
    own_count = np.zeros(forest.num_tokens, np.int64)
    for s in range(seqs.num_sequences):
        rows = seqs.rows(s)
        own = np.arange(seqs.seq_own_start[s], seqs.seq_own_end[s])
        own_count[own] += 1
        path = path_tokens(forest, int(rows[-1]))
        sigma = int(seqs.seq_start_position[s])
        assert sigma % C == 0 and seqs.replay_of(s).size < C
        assert rows.tolist() == path[sigma:]  # replay + own rows = the path from sigma on
        src, offset = int(seqs.seq_init_seq[s]), int(seqs.seq_init_offset[s])
        if sigma == 0:
            assert src == -1
            continue
        assert seqs.seq_round[src] < seqs.seq_round[s]
        assert offset in seqs.exports_of(src).tolist()
        src_rows = seqs.rows(src)
        src_path = path_tokens(forest, int(src_rows[-1]))
        start_src = int(seqs.seq_start_position[src])
        assert start_src + offset == sigma and offset <= src_rows.size
        assert src_path[:sigma] == path[:sigma]  # same state: same path prefix
    assert np.all(own_count == 1)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_lists_strategy(max_traj=7, max_len=14), st.sampled_from(CHUNKS))
def test_rounds_equal_brute_force(token_lists, chunk_size):
    program = compile_to(token_lists, chunk_size)
    forest = program.forest
    children = forest.children()
    assume(np.prod([max(len(k), 1) for k in children], dtype=float) <= 400)
    assert program.sequences.tree_rounds.tolist() == min_rounds_brute_force(forest, chunk_size)
    simulate(program)


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("seed", range(6))
def test_seeded_brute_force(seed, chunk_size):
    token_lists = random_token_lists(np.random.default_rng(100 + seed), n_traj=6, max_len=16)
    program = compile_to(token_lists, chunk_size)
    children = program.forest.children()
    if np.prod([max(len(k), 1) for k in children], dtype=float) <= 2000:
        assert program.sequences.tree_rounds.tolist() == min_rounds_brute_force(program.forest, chunk_size)
    simulate(program)


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_larger_batches_feasible(chunk_size):
    token_lists = random_token_lists(np.random.default_rng(7), n_traj=40, vocab=4, max_len=150)
    simulate(compile_to(token_lists, chunk_size))


def test_known_example_branch_positions():
    # root of 10 tokens, C = 4: children start at position 10 (boundary 8, not the root's
    # start 0) so they need a second round and replay tokens 8, 9.
    root = list(range(10))
    program = compile_to([root + [20, 21], root + [30], root + [40, 41, 42]], 4)
    seqs = program.sequences
    assert seqs.tree_rounds.tolist() == [2]
    assert seqs.num_sequences == 3
    for s in (1, 2):
        assert seqs.seq_start_position[s] == 8 and seqs.seq_init_seq[s] == 0
        assert program.forest.token_position[seqs.replay_of(s)].tolist() == [8, 9]
    assert seqs.exports_of(0).tolist() == [8]
    # branch inside the first chunk: same round, zero state
    program = compile_to([[1, 2, 3], [1, 2, 4]], 4)
    assert program.sequences.tree_rounds.tolist() == [1]


def test_dp_prefers_continuation_that_saves_rounds():
    # Node A (positions 0..3, C=2) has children: a deep chain (which branches again later)
    # and a leaf. Continuing the deep child avoids stacking its rounds behind a new sequence.
    deep = [[1, 1, 1, 1, 2, 2, 2, 2, 3], [1, 1, 1, 1, 2, 2, 2, 2, 4],
            [1, 1, 1, 1, 2, 2, 2, 2, 5, 5, 5, 5, 6], [1, 1, 1, 1, 2, 2, 2, 2, 5, 5, 5, 5, 7]]
    leaf = [[1, 1, 1, 1, 9] + [0] * 30]  # larger subtree: the layout default continues it
    program = compile_to(deep + leaf, 2)
    assert program.sequences.tree_rounds.tolist() == min_rounds_brute_force(program.forest, 2)
