"""Unit tests of the runtime's ops: tree conv, linear attention over rounds, CPU tree attention,
activation checkpointing, and the clear errors raised before any compute."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harts_compiler.codegen.index import trajectory_index
from harts_compiler.codegen.kernels.causal_conv import tree_causal_conv_reference
from harts_compiler.codegen.kernels.chunk_gdn import (chunk_gated_delta_rule_reference,
                                                      recurrent_gated_delta_rule_reference)
from harts_compiler.codegen.kernels.tree_attention import query_windows, tree_attention_reference
from harts_compiler.runtime import (InvalidBatchError, ModelConfig, TreeModel, UnsupportedModelError,
                                    trajectory_wise)
from harts_compiler.runtime.attention import windowed_tree_attention
from harts_compiler.runtime.ops.linear_attention import gated_delta_rule_rounds
from test_runtime_helpers import cpu_plan, naive_tree_index, random_rollout_batch


def _batch(seed=0, n=7, max_len=19, vocab=3):
    return random_rollout_batch(random.Random(seed), vocab=vocab, n_traj=n, max_len=max_len)


@pytest.mark.parametrize("width", [2, 4])
def test_tree_conv_equals_trajectory_conv1d(width):
    batch = _batch()
    index = naive_tree_index(batch, chunk_size=4, conv_width=width)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(index.num_tokens, 6, generator=gen, dtype=torch.float64)
    weight = torch.randn(6, width, generator=gen, dtype=torch.float64)
    y = tree_causal_conv_reference(x, weight, torch.as_tensor(index.conv_pred))
    for r, traj in enumerate(batch):
        n = len(traj)
        if n < 2:
            continue
        # compact tokens of positions 0..n-2 (predictors), and the last one = any child-free token
        path = index.row_pred[r, 1:n]
        seq = x[path].t()[None]  # [1, Ch, n-1]
        expect = F.silu(F.conv1d(seq, weight[:, None, :], padding=width - 1, groups=6)[..., :n - 1])[0].t()
        assert torch.allclose(y[path], expect, rtol=1e-12, atol=1e-12)


def _gdn_inputs(T, gen, dtype=torch.float64):
    q = torch.randn(T, 2, 8, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(T, 2, 8, generator=gen, dtype=dtype, requires_grad=True)
    v = torch.randn(T, 4, 8, generator=gen, dtype=dtype, requires_grad=True)
    g = (-torch.rand(T, 4, generator=gen, dtype=dtype) * 0.3).requires_grad_()
    beta = torch.rand(T, 4, generator=gen, dtype=dtype).requires_grad_()
    return [q, k, v, g, beta]


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 64])
def test_rounds_with_chunked_and_recurrent_kernels_match_trajectory_wise(chunk_size):
    """Linear attention over a tree's rounds == each trajectory alone (values and input gradients),
    with the chunked reference and with the token-loop oracle."""
    batch = _batch(seed=chunk_size, max_len=23)
    tree = naive_tree_index(batch, chunk_size=chunk_size)
    flat = trajectory_index(batch, chunk_size=chunk_size)
    gen = torch.Generator().manual_seed(1)
    inputs = _gdn_inputs(tree.num_tokens, gen)
    flat_of_tree = _flat_to_tree_map(batch, tree)
    flat_inputs = [x.detach()[flat_of_tree].requires_grad_() for x in inputs]
    weights = torch.randn(flat.num_tokens, 4, 8, generator=gen, dtype=torch.float64)
    for kernel in (None, recurrent_gated_delta_rule_reference):
        for x in inputs + flat_inputs:
            x.grad = None
        o_tree = gated_delta_rule_rounds(*inputs, cpu_plan(tree), scale=0.35, state_dtype=torch.float64,
                                         kernel=kernel)
        o_flat = gated_delta_rule_rounds(*flat_inputs, cpu_plan(flat), scale=0.35, state_dtype=torch.float64,
                                         kernel=kernel)
        torch.testing.assert_close(o_tree[flat_of_tree], o_flat, rtol=1e-10, atol=1e-11)
        (o_tree[flat_of_tree] * weights).sum().backward()
        (o_flat * weights).sum().backward()
        for x_tree, x_flat in zip(inputs, flat_inputs):
            summed = torch.zeros_like(x_tree).index_add(0, flat_of_tree, x_flat.grad)
            torch.testing.assert_close(x_tree.grad, summed, rtol=1e-9, atol=1e-10)


def _flat_to_tree_map(batch, tree):
    """[sum of lengths]: compact tree token of each trajectory token (walk down the tree: the child
    at position p is the token with that id inside the previous token's subtree)."""
    positions, token_ids, subtree_end = tree.positions.tolist(), tree.token_ids.tolist(), tree.subtree_end.tolist()
    out = []
    for traj in batch:
        lo, hi = 0, tree.num_tokens
        for p, t in enumerate(traj):
            node = next(i for i in range(lo, hi) if positions[i] == p and token_ids[i] == t)
            out.append(node)
            lo, hi = node + 1, subtree_end[node]
    return torch.tensor(out)


def test_windowed_attention_equals_dense_reference():
    batch = _batch(seed=4, n=9, max_len=40)
    tree = naive_tree_index(batch, chunk_size=4)
    gen = torch.Generator().manual_seed(2)
    T = tree.num_tokens
    q, k, v = (torch.randn(T, h, 8, generator=gen, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    weight = torch.randn(T, 4, 8, generator=gen, dtype=torch.float64)
    subtree_end = torch.as_tensor(tree.subtree_end)
    expect = tree_attention_reference(q, k, v, subtree_end, scale=0.3)
    expect_grads = torch.autograd.grad((expect * weight).sum(), (q, k, v))
    for block in (1, 7, 256):
        out = windowed_tree_attention(q, k, v, subtree_end, scale=0.3, windows=query_windows(tree.subtree_end, block))
        torch.testing.assert_close(out, expect, rtol=1e-12, atol=1e-12)
        for got, want in zip(torch.autograd.grad((out * weight).sum(), (q, k, v)), expect_grads):
            torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_query_windows_start_at_the_first_key_open_at_the_block_start(seed):
    subtree_end = naive_tree_index(_batch(seed=seed, n=9, max_len=21)).subtree_end
    T = subtree_end.size
    for block in (1, 5, 256):
        expect = []
        for start in range(0, T, block):
            open_keys = [k for k in range(start) if int(subtree_end[k]) > start]
            expect.append((start, min(start + block, T), open_keys[0] if open_keys else start))
        assert query_windows(subtree_end, block) == tuple(expect)


def test_activation_checkpointing_recomputes_rounds_and_gives_same_gradients():
    model = TreeModel.from_config("tiny-qwen3-next", seed=3, dtype=torch.float64)
    batch = _batch(seed=5)
    index = naive_tree_index(batch, chunk_size=4)
    calls = []

    def counting_kernel(*args, **kwargs):
        calls.append(1)
        return chunk_gated_delta_rule_reference(*args, **kwargs)

    grads, counts = [], []
    for checkpointing in (False, True):
        model.zero_grad(set_to_none=True)
        calls.clear()
        out = model(index, activation_checkpointing=checkpointing, gdn_kernel=counting_kernel)
        (out.logprobs.sum() + out.entropy.sum() + out.aux_loss).backward()
        counts.append(len(calls))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert counts[1] == 2 * counts[0]  # every layer's rounds ran again in the backward
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-12, atol=1e-14)


# -- errors before compute ---------------------------------------------------------------------

def test_unsupported_configs_are_named():
    raw = {"model_type": "qwen3_next", "vocab_size": 16, "hidden_size": 8, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "linear_num_key_heads": 1,
           "linear_num_value_heads": 2, "linear_key_head_dim": 4, "linear_value_head_dim": 4,
           "intermediate_size": 8, "num_experts": 0}
    assert ModelConfig.from_dict(raw).layer_types == ("linear_attention", "linear_attention")
    for change, field in [({"model_type": "llama"}, "model_type"), ({"hidden_act": "gelu"}, "hidden_act"),
                          ({"rope_parameters": {"rope_type": "yarn"}}, "rope_type"),
                          ({"layer_types": ["linear_attention", "sliding_attention"]}, "layer_types"),
                          ({"linear_num_value_heads": 3, "linear_num_key_heads": 2}, "linear_num_value_heads"),
                          ({"attention_dropout": 0.1}, "attention_dropout")]:
        with pytest.raises(UnsupportedModelError, match=field):
            ModelConfig.from_dict({**raw, **change})
    with pytest.raises(UnsupportedModelError, match="preset"):
        TreeModel.from_config("tiny-llama")


def test_from_hf_rejects_other_architectures():
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        TreeModel.from_hf(llama)


def test_bad_index_is_rejected_before_compute():
    model = TreeModel.from_config("tiny-qwen3.5", seed=0)

    def exploding_kernel(*args, **kwargs):
        raise AssertionError("compute started")

    with pytest.raises(InvalidBatchError, match="conv_width=3"):
        model(trajectory_index([[1, 2, 3]], conv_width=3), gdn_kernel=exploding_kernel)
    with pytest.raises(InvalidBatchError, match="token id 128"):
        model(trajectory_index([[1, 2, 128]]), gdn_kernel=exploding_kernel)
    with pytest.raises(InvalidBatchError, match="token id -1"):
        model(trajectory_index([[1, -1, 3]]), gdn_kernel=exploding_kernel)
    bad_target = trajectory_index([[1, 2, 3]])
    bad_target.target_token = np.array([2, 128])
    with pytest.raises(InvalidBatchError, match="target_token"):
        model(bad_target, gdn_kernel=exploding_kernel)
    uncovered = trajectory_index([[1, 2, 3]])
    uncovered.rounds[0].own_rows = np.array([0, 1, 1])
    uncovered.rounds[0].own_dst = np.array([0, 1, 1])
    with pytest.raises(ValueError, match="own_dst must cover every compact token"):
        model(uncovered, gdn_kernel=exploding_kernel)
    with pytest.raises(TypeError, match="trajectory_wise"):
        trajectory_wise(model, 42)


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        TreeModel.from_pretrained(tmp_path)


def test_round_reading_a_state_not_yet_exported_is_rejected():
    batch = _batch(seed=5)
    index = naive_tree_index(batch, chunk_size=2)
    later = next(r for r, rnd in enumerate(index.rounds) if (rnd.init_state >= 0).any())
    # make the first round that reads the bank read a state exported by itself or later
    bad = index.rounds[later]
    own_exports = np.concatenate([r.export_bank for r in index.rounds[later:]])
    assert own_exports.size
    bad.init_state = np.where(bad.init_state >= 0, own_exports.max(), bad.init_state)
    with pytest.raises(ValueError, match=rf"rounds\[{later}\].init_state"):
        cpu_plan(index)


def test_plan_and_model_disagreements_are_named():
    """A chunk size the model's Triton GDN kernels do not run, and a plan compiled for other layer counts,
    are errors naming both values, before any compute; CompileOptions.for_model cannot disagree."""
    import harts_compiler as hc
    from harts_compiler.codegen import LaunchTarget, PlanMismatchError, lower

    with pytest.raises(PlanMismatchError, match="chunk_size=32 but the model's Triton GDN kernels run chunk_size=64"):
        lower(trajectory_index([[1, 2, 3]], chunk_size=32), LaunchTarget(vocab_size=8, conv_width=4, gdn_triton=True))
    lower(trajectory_index([[1, 2, 3]], chunk_size=32), LaunchTarget(vocab_size=8, conv_width=4))  # torch: any
    model = TreeModel.from_config("tiny-qwen3-next", seed=0, dtype=torch.float64)
    options = hc.CompileOptions.for_model(model)
    kinds = model.config.layer_types
    assert (options.chunk_size, options.conv_width, options.vocab_size) == (64, 4, 128)
    assert (options.linear_layers, options.full_layers) == (kinds.count("linear_attention"),
                                                          kinds.count("full_attention"))
    batch = hc.TreeBatch.from_trajectories([[1, 2, 3], [1, 2, 4]])
    assert model(hc.compile(batch, options).microbatches()[0]).logprobs.shape == (2, 3)
    other = options.model_copy(update={"linear_layers": options.linear_layers + 1})
    with pytest.raises(InvalidBatchError, match="plan option linear_layers=.* but the model has"):
        model(hc.compile(batch, other).microbatches()[0])
