"""GPU (H200) bars of docs/design.md section 11 for the runtime with the Triton kernels.

- fp32 on CUDA (the exact torch paths, chunk 64): tree-mode log-probs equal trajectory-wise ones to
  FP32_TOL, and neither mode is further from an fp64 reference than the other times FP32_FACTOR.
- bf16 on CUDA: the tree-mode difference to an fp64 reference is no larger than the
  trajectory-wise bf16 baseline's own difference to it, times BF16_FACTOR.
- A whole bf16 step (lowering and upload included) never waits for the device.
"""
from __future__ import annotations

import random

import pytest
import torch

import harts_compiler as hc
from harts_compiler.runtime import TreeModel, trajectory_wise
from test_runtime_helpers import run_without_device_reads, naive_tree_index, random_rollout_batch

pytestmark = pytest.mark.gpu

# power-of-two head dims so the Triton kernels (not the fallbacks) run
GPU_CONFIG = dict(model_type="qwen3_next", vocab_size=1024, hidden_size=256, intermediate_size=512,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                  linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=2,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                  shared_expert_intermediate_size=128, initializer_range=0.05,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
BF16_FACTOR = 2.0
FP32_TOL = 1e-4
FP32_FACTOR = 2.0


def _batch():
    return random_rollout_batch(random.Random(0), vocab=1024, n_traj=12, max_len=700)


def _run(model, index_or_batch, weights):
    model.zero_grad(set_to_none=True)
    if isinstance(index_or_batch, list):
        out = trajectory_wise(model, index_or_batch)
    else:
        out = model(index_or_batch)
    lp = out.logprobs.float()
    (lp * weights[:, :lp.shape[1]]).sum().add(out.aux_loss.float()).backward()
    grads = {n: p.grad.detach().double() for n, p in model.named_parameters()}
    return lp.detach().double(), grads


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _worst_grad(a, b):
    return max(_rel(a[n], b[n]) for n in b)


def _models():
    # bf16 runs the Triton kernels; fp32 and fp64 the exact torch paths (TreeModel's dispatch)
    return {dtype: TreeModel.from_config(GPU_CONFIG, seed=0, dtype=dtype, device="cuda")
            for dtype in (torch.float64, torch.float32, torch.bfloat16)}


def _tree_flat_reference(dtype):
    """(log-probs, gradients) of tree mode and trajectory-wise mode in `dtype`, and of an fp64 reference."""
    batch = _batch()
    models = _models()
    index = naive_tree_index(batch, chunk_size=64)
    # seeded: the loss weights drew from whatever CUDA RNG state earlier tests left, so the fp32 bar (two
    # rounding noises compared) passed or failed with the test order; over 8 seeds on the H200 the worst
    # gradient's tree / trajectory-wise error ratio ranged 0.6-1.9
    weights = torch.randn(len(batch), max(map(len, batch)), device="cuda",
                          generator=torch.Generator(device="cuda").manual_seed(0))
    reference = _run(models[torch.float64], batch, weights.double())
    return _run(models[dtype], index, weights), _run(models[dtype], batch, weights), reference


def test_tree_equals_trajectory_wise_fp32():
    """fp32 runs the exact torch paths, whose CUDA reductions differ by packing: on the H200 the worst
    parameter gradient of tree vs trajectory-wise differed by 4.8e-4 (CPU: 2.1e-5). Both modes are held to
    the fp64 reference: tree mode may not be further from it than trajectory-wise (x FP32_FACTOR)."""
    (lp_tree, g_tree), (lp_flat, g_flat), (lp_ref, g_ref) = _tree_flat_reference(torch.float32)
    worst = max(g_ref, key=lambda n: _rel(g_tree[n], g_flat[n]))
    print(f"fp32 tree vs trajectory-wise: logprobs rel {_rel(lp_tree, lp_flat):.2e}, worst grad rel "
          f"{_rel(g_tree[worst], g_flat[worst]):.2e} ({worst}); vs fp64: logprobs tree {_rel(lp_tree, lp_ref):.2e} / "
          f"traj {_rel(lp_flat, lp_ref):.2e}, worst grad tree {_worst_grad(g_tree, g_ref):.2e} / "
          f"traj {_worst_grad(g_flat, g_ref):.2e}")
    assert _rel(lp_tree, lp_flat) < FP32_TOL
    assert _rel(lp_tree, lp_ref) <= FP32_FACTOR * _rel(lp_flat, lp_ref) + 1e-6
    assert _worst_grad(g_tree, g_ref) <= FP32_FACTOR * _worst_grad(g_flat, g_ref) + 1e-6


def test_bf16_tree_error_within_trajectory_wise_error():
    (lp_tree, g_tree), (lp_flat, g_flat), (lp_ref, g_ref) = _tree_flat_reference(torch.bfloat16)
    tree_err, flat_err = _rel(lp_tree, lp_ref), _rel(lp_flat, lp_ref)
    tree_g, flat_g = _worst_grad(g_tree, g_ref), _worst_grad(g_flat, g_ref)
    print(f"bf16 vs fp64: logprobs tree {tree_err:.2e} / trajectory-wise {flat_err:.2e}; "
          f"worst grad tree {tree_g:.2e} / trajectory-wise {flat_g:.2e}")
    assert tree_err <= BF16_FACTOR * flat_err
    assert tree_g <= BF16_FACTOR * flat_g


def test_bf16_step_never_waits_for_the_device():
    """A compiled plan's microbatch through the whole model, forward and backward, with the Triton kernels: the
    launch plan is lowered on the host and uploaded from pinned memory, so with CUDA's sync debug mode set to
    "error" no op may read the device back (after a warm-up that compiles the kernels)."""
    batch = _batch()
    model = TreeModel.from_config(GPU_CONFIG, seed=0, dtype=torch.bfloat16, device="cuda")
    plan = hc.compile(hc.TreeBatch.from_trajectories(batch), hc.CompileOptions.for_model(model))
    (microbatch,) = plan.microbatches()

    def step():
        out = model(microbatch)
        (out.logprobs.float().sum() + out.entropy.float().sum() + out.aux_loss.float()).backward()
    run_without_device_reads(step)
