"""KDA Triton kernels on CUDA in bf16: every output and gradient vs the fp32 reference, against fla's own
chunk_kda error where fla is installed, and tree == trajectory bitwise (Hopper miscompiles show here, not under
the interpreter). bench/kda.py times the same kernels against fla at H200 sizes.
"""
import pytest
import torch
import torch.nn.functional as F

from harts_compiler.codegen.kernels.chunk_gdn import plan_tree_gdn
from harts_compiler.codegen.kernels.chunk_kda import (KDAKernelConfig, chunk_kimi_delta_attention,
                                                      chunk_kimi_delta_attention_reference, kimi_delta_attention)
from harts_compiler.codegen.kernels.upload import to_device
from test_delta_rule_helpers import NAMES, cuda_inputs, rel, run_call
from two_level import run_trajectories, two_level_plan, two_level_round_specs

pytestmark = pytest.mark.gpu

# bf16 inputs and bf16 dot operands: fla's GDN lands at 1e-3 .. 5e-3 of the norm on such data (tests of
# chunk_gdn); the bound where fla is not installed
BOUND = 1e-2


def make_inputs(lengths, hk, hv, kd=128, vd=128, seed=0, decay=1.0):
    """Kimi-like gates: g = decay * logsigmoid(N(0, 1)) per key channel (about -0.7 on average, down to ~-5)."""
    def kimi_gate(gen, rows, hv, kd):
        return F.logsigmoid(torch.randn(rows, hv, kd, device="cuda", generator=gen)) * decay
    return cuda_inputs(lengths, kimi_gate, hk, hv, kd, vd, seed)


@pytest.mark.parametrize("dims,decay", [((128, 128), 1.0), ((64, 64), 1.0), ((128, 128), 8.0)],
                         ids=["K128", "K64", "K128-strong-decays"])
def test_bf16_matches_fp32_reference(dims, decay):
    kd, vd = dims
    lengths = [1000, 1, 64, 63, 700, 1300]
    tensors, cu = make_inputs(lengths, hk=2, hv=4, kd=kd, vd=vd, decay=decay)
    exports = dict(export_seq=torch.tensor([0, 0, 4, 5, 2]), export_offset=torch.tensor([64, 960, 640, 1280, 64]))
    ours = run_call(chunk_kimi_delta_attention, tensors, cu, exports)
    ref = run_call(chunk_kimi_delta_attention_reference, tensors, cu, exports, upcast=True)
    for name, a, b in zip(NAMES, ours, ref):
        assert torch.isfinite(a).all(), name
        assert rel(a, b) < BOUND, (name, rel(a, b))


def test_errors_not_above_fla():
    fla_kda = pytest.importorskip("fla.ops.kda")
    lengths = [1500, 130, 999]
    tensors, cu = make_inputs(lengths, hk=4, hv=4, seed=3)  # fla 0.6.0: one value head per key head

    def fla_call(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, use_qk_l2norm, **_):
        o, final = fla_kda.chunk_kda(q[None], k[None], v[None], g[None], beta[None], scale=scale,
                                     initial_state=initial_state, output_final_state=True,
                                     use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=cu_seqlens.long())
        return o[0], final[:0]  # fla exports no mid-sequence state
    ref = run_call(chunk_kimi_delta_attention_reference, tensors, cu, {}, upcast=True)
    ours = run_call(chunk_kimi_delta_attention, tensors, cu, {})
    theirs = run_call(fla_call, tensors, cu, {})
    for name, a, b, r in zip(NAMES, ours, theirs, ref):
        if name == "exported":
            continue
        assert rel(a, r) <= 1.5 * rel(b, r) + 1e-4, (name, rel(a, r), rel(b, r))


def test_tree_equals_trajectories_bitwise():
    """GDN's tree plan of two-level trees run by the one-Function path: outputs bit-equal to trajectory-wise,
    gradients within the bf16 bound of each other (the duplicate rows' sums are ordered differently)."""
    two = two_level_plan([(1000, 4, 777), (64, 3, 100), (37, 2, 50), (4096, 2, 130)], device="cuda")
    plan = to_device(plan_tree_gdn(two_level_round_specs(two), two.compact_rows), "cuda")
    tensors, _ = make_inputs([two.compact_rows], hk=4, hv=4, seed=5)
    leaves = [t.detach().requires_grad_(True) for t in tensors[:5]]
    kw = dict(scale=0.088, use_qk_l2norm=True)
    o_traj = run_trajectories(chunk_kimi_delta_attention, two, *leaves, **kw)
    o_tree, _ = kimi_delta_attention(*leaves, plan=plan, **kw)
    assert torch.equal(o_traj, o_tree[two.traj_rows])
    do = torch.randn(o_traj.shape, device="cuda")
    g_traj = torch.autograd.grad((o_traj.float() * do).sum(), leaves)
    d_tree = torch.zeros(o_tree.shape, device="cuda").index_add_(0, two.traj_rows, do)
    g_tree = torch.autograd.grad((o_tree.float() * d_tree).sum(), leaves)
    for name, a, b in zip(NAMES[2:], g_tree, g_traj):
        assert rel(a, b) < BOUND, name


@pytest.mark.parametrize("config", [KDAKernelConfig(intra_block_k=16, intra_fwd_warps=4, intra_bwd_warps=8,
                                                    diag_bwd_heads=2, diag_bwd_warps=2),
                                    KDAKernelConfig(out_block_v=32, bwd_block_v=32, wy_bwd_warps=8, diag_bwd_heads=8,
                                                    intra_bwd_warps=4)],
                         ids=["intra-bk16", "bv32"])
def test_other_launch_configs(config):
    """Other fixed launches compile to the same algebra (a miscompile of one tile shape shows here)."""
    lengths = [700, 65, 300]
    tensors, cu = make_inputs(lengths, hk=2, hv=2, seed=7)
    exports = dict(export_seq=torch.tensor([0, 2]), export_offset=torch.tensor([640, 256]))
    ours = run_call(chunk_kimi_delta_attention, tensors, cu, exports, config=config)
    ref = run_call(chunk_kimi_delta_attention_reference, tensors, cu, exports, upcast=True)
    for name, a, b in zip(NAMES, ours, ref):
        assert rel(a, b) < BOUND, (name, rel(a, b))
