"""GPU checks of the Gluon tree-attention kernels (forward_gluon.py, backward_gluon.py, backward_dkdv_gluon.py, Hopper
only) against the Triton kernels and an fp32 reference: o and lse of the forward, dq and dk/dv of the backward, on
random forests, the odd
anchor tree (sizes not multiples of the blocks), suffix queries, and the benchmark anchor P4096 B8 L3584. Skips
without CUDA or off sm_90 (the kernels use Hopper wgmma / TMA / setmaxnreg). Gluon and Triton run at the same
128 x 64 visit lists.
"""
import math

import numpy as np
import pytest
import torch

from harts_compiler.codegen.kernels.tree_attention import build_block_index, tree_attention_fp32_oracle
from harts_compiler.codegen.kernels.tree_attention.backward import bwd_delta, bwd_dkdv, bwd_dq
from harts_compiler.codegen.kernels.tree_attention.forward import tree_attention_forward
from harts_compiler.codegen.kernels.tree_attention.reference import tree_attention_reference_chunked, tree_mask
from harts_compiler.codegen.kernels.upload import to_device
from tree_layouts import anchor_tree, layout_from_parents, random_forest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="needs an sm_90 (Hopper) GPU"),
]

TRITON_LAUNCH = dict(block_m=128, block_n=64, num_warps=8, num_stages=2)
TRITON_DQ_LAUNCH = dict(block_m=128, block_n=64, num_warps=8, num_stages=1, block_ms=128)  # the shipped dq at 256
TRITON_DKDV_LAUNCH = dict(block_m=128, block_n=64, num_warps=8, num_stages=1, block_ms=128)  # the shipped dk/dv at 256


def gluon_forward():
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from harts_compiler.codegen.kernels.tree_attention.forward_gluon import tree_attention_forward_gluon
    return tree_attention_forward_gluon


def gluon_dq():
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from harts_compiler.codegen.kernels.tree_attention.backward_gluon import bwd_dq_gluon
    return bwd_dq_gluon


def gluon_dkdv():
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from harts_compiler.codegen.kernels.tree_attention.backward_dkdv_gluon import bwd_dkdv_gluon
    return bwd_dkdv_gluon


def relative_error(actual, expected):
    return ((actual.float() - expected).norm() / expected.norm()).item()


def lse_fp32(q, k, subtree_end, scale, chunk=256):
    """[HQ, Tq] base-2 log-sum-exp of the masked scaled scores in fp32 (q: the last Tq of Tk tokens)."""
    n_queries, n_q_heads, _ = q.shape
    n_keys = k.shape[0]
    offset = n_keys - n_queries
    kh = k.float().transpose(0, 1).repeat_interleave(n_q_heads // k.shape[1], dim=0)
    keys = torch.arange(n_keys, device=q.device)
    out = torch.empty(n_q_heads, n_queries, device=q.device)
    for s in range(0, n_queries, chunk):
        e = min(s + chunk, n_queries)
        scores = q[s:e].float().transpose(0, 1) @ kh[:, :offset + e].transpose(1, 2) * scale
        mask = tree_mask(subtree_end, keys[offset + s:offset + e], keys[:offset + e])
        out[:, s:e] = torch.logsumexp(scores.masked_fill(~mask[None], float("-inf")), dim=-1) / math.log(2)
    return out


def case_inputs(layout, heads, head_dim, seed, num_queries=None, value_dim=None, dtype=torch.bfloat16):
    """q [Tq, HQ, D], k [Tk, HKV, D], v [Tk, HKV, DV], do [Tq, HQ, DV] in `dtype` from one seeded generator in that
    order, subtree_end, the scale and the 128 x 64 block index (Tq: the last num_queries tokens, default all)."""
    value_dim = value_dim or head_dim
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n_keys = layout.num_tokens
    n_queries = n_keys if num_queries is None else num_queries
    q = torch.randn(n_queries, heads[0], head_dim, generator=gen, device="cuda").to(dtype)
    k = torch.randn(n_keys, heads[1], head_dim, generator=gen, device="cuda").to(dtype)
    v = torch.randn(n_keys, heads[1], value_dim, generator=gen, device="cuda").to(dtype)
    do = torch.randn(n_queries, heads[0], value_dim, generator=gen, device="cuda").to(dtype)
    subtree_end = layout.subtree_end_tensor("cuda")
    index = to_device(build_block_index(subtree_end, 128, 64, num_queries=n_queries), q.device)
    return q, k, v, do, subtree_end, head_dim ** -0.5, index


def check(layout, heads, head_dim, seed, num_queries=None, value_dim=None, consumers=1, stages=2, dtype=torch.bfloat16):
    """Gluon vs Triton vs fp32: o within 1.1x the Triton forward's error (+1e-4), lse within 1e-3 of fp32."""
    forward_gluon = gluon_forward()
    q, k, v, _, subtree_end, scale, index = case_inputs(layout, heads, head_dim, seed, num_queries, value_dim, dtype)
    n_keys, n_queries = k.shape[0], q.shape[0]

    o_triton, lse_triton = tree_attention_forward(q, k, v, subtree_end, index, scale, TRITON_LAUNCH)
    launch = dict(block_m=128, block_n=64, num_stages=stages, consumers=consumers)
    o_gluon, lse_gluon = forward_gluon(q, k, v, subtree_end, index, scale, launch)
    o_again, lse_again = forward_gluon(q, k, v, subtree_end, index, scale, launch)
    torch.cuda.synchronize()
    assert o_gluon.dtype == q.dtype and o_gluon.shape == o_triton.shape and lse_gluon.shape == lse_triton.shape
    assert torch.isfinite(o_gluon).all() and torch.isfinite(lse_gluon).all()
    assert torch.equal(o_gluon, o_again) and torch.equal(lse_gluon, lse_again), "not bitwise deterministic"

    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # tf32 would make the oracle only ~1e-3 accurate
    try:
        with torch.no_grad():
            o_ref = tree_attention_reference_chunked(q.float(), k.float(), v.float(), subtree_end, scale=scale)
            lse_ref = lse_fp32(q, k, subtree_end, scale)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    err_gluon, err_triton = relative_error(o_gluon, o_ref), relative_error(o_triton, o_ref)
    lse_err_gluon = (lse_gluon - lse_ref).abs().max().item()
    lse_err_triton = (lse_triton - lse_ref).abs().max().item()
    print(f"consumers={consumers} D={head_dim}/{v.shape[2]} Tk={n_keys} Tq={n_queries}"
          f" o err gluon {err_gluon:.2e} triton {err_triton:.2e}"
          f" | lse max err gluon {lse_err_gluon:.2e} triton {lse_err_triton:.2e}"
          f" | o max |gluon - triton| {(o_gluon.float() - o_triton.float()).abs().max().item():.2e}")
    assert err_gluon <= 1.1 * err_triton + 1e-4, f"o: {err_gluon:.2e} vs Triton {err_triton:.2e}"
    assert lse_err_gluon <= 1e-3, f"lse: {lse_err_gluon:.2e} (Triton {lse_err_triton:.2e})"


CONSUMERS = [1, 2]  # one 8-warp consumer partition, or two 4-warp ones
# the dk/dv kernel's partitionings: (consumers, key_major); two key-major partitions hold dK / dV as [keys, dims]
DKDV_PARTITIONS = [(1, False), (2, False), (2, True)]


@pytest.mark.parametrize("consumers", CONSUMERS)
@pytest.mark.parametrize("head_dim, heads", [(256, (16, 2)), (128, (8, 2)), (64, (8, 8))])
def test_gluon_forward_random_forest(head_dim, heads, consumers):
    layout = random_forest(np.random.default_rng(head_dim), n_trees=5, max_nodes=30, max_length=200, wide_prob=0.8)
    check(layout, heads, head_dim, seed=head_dim, consumers=consumers)


@pytest.mark.parametrize("consumers", CONSUMERS)
def test_gluon_forward_odd_anchor_tree(consumers):
    # T = 1023 + 5 * 333: long shared prefix (many full blocks), ragged tails, T not a multiple of a block
    layout = layout_from_parents([-1] + [0] * 5, [1023] + [333] * 5)
    check(layout, (16, 2), 256, seed=3, consumers=consumers)


@pytest.mark.parametrize("consumers", CONSUMERS)
@pytest.mark.parametrize("num_queries", [5 * 333, 5 * 333 + 100, 77])  # offset aligned, ragged, < one block
def test_gluon_forward_suffix_queries(num_queries, consumers):
    layout = layout_from_parents([-1] + [0] * 5, [1023] + [333] * 5)
    check(layout, (16, 2), 256, seed=11, num_queries=num_queries, consumers=consumers)


@pytest.mark.parametrize("consumers", CONSUMERS)
def test_gluon_forward_anchor_p4096_b8_l3584(consumers):
    check(anchor_tree(4096, 8, 3584), (16, 2), 256, seed=5, consumers=consumers)


def test_gluon_forward_single_block():
    # fewer tokens than one block: one visit per program, masked, the prologue and epilogue only
    check(layout_from_parents([-1, 0], [20, 17]), (16, 2), 256, seed=23)


def check_dq(layout, heads, head_dim, seed, num_queries=None, value_dim=None, consumers=1, k_stages=2, v_stages=1,
             dtype=torch.bfloat16):
    """Gluon dq vs Triton bwd_dq vs the fp32 oracle (autograd through the chunked reference): within 1.1x the
    Triton kernel's error (+1e-4), finite, bitwise repeatable. lse and delta come from the Triton forward."""
    dq_gluon_fn = gluon_dq()
    q, k, v, do, subtree_end, scale, index = case_inputs(layout, heads, head_dim, seed, num_queries, value_dim, dtype)
    n_keys, n_queries = k.shape[0], q.shape[0]
    o, lse = tree_attention_forward(q, k, v, subtree_end, index, scale, TRITON_LAUNCH)
    delta = bwd_delta(o, do)
    dq_triton = bwd_dq(q, k, v, do, lse, delta, subtree_end, index, scale, TRITON_DQ_LAUNCH)
    launch = dict(block_m=128, block_n=64, consumers=consumers, k_stages=k_stages, v_stages=v_stages)
    dq_gluon = dq_gluon_fn(q, k, v, do, lse, delta, subtree_end, index, scale, launch)
    dq_again = dq_gluon_fn(q, k, v, do, lse, delta, subtree_end, index, scale, launch)
    torch.cuda.synchronize()
    assert dq_gluon.dtype == q.dtype and dq_gluon.shape == q.shape
    assert torch.isfinite(dq_gluon).all()
    assert torch.equal(dq_gluon, dq_again), "dq not bitwise deterministic"

    dq_ref = tree_attention_fp32_oracle(q, k, v, do, subtree_end, scale=scale)[1]
    err_gluon, err_triton = relative_error(dq_gluon, dq_ref), relative_error(dq_triton, dq_ref)
    print(f"dq consumers={consumers} D={head_dim}/{v.shape[2]} Tk={n_keys} Tq={n_queries}"
          f" err gluon {err_gluon:.2e} triton {err_triton:.2e}"
          f" | max |gluon - triton| {(dq_gluon.float() - dq_triton.float()).abs().max().item():.2e}")
    assert err_gluon <= 1.1 * err_triton + 1e-4, f"dq: {err_gluon:.2e} vs Triton {err_triton:.2e}"


@pytest.mark.parametrize("consumers", CONSUMERS)
@pytest.mark.parametrize("head_dim, heads", [(256, (16, 2)), (128, (8, 2)), (64, (8, 8))])
def test_gluon_dq_random_forest(head_dim, heads, consumers):
    layout = random_forest(np.random.default_rng(head_dim), n_trees=5, max_nodes=30, max_length=200, wide_prob=0.8)
    check_dq(layout, heads, head_dim, seed=head_dim, consumers=consumers)


@pytest.mark.parametrize("consumers", CONSUMERS)
def test_gluon_dq_odd_anchor_tree(consumers):
    layout = layout_from_parents([-1] + [0] * 5, [1023] + [333] * 5)
    check_dq(layout, (16, 2), 256, seed=3, consumers=consumers)


@pytest.mark.parametrize("consumers", CONSUMERS)
@pytest.mark.parametrize("num_queries", [5 * 333, 5 * 333 + 100, 77])
def test_gluon_dq_suffix_queries(num_queries, consumers):
    layout = layout_from_parents([-1] + [0] * 5, [1023] + [333] * 5)
    check_dq(layout, (16, 2), 256, seed=11, num_queries=num_queries, consumers=consumers)


@pytest.mark.parametrize("consumers", CONSUMERS)
def test_gluon_dq_anchor_p4096_b8_l3584(consumers):
    check_dq(anchor_tree(4096, 8, 3584), (16, 2), 256, seed=5, consumers=consumers)


def test_gluon_dq_single_block():
    check_dq(layout_from_parents([-1, 0], [20, 17]), (16, 2), 256, seed=23)


def test_gluon_dq_rejects_head_packing():
    with pytest.raises(ValueError, match="pack"):
        gluon_dq()(*([None] * 8), 1.0, dict(heads=2))


def check_dkdv(layout, heads, head_dim, seed, num_queries=None, value_dim=None, stages=2, consumers=1,
               dtype=torch.bfloat16, key_major=False):
    """Gluon dk/dv vs Triton bwd_dkdv (the same 128 x 64 visit lists) vs the fp32 oracle: each within 1.1x the
    Triton kernel's error (+1e-4), finite, bitwise repeatable, dtypes of k and v. lse and delta from Triton."""
    dkdv_gluon_fn = gluon_dkdv()
    q, k, v, do, subtree_end, scale, index = case_inputs(layout, heads, head_dim, seed, num_queries, value_dim, dtype)
    n_keys, n_queries = k.shape[0], q.shape[0]
    o, lse = tree_attention_forward(q, k, v, subtree_end, index, scale, TRITON_LAUNCH)
    delta = bwd_delta(o, do)
    dk_triton, dv_triton = bwd_dkdv(q, k, v, do, lse, delta, subtree_end, index, scale, TRITON_DKDV_LAUNCH)
    launch = dict(block_m=128, block_n=64, block_ms=64, stages=stages, consumers=consumers, key_major=key_major)
    dk_gluon, dv_gluon = dkdv_gluon_fn(q, k, v, do, lse, delta, subtree_end, index, scale, launch)
    dk_again, dv_again = dkdv_gluon_fn(q, k, v, do, lse, delta, subtree_end, index, scale, launch)
    torch.cuda.synchronize()
    assert dk_gluon.dtype == k.dtype and dk_gluon.shape == k.shape
    assert dv_gluon.dtype == v.dtype and dv_gluon.shape == v.shape
    assert torch.isfinite(dk_gluon).all() and torch.isfinite(dv_gluon).all()
    assert torch.equal(dk_gluon, dk_again) and torch.equal(dv_gluon, dv_again), "dk/dv not bitwise deterministic"

    _, _, dk_ref, dv_ref = tree_attention_fp32_oracle(q, k, v, do, subtree_end, scale=scale)
    for name, gluon, triton_out, ref in (("dk", dk_gluon, dk_triton, dk_ref), ("dv", dv_gluon, dv_triton, dv_ref)):
        err_gluon, err_triton = relative_error(gluon, ref), relative_error(triton_out, ref)
        print(f"{name} consumers={consumers} key_major={key_major} stages={stages} D={head_dim}/{v.shape[2]}"
              f" Tk={n_keys} Tq={n_queries}"
              f" err gluon {err_gluon:.2e} triton {err_triton:.2e}"
              f" | max |gluon - triton| {(gluon.float() - triton_out.float()).abs().max().item():.2e}")
        assert err_gluon <= 1.1 * err_triton + 1e-4, f"{name}: {err_gluon:.2e} vs Triton {err_triton:.2e}"


# consumers 1: one 8-warp partition, S / dP split by key columns; 2: an S / p / dV and a dP / ds / dK partition
@pytest.mark.parametrize("consumers, key_major", DKDV_PARTITIONS)
@pytest.mark.parametrize("head_dim, heads, stages", [(256, (16, 2), 2), (128, (8, 2), 2), (128, (8, 2), 3),
                                                     (64, (8, 8), 2)])
def test_gluon_dkdv_random_forest(head_dim, heads, stages, consumers, key_major):
    layout = random_forest(np.random.default_rng(head_dim), n_trees=5, max_nodes=30, max_length=200, wide_prob=0.8)
    check_dkdv(layout, heads, head_dim, seed=head_dim, stages=stages, consumers=consumers, key_major=key_major)


@pytest.mark.parametrize("consumers, key_major", DKDV_PARTITIONS)
def test_gluon_dkdv_odd_anchor_tree(consumers, key_major):
    layout = layout_from_parents([-1] + [0] * 5, [1023] + [333] * 5)
    check_dkdv(layout, (16, 2), 256, seed=3, consumers=consumers, key_major=key_major)


@pytest.mark.parametrize("consumers, key_major", DKDV_PARTITIONS)
@pytest.mark.parametrize("num_queries", [5 * 333, 5 * 333 + 100, 77])  # offset aligned, ragged, < one block
def test_gluon_dkdv_suffix_queries(num_queries, consumers, key_major):
    # context key blocks that no suffix query sees get zero dk/dv
    layout = layout_from_parents([-1] + [0] * 5, [1023] + [333] * 5)
    check_dkdv(layout, (16, 2), 256, seed=11, num_queries=num_queries, consumers=consumers, key_major=key_major)


@pytest.mark.parametrize("consumers, key_major", DKDV_PARTITIONS)
def test_gluon_dkdv_anchor_p4096_b8_l3584(consumers, key_major):
    check_dkdv(anchor_tree(4096, 8, 3584), (16, 2), 256, seed=5, consumers=consumers, key_major=key_major)


@pytest.mark.parametrize("consumers, key_major", DKDV_PARTITIONS)
def test_gluon_dkdv_single_block(consumers, key_major):
    # fewer tokens than one block: one key block, one masked visit, ragged query and key rows
    check_dkdv(layout_from_parents([-1, 0], [20, 17]), (16, 2), 256, seed=23, consumers=consumers, key_major=key_major)


def test_gluon_dkdv_no_queries():
    # Tq = 0: zeros without a launch, as bwd_dkdv
    layout = layout_from_parents([-1, 0], [100, 50])
    subtree_end = layout.subtree_end_tensor("cuda")
    index = to_device(build_block_index(subtree_end, 128, 64, num_queries=0), "cuda")
    q = torch.empty(0, 16, 256, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(layout.num_tokens, 2, 256, device="cuda").bfloat16()
    lse = torch.empty(16, 0, device="cuda")
    dk, dv = gluon_dkdv()(q, k, k, q, lse, lse, subtree_end, index, 1.0)
    assert dk.shape == k.shape and not dk.any() and not dv.any()


def test_gluon_dkdv_rejects_unsupported():
    fn = gluon_dkdv()
    q = torch.empty(8, 16, 256, device="cuda", dtype=torch.bfloat16)
    k = torch.empty(8, 2, 256, device="cuda", dtype=torch.bfloat16)
    for launch, match in ((dict(heads=2), "pack"), (dict(block_ms=128), "block_ms"),
                          (dict(consumers=2, num_warps=8), "consumers"), (dict(stages=1), "stages"),
                          (dict(key_major=True), "key_major")):
        with pytest.raises(ValueError, match=match):
            fn(q, k, k, q, None, None, None, None, 1.0, launch)
    q = torch.empty(8, 16, 96, device="cuda", dtype=torch.bfloat16)  # 96 = 64 + 32: no Gluon column tiles for it
    v = torch.empty(8, 2, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head dim"):
        fn(q, q[:, :2], v, v, None, None, None, None, 1.0)


# MLA (q/k head dim 192 = column tiles 128 + 64, v head dim 128): every kernel, both partitionings, the ring depths
# the MLA launches may use, suffix queries and the anchor tree
MLA = dict(head_dim=192, value_dim=128)


@pytest.mark.parametrize("consumers", CONSUMERS)
@pytest.mark.parametrize("stages", [2, 3])
def test_gluon_mla_forward(consumers, stages):
    layout = random_forest(np.random.default_rng(192), n_trees=5, max_nodes=30, max_length=200, wide_prob=0.8)
    check(layout, (8, 8), seed=192, consumers=consumers, stages=stages, **MLA)


@pytest.mark.parametrize("consumers", CONSUMERS)
@pytest.mark.parametrize("k_stages, v_stages", [(2, 1), (2, 2), (3, 2)])
def test_gluon_mla_dq(consumers, k_stages, v_stages):
    layout = random_forest(np.random.default_rng(193), n_trees=5, max_nodes=30, max_length=200, wide_prob=0.8)
    check_dq(layout, (8, 8), seed=193, consumers=consumers, k_stages=k_stages, v_stages=v_stages, **MLA)


@pytest.mark.parametrize("consumers, key_major", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("stages", [2, 3])
def test_gluon_mla_dkdv(consumers, key_major, stages):
    layout = random_forest(np.random.default_rng(194), n_trees=5, max_nodes=30, max_length=200, wide_prob=0.8)
    check_dkdv(layout, (8, 8), seed=194, consumers=consumers, stages=stages, key_major=key_major, **MLA)


@pytest.mark.parametrize("num_queries", [5 * 333 + 100, 77])
def test_gluon_mla_suffix_queries(num_queries):
    layout = layout_from_parents([-1] + [0] * 5, [1023] + [333] * 5)
    check(layout, (16, 16), seed=31, num_queries=num_queries, consumers=2, **MLA)
    check_dq(layout, (16, 16), seed=31, num_queries=num_queries, **MLA)
    check_dkdv(layout, (16, 16), seed=31, num_queries=num_queries, consumers=2, **MLA)
    check_dkdv(layout, (16, 16), seed=31, num_queries=num_queries, consumers=2, key_major=True, **MLA)


def test_gluon_mla_anchor_p4096_b8_l3584():
    layout = anchor_tree(4096, 8, 3584)
    check(layout, (16, 16), seed=37, consumers=2, **MLA)
    check_dq(layout, (16, 16), seed=37, **MLA)
    check_dkdv(layout, (16, 16), seed=37, consumers=2, **MLA)


def test_gluon_kernels_in_fp16():
    # fp16 runs the same kernels (hopper_launches admits it): every kernel against Triton and fp32, GQA and MLA
    layout = random_forest(np.random.default_rng(16), n_trees=4, max_nodes=20, max_length=200, wide_prob=0.8)
    for shape in (dict(heads=(16, 2), head_dim=256), dict(heads=(8, 8), **MLA)):
        check(layout, seed=16, consumers=2, dtype=torch.float16, **shape)
        check_dq(layout, seed=16, dtype=torch.float16, **shape)
        check_dkdv(layout, seed=16, consumers=2, dtype=torch.float16, **shape)


@pytest.mark.parametrize("head_dim, value_dim, heads", [(256, 256, (16, 2)), (192, 128, (16, 16))])
def test_tree_attention_runs_the_gluon_kernels(head_dim, value_dim, heads):
    # the public entry point on Hopper: bf16 at head dim 256 and MLA's 192 / 128 goes through the Gluon kernels
    # (bitwise their output and gradients), a config without Gluon launches through the Triton ones, and head
    # dims whose launches are not tested (256 / 128) stay on Triton
    import dataclasses

    from harts_compiler.codegen.kernels.tree_attention import config_for, tree_attention
    from harts_compiler.codegen.kernels.tree_attention.function import hopper_launches
    layout = random_forest(np.random.default_rng(29), n_trees=3, wide_prob=0.6)
    subtree_end = layout.subtree_end_tensor("cuda")
    gen = torch.Generator(device="cuda").manual_seed(29)
    q, k, v, do = (torch.randn(layout.num_tokens, h, d, generator=gen, device="cuda").bfloat16()
                   for h, d in ((heads[0], head_dim), (heads[1], head_dim), (heads[1], value_dim),
                                (heads[0], value_dim)))
    config, scale = config_for(head_dim, value_dim), head_dim ** -0.5
    assert hopper_launches(q, v, config) == config.gluon
    assert hopper_launches(q.new_empty(1, 1, 256), q.new_empty(1, 1, 128), config_for(256, 128)) is None
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = tree_attention(*leaves, subtree_end, scale=scale)
    grads = torch.autograd.grad(out, leaves, do)
    index = to_device(build_block_index(subtree_end, 128, 64), "cuda")
    o, lse = gluon_forward()(q, k, v, subtree_end, index, scale, config.gluon["fwd"])
    delta = bwd_delta(o, do)
    dq = gluon_dq()(q, k, v, do, lse, delta, subtree_end, index, scale, config.gluon["dq"])
    dk, dv = gluon_dkdv()(q, k, v, do, lse, delta, subtree_end, index, scale, config.gluon["dkdv"])
    for ours, direct in zip((out, *grads), (o, dq, dk, dv)):
        assert torch.equal(ours, direct)
    triton_config = dataclasses.replace(config, gluon=None)
    triton_out = tree_attention(q, k, v, subtree_end, scale=scale, config=triton_config)
    host_end = subtree_end.cpu()
    triton_index = to_device(build_block_index(host_end, 64, 64).with_tiles(host_end, config.tiles), "cuda")
    assert torch.equal(triton_out, tree_attention_forward(q, k, v, subtree_end, triton_index, scale, config.fwd)[0])
