"""Plain-torch KDA (codegen/kernels/chunk_kda): chunked == token loop, GDN as the special case of g equal over K,
and a tree plan's rounds == one trajectory-wise launch, outputs and gradients (fp64, 1e-12)."""
from __future__ import annotations

import pytest
import torch

from harts_compiler.codegen.kernels.chunk_gdn import (chunk_gated_delta_rule_reference, plan_single_call,
                                                      plan_tree_gdn)
from harts_compiler.codegen.kernels.chunk_kda import (chunk_kimi_delta_attention_reference,
                                                      plan_kimi_delta_attention_reference,
                                                      recurrent_kimi_delta_attention_reference)


def _inputs(lengths, hk=2, hv=2, kd=8, vd=6, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(lengths)
    q = torch.randn(rows, hk, kd, generator=gen, dtype=dtype)
    k = torch.randn(rows, hk, kd, generator=gen, dtype=dtype)
    v = torch.randn(rows, hv, vd, generator=gen, dtype=dtype)
    g = -torch.rand(rows, hv, kd, generator=gen, dtype=dtype) * 0.7  # decays spread over the channels
    beta = torch.rand(rows, hv, generator=gen, dtype=dtype)
    h0 = torch.randn(len(lengths), hv, kd, vd, generator=gen, dtype=dtype)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    return q, k, v, g, beta, h0, cu


def _rel(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 16])
@pytest.mark.parametrize("hv", [2, 4])
def test_chunked_equals_token_loop(chunk_size, hv):
    lengths = [9, 1, 20, 4]
    q, k, v, g, beta, h0, cu = _inputs(lengths, hv=hv)
    seqs, offsets = zip(*[(s, o) for s, n in enumerate(lengths) for o in range(chunk_size, n + 1, chunk_size)][:5])
    kwargs = dict(scale=0.3, initial_state=h0, cu_seqlens=cu, export_seq=torch.tensor(seqs),
                  export_offset=torch.tensor(offsets), chunk_size=chunk_size, use_qk_l2norm=True)
    o, states = chunk_kimi_delta_attention_reference(q, k, v, g, beta, **kwargs)
    o_loop, states_loop = recurrent_kimi_delta_attention_reference(q, k, v, g, beta, **kwargs)
    assert _rel(o, o_loop) < 1e-12 and _rel(states, states_loop) < 1e-12


def test_gdn_is_kda_with_equal_channel_decays():
    lengths = [7, 10]
    q, k, v, g, beta, h0, cu = _inputs(lengths)
    scalar = g[..., 0]
    kwargs = dict(scale=0.5, initial_state=h0, cu_seqlens=cu, chunk_size=4, use_qk_l2norm=True)
    o_kda, _ = chunk_kimi_delta_attention_reference(q, k, v, scalar[..., None].expand_as(g), beta, **kwargs)
    o_gdn, _ = chunk_gated_delta_rule_reference(q, k, v, scalar, beta, **kwargs)
    assert _rel(o_kda, o_gdn) < 1e-12


def test_bad_gate_shape_names_g():
    q, k, v, g, beta, h0, cu = _inputs([5])
    with pytest.raises(ValueError, match="`g` has shape"):
        chunk_kimi_delta_attention_reference(q, k, v, g[..., 0], beta, scale=1.0, initial_state=h0, cu_seqlens=cu)


class _Round:
    """One round of a hand-made plan (the fields of codegen.index.LinearRound)."""

    def __init__(self, **fields):
        import numpy as np
        for name, value in fields.items():
            setattr(self, name, np.asarray(value, dtype=np.int64))


def test_two_round_tree_plan_equals_trajectories_with_gradients():
    """A prefix of 8 tokens (chunk 4) shared by two continuations: round 0 runs the prefix and exports its state
    at offset 8, round 1 runs both suffixes from it. Outputs and every input gradient equal running the two
    trajectories on their own."""
    C, prefix, tails = 4, 8, [5, 3]
    total = prefix + sum(tails)
    q, k, v, g, beta, _, _ = _inputs([total], seed=3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    rounds = [
        _Round(cu_seqlens=[0, prefix], row_src=list(range(prefix)), own_rows=list(range(prefix)),
               own_dst=list(range(prefix)), init_state=[-1], export_seq=[0], export_offset=[prefix], export_bank=[0]),
        _Round(cu_seqlens=[0, tails[0], total - prefix], row_src=list(range(prefix, total)),
               own_rows=list(range(total - prefix)), own_dst=list(range(prefix, total)), init_state=[0, 0],
               export_seq=[], export_offset=[], export_bank=[]),
    ]
    plan = plan_tree_gdn(rounds, total, chunk_size=C)
    o_tree, _ = plan_kimi_delta_attention_reference(*leaves, scale=0.4, plan=plan, use_qk_l2norm=True)
    weight = torch.randn(o_tree.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    tree_grads = torch.autograd.grad((o_tree * weight).sum(), leaves)

    # trajectory-wise: [prefix | tail0] and [prefix | tail1] as two sequences of one launch
    rows = torch.cat([torch.arange(prefix + tails[0]), torch.arange(prefix), torch.arange(prefix + tails[0], total)])
    flat_leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    gathered = [t[rows] for t in flat_leaves]
    lengths = [prefix + tails[0], prefix + tails[1]]
    flat_plan = plan_single_call(lengths, chunk_size=C)
    o_flat, _ = plan_kimi_delta_attention_reference(*gathered, scale=0.4, plan=flat_plan, use_qk_l2norm=True,
                                                    initial_states=torch.zeros(2, 2, 8, 6, dtype=torch.float64))
    keep = torch.cat([torch.arange(prefix + tails[0]), prefix + tails[0] + prefix + torch.arange(tails[1])])
    assert _rel(o_tree, o_flat[keep]) < 1e-12
    # the tree loss counts the shared prefix once; trajectory-wise it weighs the prefix of trajectory 0
    flat_weight = torch.zeros_like(o_flat)
    flat_weight[keep] = weight
    flat_grads = torch.autograd.grad((o_flat * flat_weight).sum(), flat_leaves)
    for name, a, b in zip("qkvgb", tree_grads, flat_grads):
        assert _rel(a, b) < 1e-12, name
