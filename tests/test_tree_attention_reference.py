"""The plain-torch tree attention equals per-trajectory causal attention on random forests."""
import numpy as np
import pytest
import torch

from harts_compiler.codegen.kernels.tree_attention.reference import (
    tree_attention_fp32_oracle, tree_attention_reference, tree_attention_reference_chunked)
from tree_layouts import anchor_tree, layout_from_parents, random_forest


def causal_attention_per_path(q, k, v, path, scale):
    """Trajectory-wise oracle: ordinary causal softmax attention over one path's tokens."""
    group = q.shape[1] // k.shape[1]
    qp = q[path].transpose(0, 1)
    kp = k[path].repeat_interleave(group, dim=1).transpose(0, 1)
    vp = v[path].repeat_interleave(group, dim=1).transpose(0, 1)
    out = torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale)
    return out.transpose(0, 1)


def random_qkv(n_tokens, n_q_heads, n_kv_heads, head_dim, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n_tokens, n_q_heads, head_dim, generator=gen, dtype=dtype)
    k = torch.randn(n_tokens, n_kv_heads, head_dim, generator=gen, dtype=dtype)
    v = torch.randn(n_tokens, n_kv_heads, head_dim, generator=gen, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_reference_matches_trajectory_wise_attention(seed, heads):
    layout = random_forest(np.random.default_rng(seed), n_trees=3)
    q, k, v = random_qkv(layout.num_tokens, *heads, 8, seed=seed)
    subtree_end = layout.subtree_end_tensor()
    scale = 8 ** -0.5
    dense = tree_attention_reference(q, k, v, subtree_end, scale=scale)
    chunked = tree_attention_reference_chunked(q, k, v, subtree_end, scale=scale, query_chunk=7)
    covered = torch.zeros(layout.num_tokens, dtype=torch.bool)
    for path in layout.paths:
        index = torch.as_tensor(path)
        expected = causal_attention_per_path(q, k, v, index, scale)
        torch.testing.assert_close(dense[index], expected, rtol=1e-10, atol=1e-10)
        covered[index] = True
    assert covered.all(), "every compact token lies on some trajectory"
    torch.testing.assert_close(chunked, dense, rtol=1e-12, atol=1e-12)


def test_chunked_gradients_match_dense():
    layout = random_forest(np.random.default_rng(11), n_trees=2)
    q, k, v = random_qkv(layout.num_tokens, 4, 2, 8)
    subtree_end = layout.subtree_end_tensor()
    grads = []
    for fn in (tree_attention_reference,
               lambda *a, **kw: tree_attention_reference_chunked(*a, **kw, query_chunk=5)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, subtree_end, scale=0.3)
        out.backward(torch.ones_like(out).cumsum(0).sin())
        grads.append([t.grad for t in leaves])
    for dense_grad, chunked_grad in zip(*grads):
        torch.testing.assert_close(chunked_grad, dense_grad, rtol=1e-12, atol=1e-12)


def test_fp32_oracle_gives_output_and_gradients_in_fp32():
    layout = random_forest(np.random.default_rng(12), n_trees=2)
    q, k, v = random_qkv(layout.num_tokens, 4, 2, 8, dtype=torch.bfloat16, seed=3)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).bfloat16()
    subtree_end = layout.subtree_end_tensor()
    got = tree_attention_fp32_oracle(q, k, v, do, subtree_end, scale=0.3, query_chunk=5)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out = tree_attention_reference(*leaves, subtree_end, scale=0.3)
    expected = [out, *torch.autograd.grad(out, leaves, do.double())]
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, expected):
        assert a.dtype == torch.float32 and not a.requires_grad, name
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5, msg=name)


def test_chunked_runs_at_a_few_thousand_tokens():
    layout = anchor_tree(1024, 4, 768)  # 4096 compact tokens
    q, k, v = random_qkv(layout.num_tokens, 4, 2, 16, dtype=torch.float32)
    out = tree_attention_reference_chunked(q, k, v, layout.subtree_end_tensor(), scale=0.25)
    last_branch = torch.as_tensor(layout.paths[-1])
    expected = causal_attention_per_path(q, k, v, last_branch, 0.25)
    torch.testing.assert_close(out[last_branch], expected, rtol=1e-5, atol=1e-5)


def test_layout_subtree_end_of_a_small_tree():
    # root(2) -> a(1) -> b(2); root -> c(1): preorder root, a, b, c
    layout = layout_from_parents([-1, 0, 1, 0], [2, 1, 2, 1])
    assert layout.subtree_end.tolist() == [6, 6, 5, 5, 5, 6]
    assert [p.tolist() for p in layout.paths] == [[0, 1, 2, 3, 4], [0, 1, 5]]


@pytest.mark.parametrize("bad, field", [
    (lambda q, k, v, s: (q[..., :4], k, v, s), "k shape"),
    (lambda q, k, v, s: (q[:, :3], k, v, s), "multiple"),
    (lambda q, k, v, s: (q, k, v, s[:-1]), "subtree_end"),
    (lambda q, k, v, s: (q, k, v, s.float()), "subtree_end"),
    (lambda q, k, v, s: (q, k.float(), v, s), "dtype"),
])
def test_bad_input_names_the_field(bad, field):
    q, k, v = random_qkv(5, 4, 2, 8)
    s = torch.full((5,), 5, dtype=torch.int32)
    with pytest.raises(ValueError, match=field):
        tree_attention_reference(*bad(q, k, v, s), scale=1.0)
