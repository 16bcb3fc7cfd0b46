"""build_block_index equals a brute-force scan of the dense tree mask."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from harts_compiler.codegen.kernels.tree_attention.block_index import build_block_index
from harts_compiler.codegen.kernels.tree_attention.reference import tree_mask
from tree_layouts import anchor_tree, random_forest


def brute_force_lists(subtree_end, block_m, block_n, num_queries=None):
    """Per query block: (full key blocks, partial key blocks), by scanning every element; the queries are
    the last `num_queries` tokens (all by default), their blocks counted from the first of them."""
    n_tokens = subtree_end.shape[0]
    num_queries = n_tokens if num_queries is None else num_queries
    index = torch.arange(n_tokens)
    mask = tree_mask(subtree_end, index[n_tokens - num_queries:], index)
    n_q, n_k = -(-num_queries // block_m), -(-n_tokens // block_n)
    lists = []
    for m in range(n_q):
        full, partial = [], []
        for n in range(n_k):
            tile = mask[m * block_m:(m + 1) * block_m, n * block_n:(n + 1) * block_n]
            complete = tile.shape == (block_m, block_n)
            if tile.all() and complete:
                full.append(n)
            elif tile.any():
                partial.append(n)
        lists.append((full, partial))
    return lists


def rows_of(ptr, cols, n_full):
    out = []
    for r in range(n_full.shape[0]):
        row = cols[ptr[r]:ptr[r + 1]].tolist()
        out.append((row[:n_full[r]], row[n_full[r]:]))
    return out


def check_index(subtree_end, block_m, block_n, num_queries=None):
    index = build_block_index(subtree_end, block_m, block_n, num_queries=num_queries)
    expected = brute_force_lists(subtree_end, block_m, block_n, num_queries)
    assert rows_of(index.q_ptr, index.q_cols, index.q_full) == expected
    transposed = [([], []) for _ in range(index.num_key_blocks)]
    for m, (full, partial) in enumerate(expected):
        for n in full:
            transposed[n][0].append(m)
        for n in partial:
            transposed[n][1].append(m)
    assert rows_of(index.k_ptr, index.k_rows, index.k_full) == transposed
    counts = (index.q_ptr[1:] - index.q_ptr[:-1])[index.q_order]
    assert (counts[:-1] >= counts[1:]).all()
    assert sorted(index.q_order.tolist()) == list(range(index.num_query_blocks))
    assert sorted(index.k_order.tolist()) == list(range(index.num_key_blocks))
    for t in (index.q_ptr, index.q_cols, index.q_full, index.k_ptr, index.k_rows, index.k_full):
        assert t.dtype == np.int32


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n_trees=st.integers(1, 4),
       block_m=st.sampled_from([1, 2, 4, 8, 16]), block_n=st.sampled_from([1, 2, 4, 8, 16]))
def test_block_index_matches_brute_force_on_random_forests(seed, n_trees, block_m, block_n):
    layout = random_forest(np.random.default_rng(seed), n_trees=n_trees)
    check_index(layout.subtree_end_tensor(), block_m, block_n)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), block_m=st.sampled_from([1, 4, 8, 16]), block_n=st.sampled_from([1, 4, 16]),
       context=st.floats(0.0, 1.0))
def test_block_index_of_a_query_suffix_matches_brute_force(seed, block_m, block_n, context):
    # queries are the last Tq tokens, Tq from 0 to T, the query grid starting at the first of them
    layout = random_forest(np.random.default_rng(seed), n_trees=2)
    num_queries = layout.num_tokens - int(context * layout.num_tokens)
    check_index(layout.subtree_end_tensor(), block_m, block_n, num_queries)
    index = build_block_index(layout.subtree_end_tensor(), block_m, block_n, num_queries=num_queries)
    assert index.query_offset == layout.num_tokens - num_queries
    other = index.with_tiles(layout.subtree_end_tensor(), [(2 * block_m, block_n)]).with_blocks(2 * block_m, block_n)
    assert other.num_queries == num_queries and other.num_query_blocks == -(-num_queries // (2 * block_m))


@pytest.mark.parametrize("block_m, block_n", [(16, 16), (32, 16), (16, 32)])
def test_block_index_on_an_anchor_tree(block_m, block_n):
    check_index(anchor_tree(70, 5, 37).subtree_end_tensor(), block_m, block_n)


def test_block_index_rejects_bad_input():
    with pytest.raises(ValueError, match="block_m"):
        build_block_index(torch.tensor([1], dtype=torch.int32), 3, 4)
    with pytest.raises(ValueError, match="subtree_end"):
        build_block_index(torch.tensor([0, 2], dtype=torch.int32), 4, 4)
    with pytest.raises(ValueError, match="subtree_end"):
        build_block_index(torch.tensor([1.0]), 4, 4)
