"""Triton KDA kernels (codegen/kernels/chunk_kda) under TRITON_INTERPRET=1 (tests/conftest.py sets it without
CUDA) vs the plain-torch reference, fp32 at tiny sizes: outputs, exported states and every gradient (q, k, v,
g, beta, initial state, with export gradients injected), and a tree plan's outputs == trajectory-wise bit for
bit. This proves the algebra and the index plumbing, not the absence of GPU miscompiles
(tests/test_chunk_kda_gpu.py and bench/kda.py check those on the GPU).
"""
import os

import pytest
import torch

from harts_compiler.codegen.kernels.chunk_gdn import plan_tree_gdn
from harts_compiler.codegen.kernels.chunk_kda import (chunk_kimi_delta_attention, chunk_kimi_delta_attention_reference,
                                                      kimi_delta_attention, plan_kimi_delta_attention_reference)
from harts_compiler.codegen.kernels.upload import to_device
from test_delta_rule_helpers import NAMES, forward_backward, interpreter_inputs
from two_level import run_trajectories, two_level_plan, two_level_round_specs

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def make_inputs(lengths, hk=1, hv=2, kd=16, vd=32, seed=0, decay=0.5):
    def per_channel_log_decay(gen, rows, hv, kd):
        return -torch.rand(rows, hv, kd, generator=gen) * decay
    return interpreter_inputs(lengths, per_channel_log_decay, hk, hv, kd, vd, seed)


def reference_fp64(tensors, cu, export_seq, export_offset, **kw):
    """The chunked reference in fp64: under strong decays fp32 gate cumsums (ours and the fp32 reference alike)
    are only good to ~1e-5 of the largest entry, so fp64 is the fair yardstick."""
    leaves = [t.detach().double().requires_grad_(True) for t in tensors]
    return forward_backward(chunk_kimi_delta_attention_reference, leaves, cu, export_seq, export_offset, **kw)


def assert_all_close(got, want, tol=2e-5):
    """Largest error at most `tol` of the largest entry, per output and gradient."""
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == torch.float32 and torch.isfinite(a).all(), name
        error = float((a.detach().double() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-30))
        assert error < tol, (name, error)


def test_varlen_grouped_heads_exports_all_gradients():
    """Odd lengths (a tail chunk, a sub-chunk sequence, an empty one), HV = 2 HK, l2norm in the kernel, exports
    mid-sequence, at a sequence's end and twice, with their gradients injected."""
    tensors, cu = make_inputs([70, 5, 0, 128])
    export_seq, export_offset = torch.tensor([0, 3, 3, 0]), torch.tensor([64, 128, 64, 64])
    got = forward_backward(chunk_kimi_delta_attention, tensors, cu, export_seq, export_offset, use_qk_l2norm=True)
    want = reference_fp64(tensors, cu, export_seq, export_offset, use_qk_l2norm=True)
    assert got[1].dtype == torch.float32 and got[1].shape == (4, 2, 16, 32)
    assert got[5].shape == (203, 2, 16)  # dg: one gradient per key channel
    assert_all_close(got, want)


def test_head_size_64_with_strong_decays():
    """K = V = 64 (the sub-chunk kernels walk K in two steps) and decays down to -20 per token and channel:
    the in-chunk gaps exp(gc_i - gc_j) span e^-1000, so only the split-point formulation stays finite."""
    tensors, cu = make_inputs([70, 64], hk=1, hv=1, kd=64, vd=64, seed=3, decay=20.0)
    export_seq, export_offset = torch.tensor([1, 0]), torch.tensor([64, 64])
    got = forward_backward(chunk_kimi_delta_attention, tensors, cu, export_seq, export_offset)
    assert_all_close(got, reference_fp64(tensors, cu, export_seq, export_offset), tol=3e-5)


def test_injected_export_gradient_alone():
    """Only the exported states carry gradient (mid-sequence and at the end): it must reach every input."""
    tensors, cu = make_inputs([128], hk=1, hv=1, seed=2)
    export_seq, export_offset = torch.tensor([0, 0]), torch.tensor([64, 128])
    got = forward_backward(chunk_kimi_delta_attention, tensors, cu, export_seq, export_offset, with_do=False)
    want = reference_fp64(tensors, cu, export_seq, export_offset, with_do=False)
    assert got[2].abs().sum() == 0  # q feeds no state
    assert got[3][:64].abs().sum() > 0 and got[5].abs().sum() > 0 and got[7].abs().sum() > 0
    assert_all_close(got, want)


def test_tree_plan_equals_trajectories_bitwise():
    """Two rounds over GDN's tree plan (roots exporting at their last aligned boundary, branches replaying the
    roots' tails from those states; a 10-token root exports nothing and its branch replays all of it):
    outputs bit-equal to the trajectory-wise call, and every input gradient equal to the fp64 reference over
    the same plan."""
    two = two_level_plan([(70, 2, 10), (10, 1, 5)])
    rounds = two_level_round_specs(two)
    plan = to_device(plan_tree_gdn(rounds, two.compact_rows), "cpu")
    tensors, _ = make_inputs([two.compact_rows], hk=1, hv=2, seed=4)  # grouped heads: dk replays summed per group
    leaves = [t.detach().requires_grad_(True) for t in tensors[:5]]
    kw = dict(scale=0.3, use_qk_l2norm=True)
    o_tree, _ = kimi_delta_attention(*leaves, plan=plan, **kw)
    o_traj = run_trajectories(chunk_kimi_delta_attention, two, *leaves, **kw)
    assert plan.rows is not None and plan.rows.num_replays > 0, "the plan must replay rows"
    assert torch.equal(o_traj, o_tree[two.traj_rows]), "tree outputs differ from trajectory-wise"

    weight = torch.randn(o_tree.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = torch.autograd.grad((o_tree.double() * weight).sum(), leaves)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    o_ref, _ = plan_kimi_delta_attention_reference(*ref_leaves, plan=plan, state_dtype=torch.float64, **kw)
    want = torch.autograd.grad((o_ref * weight).sum(), ref_leaves)
    for name, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), (o_tree, *got), (o_ref, *want)):
        error = float((a.detach().double() - b.detach()).abs().max() / b.detach().abs().max())
        assert error < 2e-5, (name, error)


def test_bad_gate_shape_names_g():
    tensors, cu = make_inputs([5])
    q, k, v, g, beta, h0 = tensors
    plan = to_device(plan_tree_gdn(two_level_round_specs(two_level_plan([(5, 1, 3)])), 8), "cpu")
    with pytest.raises(ValueError, match="`g` has shape"):
        kimi_delta_attention(q[:8].detach(), k[:8].detach(), v[:8].detach(), g[:8, :, 0].detach(),
                             beta[:8].detach(), scale=1.0, plan=plan)
