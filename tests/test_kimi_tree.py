"""Kimi Linear and Ling 3.0 (KDA + MLA + grouped-routing MoE): tree mode == trajectory-wise mode, fp64, on the
tricky trees: log-probs, entropy, every parameter gradient and the expert loads that update the routing bias;
the MLA rope variant, recomputation, the KDA token loop as the kernel; configs the runtime must refuse."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from harts_compiler.codegen.kernels.chunk_kda import recurrent_kimi_delta_attention_reference
from harts_compiler.runtime import ModelConfig, TreeModel, UnsupportedModelError, trajectory_wise
from harts_compiler.runtime.config import PRESETS
from harts_compiler.runtime.weights import randomise_for_verification_
from test_runtime_helpers import naive_tree_index
from test_runtime_tree import assert_tree_equals_trajectory_wise, compiled_index, rel, tricky_batches

PRESET = "tiny-kimi-linear"


@pytest.mark.parametrize("name,chunk_size", [(n, 4) for n in tricky_batches(4)] + [("branch_on_chunk_boundary", 64)])
def test_tricky_cases_fp64(name, chunk_size):
    batch = tricky_batches(chunk_size)[name]
    assert_tree_equals_trajectory_wise(batch, naive_tree_index(batch, chunk_size=chunk_size), dtype=torch.float64,
                                       chunk_size=chunk_size, preset=PRESET)


@pytest.mark.parametrize("name", ["branch_on_chunk_boundary", "replay_across_short_nodes"])
def test_ling_3_fp64(name):
    batch = tricky_batches(4)[name]
    assert_tree_equals_trajectory_wise(batch, compiled_index(batch, 4), dtype=torch.float64, chunk_size=4,
                                       preset="tiny-ling-3")


def test_compiled_plan_with_recomputation_fp64():
    batch = tricky_batches(4)["replay_across_short_nodes"]
    assert_tree_equals_trajectory_wise(batch, compiled_index(batch, 4), dtype=torch.float64, chunk_size=4,
                                       checkpointing=True, preset=PRESET)


def test_fp32():
    batch = tricky_batches(4)["prefix_and_duplicate_trajectories"]
    assert_tree_equals_trajectory_wise(batch, naive_tree_index(batch, chunk_size=4), dtype=torch.float32,
                                       chunk_size=4, preset=PRESET)


def _model(**changes):
    config = dataclasses.replace(ModelConfig.from_dict(PRESETS[PRESET]), **changes)
    model = TreeModel.from_config(config, seed=3, dtype=torch.float64)
    return randomise_for_verification_(model, 3)


def test_expert_loads_count_each_token_once_per_trajectory():
    batch = tricky_batches(4)["prefix_and_duplicate_trajectories"]
    model = _model()
    tree = model(naive_tree_index(batch, chunk_size=4))
    per_trajectory = sum(trajectory_wise(model, [t], chunk_size=4).expert_load for t in batch)
    assert torch.equal(tree.expert_load, per_trajectory)
    assert tree.expert_load.sum(1).eq(2 * sum(map(len, batch))).all()  # top-2 of every token of every trajectory


def test_mla_rope_on_the_rope_part_at_tree_depth():
    """mla_use_nope=False: RoPE on the rope parts at each token's trajectory position. Tree == trajectory-wise,
    and the result differs from NoPE (the rotation is applied)."""
    batch = tricky_batches(4)["branch_in_first_chunk"]
    model = _model(mla_use_nope=False)
    index = naive_tree_index(batch, chunk_size=4)
    tree, flat = model(index), trajectory_wise(model, batch, chunk_size=4)
    order = [tree.trajectory_ids.index(t) for t in flat.trajectory_ids]
    assert rel(tree.logprobs[order], flat.logprobs) < 1e-10
    nope = _model()(index)
    assert rel(tree.logprobs, nope.logprobs) > 1e-3


def test_token_loop_kernel_equals_chunked_rounds():
    batch = tricky_batches(4)["branch_on_chunk_boundary"]
    model = _model()
    index = naive_tree_index(batch, chunk_size=4)
    chunked = model(index).logprobs
    looped = model(index, kda_kernel=recurrent_kimi_delta_attention_reference).logprobs
    assert rel(looped, chunked) < 1e-12


@pytest.mark.parametrize("change,field", [
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(moe_router_activation_func="softmax"), "moe_router_activation_func"),
    (dict(mlp_layer_types=["dense", "sparse"]), "mlp_layer_types"),
    (dict(layer_types=["linear_attention"] * 3 + ["mamba"]), "layer_types"),
    (dict(num_expert_group=3), "num_expert_group"),
    (dict(topk_group=5), "topk_group"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
    (dict(vocab_size=None), "vocab_size"),
])
def test_unsupported_configs_name_the_field(change, field):
    with pytest.raises(UnsupportedModelError, match=rf"^config\.{field}"):
        ModelConfig.from_dict({**PRESETS[PRESET], **change})


def test_ling_rope_scaling_is_refused():
    with pytest.raises(UnsupportedModelError, match=r"^config\.rope_parameters\.rope_type"):
        ModelConfig.from_dict({**PRESETS["tiny-ling-3"], "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})


def test_planned_embedding_leaves_the_padding_row_without_gradient():
    """The segment_add embedding backward with padding_idx == F.embedding's (transformers' padding_idx)."""
    from harts_compiler.codegen import trajectory_index
    from harts_compiler.runtime.ops.embedding import _PlannedEmbedding
    from test_runtime_helpers import cpu_plan

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU
    plan = cpu_plan(trajectory_index([[3, 1, 3, 3], [0, 1, 7]]), vocab_size=9).to(device)
    weight = torch.randn(9, 5, dtype=torch.float32, device=device, requires_grad=True)
    grad = torch.randn(7, 5, device=device)
    got, = torch.autograd.grad((_PlannedEmbedding.apply(weight, plan, 3) * grad).sum(), weight)
    want, = torch.autograd.grad((torch.nn.functional.embedding(plan.token_ids, weight, padding_idx=3) * grad).sum(),
                                weight)
    torch.testing.assert_close(got, want)
    assert got[3].abs().sum() == 0 and got[1].abs().sum() > 0
