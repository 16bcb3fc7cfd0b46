"""Triton tree attention (forward, dq, dk, dv) vs the float64 reference.

On CPU these run under TRITON_INTERPRET=1 (set by conftest.py) at tiny sizes; they prove the
indexing, masking and online-softmax logic, not the GPU compilation (see test_tree_attention_gpu.py).
"""
import dataclasses

import numpy as np
import pytest
import torch

from harts_compiler.codegen.kernels.tree_attention.block_index import build_block_index
from harts_compiler.codegen.kernels.tree_attention.configs import GLUON_HEAD_DIMS, _launch, config_for, uniform_config
from harts_compiler.codegen.kernels.tree_attention.function import hopper_launches, tree_attention, uses_triton
from harts_compiler.codegen.kernels.tree_attention.reference import tree_attention_reference
from tree_layouts import anchor_tree, layout_from_parents, random_forest

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def small_config(block_m, block_n, block_ms):
    return uniform_config(block_m, block_n, block_ms, num_warps=4, num_stages=1)


def relative_error(actual, expected):
    return ((actual.double() - expected).norm() / expected.norm()).item()


def check_against_reference(subtree_end, heads, head_dim, config, *, dtype=torch.float32,
                            seed=0, tolerance=1e-5, use_default_index=False, index_blocks=None):
    n_tokens = subtree_end.shape[0]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n_tokens, heads[0], head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(n_tokens, heads[1], head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(n_tokens, heads[1], head_dim, generator=gen, dtype=torch.float64)
    do = torch.randn(n_tokens, heads[0], head_dim, generator=gen, dtype=torch.float64)
    scale = head_dim ** -0.5
    leaves = [t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v)]
    subtree_end = subtree_end.to(DEVICE)
    assert uses_triton(leaves[0])
    index_blocks = index_blocks or (config.block_m, config.block_n) if config else None
    index = None if use_default_index else build_block_index(subtree_end, *index_blocks)
    o = tree_attention(*leaves, subtree_end, scale=scale, block_index=index, config=config)
    # poison check: every output row must have been written with a finite value
    assert torch.isfinite(o).all()
    grads = torch.autograd.grad(o, leaves, do.to(DEVICE, dtype))
    oracle_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o_ref = tree_attention_reference(*oracle_leaves, subtree_end.cpu(), scale=scale)
    grads_ref = torch.autograd.grad(o_ref, oracle_leaves, do)
    for name, actual, expected in zip(("o", "dq", "dk", "dv"), (o, *grads), (o_ref, *grads_ref)):
        assert actual.dtype == dtype
        err = relative_error(actual.cpu(), expected)
        assert err < tolerance, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("seed", range(4))
def test_random_forests_gqa(seed):
    # several trees, single-token nodes, a wide hub node; T is whatever the forest gives (odd too)
    layout = random_forest(np.random.default_rng(100 + seed), n_trees=3, wide_prob=0.7)
    check_against_reference(layout.subtree_end_tensor(), (4, 2), 16, small_config(16, 16, 16),
                            seed=seed)


@pytest.mark.parametrize("block_m, block_n, block_ms", [(32, 16, 16), (16, 32, 16), (32, 32, 32)])
def test_block_shapes(block_m, block_n, block_ms):
    layout = random_forest(np.random.default_rng(7), n_trees=2, wide_prob=1.0)
    # the index is built at 16 x 16; the kernels derive their own tiles' lists from it
    check_against_reference(layout.subtree_end_tensor(), (2, 1), 32,
                            small_config(block_m, block_n, block_ms), index_blocks=(16, 16))


@pytest.mark.parametrize("block_m, heads", [(16, 2), (16, 4), (32, 2)])
def test_forward_with_query_heads_packed(block_m, heads):
    # one forward program per `heads` query heads of a KV head: its tokens of each in the score rows
    layout = random_forest(np.random.default_rng(3), n_trees=3, wide_prob=0.7)
    config = dataclasses.replace(small_config(16, 16, 16), fwd=_launch(block_m, 16, 4, 1, heads=heads))
    check_against_reference(layout.subtree_end_tensor(), (8, 2), 16, config, index_blocks=(16, 16))


def test_packing_that_does_not_divide_the_group_runs_unpacked():
    # 4 heads per program on groups of 2: one head of 4 x 16 = 64 tokens a program, the tile `tiles` lists
    layout = random_forest(np.random.default_rng(3), n_trees=1, wide_prob=0.7)
    config = dataclasses.replace(small_config(16, 16, 16), fwd=_launch(16, 16, 4, 1, heads=4))
    assert (64, 16) in config.tiles
    check_against_reference(layout.subtree_end_tensor(), (4, 2), 16, config, use_default_index=True)
    with pytest.raises(ValueError, match="heads=3"):
        dataclasses.replace(config, fwd=_launch(16, 16, 4, 1, heads=3))


def test_wide_tree_of_single_token_children():
    # one root of 5 tokens with 40 single-token children: every child block is partial
    layout = layout_from_parents([-1] + [0] * 40, [5] + [1] * 40)
    check_against_reference(layout.subtree_end_tensor(), (3, 3), 16, small_config(16, 16, 16))


def test_anchor_shape_with_full_blocks():
    # long prefix: many fully unmasked blocks exercise the unmasked loops, T = 33 + 3*21 = 96
    layout = anchor_tree(33, 3, 21)
    index = build_block_index(layout.subtree_end_tensor(), 16, 16)
    assert int(index.q_full.sum()) > 0 and int(index.k_full.sum()) > 0
    check_against_reference(layout.subtree_end_tensor(), (4, 1), 16, small_config(16, 16, 16))


def test_bfloat16_inputs():
    layout = random_forest(np.random.default_rng(5), n_trees=2)
    check_against_reference(layout.subtree_end_tensor(), (2, 2), 16, small_config(16, 16, 16),
                            dtype=torch.bfloat16, tolerance=2e-2)


def test_default_config_builds_its_own_index():
    layout = random_forest(np.random.default_rng(9), n_trees=2)
    check_against_reference(layout.subtree_end_tensor(), (2, 1), 64, None, use_default_index=True)


def test_float64_runs_the_reference():
    q = torch.randn(5, 2, 8, dtype=torch.float64)
    assert not uses_triton(q)
    out = tree_attention(q, q, q, torch.full((5,), 5, dtype=torch.int32), scale=1.0)
    torch.testing.assert_close(out, tree_attention_reference(q, q, q, torch.full((5,), 5), scale=1.0))


def test_block_index_for_another_sequence_is_rejected():
    q = torch.randn(6, 2, 16)
    wrong = build_block_index(torch.full((5,), 5, dtype=torch.int32), 16, 16)
    with pytest.raises(ValueError, match="block_index"):
        tree_attention(q, q, q, torch.full((6,), 6, dtype=torch.int32), scale=1.0,
                       block_index=wrong)
    with pytest.raises(ValueError, match="head dim"):
        tree_attention(torch.randn(6, 2, 24), torch.randn(6, 2, 24), torch.randn(6, 2, 24),
                       torch.full((6,), 6, dtype=torch.int32), scale=1.0)


def test_unaligned_inputs_read_through_descriptors():
    # tensor descriptors need a 16-byte aligned base: views that start 4 bytes into their storage give the same
    # outputs and gradients as aligned copies (the kernels' host side copies them first)
    layout = anchor_tree(24, 3, 20)
    subtree_end = layout.subtree_end_tensor().to(DEVICE)
    n, config = layout.num_tokens, small_config(16, 16, 16)
    gen = torch.Generator().manual_seed(3)

    def unaligned(heads):
        storage = torch.randn(n * heads * 16 + 1, generator=gen).to(DEVICE)
        return storage[1:].view(n, heads, 16)

    q, k, v = unaligned(4), unaligned(2), unaligned(2)
    assert k.data_ptr() % 16 and v.data_ptr() % 16
    do = torch.randn(n, 4, 16, generator=gen).to(DEVICE)
    results = []
    for inputs in ((q, k, v), tuple(t.clone() for t in (q, k, v))):
        leaves = [t.detach().requires_grad_() for t in inputs]
        o = tree_attention(*leaves, subtree_end, scale=0.25, config=config)
        results.append([o, *torch.autograd.grad(o, leaves, do)])
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_gluon_launches_only_on_hopper_for_16_bit_inputs():
    # the Gluon kernels run only where hopper_launches says so: never for CPU tensors (the interpreter runs the
    # Triton kernels), never for a config without Gluon launches (head dims 64 / 128, benchmark overrides)
    shipped = config_for(256)
    assert set(shipped.gluon) == {"fwd", "dq", "dkdv"}
    assert all((g["block_m"], g["block_n"]) in shipped.tiles for g in shipped.gluon.values())
    assert config_for(128).gluon is None and set(config_for(192, 128).gluon) == {"fwd", "dq", "dkdv"}
    q = torch.zeros(4, 2, 256, dtype=torch.bfloat16)
    assert hopper_launches(q, q, shipped) is None
    assert config_for(256, 128).gluon is not None  # the 256 config serves (256, 128) too, but not on Gluon:
    assert (256, 128) not in GLUON_HEAD_DIMS and (192, 128) in GLUON_HEAD_DIMS  # its launches are not tested there
    assert hopper_launches(q, q, dataclasses.replace(shipped, gluon=None)) is None


def test_shipped_gluon_dkdv_launches_validate():
    # each shipped dk/dv launch passes the kernel's own checks (key-major at head dim 256 needs two consumers); the
    # checks are host code, so this runs wherever Gluon's Hopper module imports
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from harts_compiler.codegen.kernels.tree_attention.backward_dkdv_gluon import dkdv_launch
    for dims in GLUON_HEAD_DIMS:
        launch = dkdv_launch(config_for(*dims).gluon["dkdv"])
        assert launch["consumers"] == 2 and launch["key_major"] == (dims == (256, 256))
    with pytest.raises(ValueError, match="key_major needs consumers 2"):
        dkdv_launch(dict(consumers=1, key_major=True))
