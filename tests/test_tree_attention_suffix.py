"""Queries that are a suffix of the keys (context keys) and q/k head dims that differ from v's (MLA).

The suffix case must equal the all-token case restricted to its last Tq query rows: output rows,
dq rows, and dk / dv of every key (context keys included) with the output gradient of the first
Tk - Tq rows set to zero. Kernels run under TRITON_INTERPRET=1 on CPU (conftest.py) at tiny sizes.
"""
import dataclasses

import numpy as np
import pytest
import torch

from harts_compiler.codegen.kernels.tree_attention import (
    build_block_index, config_for, query_windows, supports_head_dims, tree_attention, tree_attention_reference,
    tree_attention_reference_chunked)
from harts_compiler.codegen.kernels.tree_attention.configs import _launch, uniform_config
from harts_compiler.codegen.kernels.tree_attention.function import uses_triton
from tree_layouts import anchor_tree, layout_from_parents, random_forest

pytestmark = pytest.mark.usefixtures("one_thread")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_inputs(n_keys, heads, dims, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    (hq, hkv), (dqk, dv) = heads, dims
    shapes = [(n_keys, hq, dqk), (n_keys, hkv, dqk), (n_keys, hkv, dv), (n_keys, hq, dv)]
    return [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]


def run(fn, q, k, v, do, subtree_end, **kwargs):
    """[o, dq, dk, dv] of `fn` (tree_attention or a reference) on leaves q, k, v and output gradient do."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, subtree_end, **kwargs)
    return [out.detach(), *torch.autograd.grad(out, leaves, do)]


def suffix_of_full(q, k, v, do, subtree_end, num_queries, fn, **kwargs):
    """(suffix run, full run restricted to the suffix): the two must agree."""
    offset = k.shape[0] - num_queries
    masked_do = do.clone()
    masked_do[:offset] = 0
    full = run(fn, q, k, v, masked_do, subtree_end, **kwargs)
    suffix = run(fn, q[offset:], k, v, do[offset:], subtree_end, **kwargs)
    return suffix, [full[0][offset:], full[1][offset:], full[2], full[3]]


def relative_error(actual, expected):
    scale = expected.double().norm().clamp_min(1e-30)
    return ((actual.double() - expected.double()).norm() / scale).item()


# ---------------------------------------------------------------- reference (float64)
@pytest.mark.parametrize("num_queries", [0, 1, 5, 17, 40])
@pytest.mark.parametrize("dims", [(8, 8), (12, 4)])
def test_reference_suffix_equals_the_full_run_restricted(num_queries, dims):
    layout = random_forest(np.random.default_rng(num_queries), n_trees=3)
    subtree_end = layout.subtree_end_tensor()
    num_queries = min(num_queries, layout.num_tokens)
    q, k, v, do = random_inputs(layout.num_tokens, (4, 2), dims, seed=num_queries)
    for fn, kwargs in ((tree_attention_reference, {}), (tree_attention_reference_chunked, dict(query_chunk=7))):
        suffix, expected = suffix_of_full(q, k, v, do, subtree_end, num_queries, fn, scale=0.3, **kwargs)
        for name, a, b in zip(("o", "dq", "dk", "dv"), suffix, expected):
            assert a.shape == b.shape, name
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


def test_suffix_inputs_are_checked():
    q, k, v, _ = random_inputs(6, (2, 1), (8, 4), seed=0)
    subtree_end = torch.full((6,), 6, dtype=torch.int32)
    with pytest.raises(ValueError, match="Tq=7"):
        tree_attention_reference(torch.randn(7, 2, 8, dtype=torch.float64), k, v, subtree_end, scale=1.0)
    with pytest.raises(ValueError, match="subtree_end"):
        tree_attention_reference(q[2:], k, v, subtree_end[2:], scale=1.0)
    with pytest.raises(ValueError, match="k and v"):
        tree_attention_reference(q, k, v[:5], subtree_end, scale=1.0)
    with pytest.raises(ValueError, match="num_queries"):
        build_block_index(subtree_end, 4, 4, num_queries=7)
    wrong = build_block_index(subtree_end, 16, 16, num_queries=6)
    with pytest.raises(ValueError, match="Tq=6"):
        tree_attention(torch.randn(4, 2, 16), torch.randn(6, 1, 16), torch.randn(6, 1, 16), subtree_end, scale=1.0,
                       block_index=wrong)


@pytest.mark.parametrize("seed", range(3))
def test_query_windows_of_a_suffix(seed):
    layout = random_forest(np.random.default_rng(seed), n_trees=3)
    ends = layout.subtree_end
    n_tokens = layout.num_tokens
    num_queries = n_tokens - int(np.random.default_rng(seed).integers(0, n_tokens))
    windows = query_windows(ends, 8, num_queries=num_queries)
    offset = n_tokens - num_queries
    assert [w[0] for w in windows] == list(range(offset, n_tokens, 8))
    assert windows[-1][1] == n_tokens
    for start, end, lo in windows:
        open_keys = [k for k in range(start) if ends[k] > start]
        assert lo == (open_keys[0] if open_keys else start)
        # no query of the window sees a key before lo
        assert all(not (ends[k] > i) for k in range(lo) for i in range(start, end) if k <= i)
    assert query_windows(ends, 8, num_queries=0) == ()
    assert query_windows(ends, 8) == query_windows(ends, 8, num_queries=n_tokens)


# ---------------------------------------------------------------- kernels (interpreter on CPU)
def small_config(block_m=16, block_n=16, block_ms=16):
    return uniform_config(block_m, block_n, block_ms, num_warps=4, num_stages=1)


def check_kernel(layout, num_queries, heads=(4, 2), dims=(16, 16), config=None, seed=0, index_blocks=None):
    """Kernel suffix run vs the float64 reference suffix, and vs the kernel's own full run."""
    subtree_end = layout.subtree_end_tensor(DEVICE)
    q, k, v, do = random_inputs(layout.num_tokens, heads, dims, seed)
    offset = layout.num_tokens - num_queries
    config = config or small_config()
    scale = dims[0] ** -0.5
    expected = run(tree_attention_reference, q[offset:], k, v, do[offset:], subtree_end.cpu(), scale=scale)
    blocks = index_blocks or (config.block_m, config.block_n)
    index = build_block_index(subtree_end, *blocks, num_queries=num_queries)
    full_index = build_block_index(subtree_end, *blocks)
    as_device = [t.to(DEVICE, torch.float32) for t in (q, k, v, do)]
    assert uses_triton(as_device[0])
    got = run(tree_attention, as_device[0][offset:], *as_device[1:3], as_device[3][offset:], subtree_end, scale=scale,
              block_index=index, config=config)
    masked_do = as_device[3].clone()
    masked_do[:offset] = 0
    full = run(tree_attention, *as_device[:3], masked_do, subtree_end, scale=scale, block_index=full_index,
               config=config)
    full = [full[0][offset:], full[1][offset:], full[2], full[3]]
    for name, a, b, c in zip(("o", "dq", "dk", "dv"), got, expected, full):
        assert a.shape == b.shape, name
        assert torch.isfinite(a).all(), name
        assert relative_error(a.cpu(), b) < 1e-5, f"{name} vs reference: {relative_error(a.cpu(), b):.2e}"
        assert relative_error(a, c) < 1e-5, f"{name} vs full run: {relative_error(a, c):.2e}"
    return got


@pytest.mark.parametrize("num_queries", [48, 37, 5, 0])  # aligned offset, ragged, < one block, empty
def test_kernel_suffix_on_an_anchor_tree(num_queries):
    # T = 33 + 3*21 = 96: offsets 48 (a block multiple), 59, 91, 96
    got = check_kernel(anchor_tree(33, 3, 21), num_queries)
    if num_queries == 0:  # no query: context keys get zero gradients
        assert got[0].shape[0] == 0 and not got[2].any() and not got[3].any()


@pytest.mark.parametrize("seed", range(2))
def test_kernel_suffix_on_random_forests_with_mixed_tiles(seed):
    layout = random_forest(np.random.default_rng(20 + seed), n_trees=3, wide_prob=0.7)
    num_queries = layout.num_tokens - 13 - seed * 7
    # index built at 16 x 16, the kernels derive their tiles' lists with the same suffix
    check_kernel(layout, num_queries, heads=(2, 1), config=small_config(32, 16, 16), seed=seed,
                 index_blocks=(16, 16))


@pytest.mark.parametrize("num_queries", [59, 5])  # ragged offset, < one block
def test_kernel_suffix_with_query_heads_packed(num_queries):
    # forward programs holding 2 query heads of a KV head each (launch "heads")
    config = dataclasses.replace(small_config(), fwd=_launch(16, 16, 4, 1, heads=2))
    check_kernel(anchor_tree(33, 3, 21), num_queries, heads=(4, 2), config=config, seed=6)


def test_kernel_suffix_of_branches_after_a_context_root():
    # the microbatch holds the branches; the root's 40 tokens are context keys from an earlier one
    layout = layout_from_parents([-1] + [0] * 4, [40] + [11] * 4)
    check_kernel(layout, 44, heads=(3, 3), seed=3)


@pytest.mark.parametrize("dims", [(48, 32), (32, 16), (16, 32)])  # split q/k tiles; v narrower; v wider
def test_kernel_mla_head_dims(dims):
    layout = random_forest(np.random.default_rng(31), n_trees=2, wide_prob=0.5)
    check_kernel(layout, layout.num_tokens, heads=(2, 2), dims=dims, seed=4)


def test_kernel_mla_head_dims_with_a_suffix():
    check_kernel(anchor_tree(20, 2, 15), 23, heads=(4, 2), dims=(48, 32), config=small_config(16, 32, 16), seed=5)


def test_mla_head_dims_supported_and_configured():
    assert supports_head_dims(192, 128) and supports_head_dims(48, 32) and supports_head_dims(256)
    assert not supports_head_dims(40, 32) and not supports_head_dims(192) and not supports_head_dims(128, 24)
    assert config_for(192, 128).fwd["block_m"] == 128
    with pytest.raises(ValueError, match="head dims"):
        config_for(40, 32)
