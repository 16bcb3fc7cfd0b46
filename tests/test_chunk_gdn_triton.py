"""Triton Gated DeltaNet kernels under TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA) vs the reference.

Tiny sizes: this proves the algebra and the index plumbing, not the absence of GPU miscompiles
(tests/test_chunk_gdn_gpu.py and bench/gdn.py check those on the H200).
"""
import pytest
import torch

from harts_compiler.codegen.kernels.chunk_gdn import (
    GDNKernelConfig,
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_reference,
    prepare_gdn_index,
)
from harts_compiler.codegen.kernels.chunk_gdn.chunk_bwd import chunk_bwd
from harts_compiler.codegen.kernels.chunk_gdn.l2norm import group_sum, l2norm_rows, l2norm_rows_backward
from harts_compiler.codegen.kernels.scaled16 import ScaledRows
from harts_compiler.codegen.kernels.chunk_gdn.state_bwd import state_bwd
from harts_compiler.codegen.kernels.chunk_gdn.state_fwd import output_fwd, state_fwd
from harts_compiler.codegen.kernels.chunk_gdn.wy_fwd import wy_fwd
from harts_compiler.codegen.kernels.upload import to_device
from test_delta_rule_helpers import NAMES, forward_backward, interpreter_inputs

# CPU tensors at head sizes the CUDA guard does not admit: interpreter only (the GPU checks are
# tests/test_chunk_gdn_gpu.py and bench/gdn_shapes.py)
pytestmark = pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1")


def make_inputs(lengths, hk=1, hv=2, kd=16, vd=32, seed=0):
    def log_decay(gen, rows, hv, kd):
        return -torch.rand(rows, hv, generator=gen) * 0.2
    return interpreter_inputs(lengths, log_decay, hk, hv, kd, vd, seed)


def assert_all_close(got, want, rtol=2e-5, atol=2e-5):
    for name, a, b in zip(NAMES, got, want):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def test_varlen_grouped_heads_exports_all_gradients():
    """Odd lengths (a tail chunk, a sub-chunk sequence, an empty one), HV = 2 HK, l2norm, a duplicate export."""
    lengths = [70, 5, 0, 131]
    tensors, cu = make_inputs(lengths)
    export_seq, export_offset = torch.tensor([0, 3, 3, 0]), torch.tensor([64, 128, 64, 64])
    got = forward_backward(chunk_gated_delta_rule, tensors, cu, export_seq, export_offset, use_qk_l2norm=True)
    want = forward_backward(chunk_gated_delta_rule_reference, tensors, cu, export_seq, export_offset,
                            use_qk_l2norm=True)
    assert got[1].dtype == torch.float32 and got[1].shape == (4, 2, 16, 32)
    assert_all_close(got, want)


@pytest.mark.parametrize("block_k", [32, 128])
def test_wy_forward_column_blocks_match_reference(block_k):
    """The WY forward's first kernel walks k in `block_k` columns (one block or several): the whole call
    agrees with the reference, partial chunks, exports and every gradient included."""
    tensors, cu = make_inputs([70, 5, 131], kd=128, vd=128, seed=7)
    export_seq, export_offset = torch.tensor([0, 2]), torch.tensor([64, 128])
    got = forward_backward(chunk_gated_delta_rule, tensors, cu, export_seq, export_offset,
                           config=GDNKernelConfig(wy_kkt_block_k=block_k))
    want = forward_backward(chunk_gated_delta_rule_reference, tensors, cu, export_seq, export_offset)
    assert_all_close(got, want, rtol=5e-5, atol=5e-5)


def test_injected_export_gradient_alone():
    """Only the exported states carry gradient: everything upstream of them must still get it."""
    tensors, cu = make_inputs([128, 64], hk=2, hv=2, seed=2)
    # the end of a two-chunk sequence too: an export segment of its own, empty before the sentinel
    export_seq, export_offset = torch.tensor([0, 1, 0]), torch.tensor([64, 64, 128])
    got = forward_backward(chunk_gated_delta_rule, tensors, cu, export_seq, export_offset, with_do=False)
    want = forward_backward(chunk_gated_delta_rule_reference, tensors, cu, export_seq, export_offset, with_do=False)
    assert got[2].abs().sum() == 0  # q does not feed any state
    assert got[3][:64].abs().sum() > 0 and got[7].abs().sum() > 0
    assert_all_close(got, want)


def test_split_at_boundary_restarts_bitwise():
    """Trajectory (one sequence) vs tree-style rounds (prefix exporting its state, then the rest from it)."""
    (q, k, v, g, beta, h0), _ = make_inputs([150], seed=3)
    whole, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale=0.4, initial_state=h0,
                                      cu_seqlens=torch.tensor([0, 150], dtype=torch.int32))
    head, state = chunk_gated_delta_rule(q[:64], k[:64], v[:64], g[:64], beta[:64], scale=0.4, initial_state=h0,
                                         cu_seqlens=torch.tensor([0, 64], dtype=torch.int32),
                                         export_seq=torch.tensor([0]), export_offset=torch.tensor([64]))
    # the continuation packed behind an unrelated sequence, as a later round would hold it
    other = make_inputs([20], seed=4)[0]
    cat = [torch.cat([x[64:], y]) for x, y in zip((q, k, v, g, beta), other[:5])]
    tail, _ = chunk_gated_delta_rule(*cat, scale=0.4, initial_state=torch.cat([state, other[5]]),
                                     cu_seqlens=torch.tensor([0, 86, 106], dtype=torch.int32))
    assert torch.equal(whole[:64], head)
    assert torch.equal(whole[64:], tail[:86])


def test_value_blocks_do_not_change_results():
    """BV < V (several programs per state) must agree with one block over all of V."""
    (q, k, v, g, beta, h0), cu = make_inputs([90, 40], kd=16, vd=32, seed=5)
    q, k, v, g, beta, h0 = (x.detach() for x in (q, k, v, g, beta, h0))
    do = torch.randn(v.shape, generator=torch.Generator().manual_seed(6))
    results = []
    for bv in (16, 32):
        config = GDNKernelConfig(scan_block_v=bv, scan_min_programs=0, out_block_v=bv, bwd_block_v=bv)
        index = to_device(prepare_gdn_index(cu, [0], [64], config=config), "cpu")
        gc, T, w, u = wy_fwd(k, v, g, beta, index)
        h, v_new, bank = state_fwd(k, w, u, gc, h0, index)
        o = output_fwd(q, k, v_new, gc, h, 0.4, index)
        dh, dvn, dh0 = state_bwd(q, k, w, gc, do, torch.ones_like(bank), 0.4, index)
        grads = chunk_bwd(q, k, v, beta, gc, T, v_new, h, dh, do, dvn, 0.4, index)
        results.append([o, bank, dh0, *grads])
    for a, b in zip(*results):  # fp32; gradients summed over value blocks in a different order
        torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5)


def test_scaled_gradients_round_once_to_fp16():
    """dq, dk's first share and the final dk as block-scaled fp16 (what 16-bit inputs get on the GPU): dq and dk
    within fp16's rounding of the fp32 path, every other gradient bit for bit; the readers (the l2 norm's backward,
    the group sum) take the scaled rows as they take the decoded fp32 rows, at any magnitude."""
    (q, k, v, g, beta, h0), cu = make_inputs([90, 40], hk=1, hv=2, kd=16, vd=32, seed=5)
    q, k, v, g, beta, h0 = (x.detach() for x in (q, k, v, g, beta, h0))
    do = torch.randn(v.shape, generator=torch.Generator().manual_seed(6))
    index = to_device(prepare_gdn_index(cu, [0], [64]), "cpu")
    gc, T, w, u = wy_fwd(k, v, g, beta, index)
    h, v_new, bank = state_fwd(k, w, u, gc, h0, index)
    dh, dvn, _ = state_bwd(q, k, w, gc, do, torch.ones_like(bank), 0.4, index)
    plain, scaled = (chunk_bwd(q, k, v, beta, gc, T, v_new, h, dh, do, dvn, 0.4, index, scaled=s) for s in (0, 1))
    assert all(isinstance(x, ScaledRows) and x.payload.dtype == torch.float16 for x in scaled[:2])
    assert (scaled[0].blocks, scaled[1].blocks) == (1, 1)  # K = 16: one block of the WY backward's 64 columns
    for a, b in zip(plain[:2], scaled[:2]):
        assert 0 < float((a - b.float()).norm() / a.norm()) < 4e-4
    assert all(torch.equal(a, b) for a, b in zip(plain[2:], scaled[2:]))
    _, rstd = l2norm_rows(q)
    for blocks in (1, 4):  # one scale a row (dq) or one per block of columns (the final dk at K = 128)
        enc = ScaledRows.encode(plain[0], 16 // blocks)
        rows = ScaledRows(enc.payload, enc.inverse * torch.tensor([1e-30, 1e20])[:, None])  # two magnitudes
        assert torch.equal(l2norm_rows_backward(q, rstd, rows, groups=2), l2norm_rows_backward(q, rstd, rows.float(),
                                                                                              2))
        assert torch.equal(group_sum(rows, 2), group_sum(rows.float(), 2))
        assert torch.equal(group_sum(rows, 1), rows.float())


def test_scan_launch_order_does_not_change_results():
    """The scans start the longest sequence first (index.seq_order); any order of the programs gives the same
    bits, and a scan over part of the sequences must be given its launch's order."""
    (q, k, v, g, beta, h0), cu = make_inputs([40, 150, 70], kd=16, vd=32, seed=8)
    q, k, v, g, beta, h0 = (x.detach() for x in (q, k, v, g, beta, h0))
    do = torch.randn(v.shape, generator=torch.Generator().manual_seed(9))
    index = to_device(prepare_gdn_index(cu, [1], [64]), "cpu")
    assert index.seq_order.tolist() == [1, 2, 0]
    gc, T, w, u = wy_fwd(k, v, g, beta, index)
    bank_grad = torch.ones(index.num_slots, *h0.shape[1:])
    results = []
    for order in (None, torch.tensor([0, 1, 2]), torch.tensor([2, 0, 1])):
        h, v_new, bank = state_fwd(k, w, u, gc, h0, index, order=order)
        results.append([h, v_new, bank, *state_bwd(q, k, w, gc, do, bank_grad, 0.4, index, order=order)])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    with pytest.raises(ValueError, match="scan_order"):
        state_fwd(k, w, u, gc, h0, index, seqs=(1, 2))


def test_strong_decays_as_transformers_init_gives():
    """g down to -25 per token (transformers draws A = exp(A_log) up to 16): exp of in-chunk gate
    differences overflows in the masked-out lanes; the kernels must select those lanes away, never
    letting inf * 0 reach an output (a NaN seen in bf16 model runs of an earlier version)."""
    tensors, cu = make_inputs([70, 131], seed=3)
    with torch.no_grad():
        tensors[3].copy_(-torch.rand(tensors[3].shape, generator=torch.Generator().manual_seed(4)) * 25)
    export_seq, export_offset = torch.tensor([0, 1]), torch.tensor([64, 128])
    got = forward_backward(chunk_gated_delta_rule, tensors, cu, export_seq, export_offset, use_qk_l2norm=True)
    want = forward_backward(chunk_gated_delta_rule_reference, tensors, cu, export_seq, export_offset,
                            use_qk_l2norm=True)
    for name, tensor in zip(NAMES, got):
        assert torch.isfinite(tensor).all(), name
    assert_all_close(got, want, rtol=5e-5, atol=5e-5)


def assert_same_bits(*configs):
    """Every output and gradient bit for bit equal under each of `configs`: partial last chunks, a one-chunk and a
    sub-chunk sequence, exports at segment ends and mid-sequence, grouped heads."""
    lengths = [200, 64, 5, 130, 192]
    tensors, cu = make_inputs(lengths, hk=1, hv=2, kd=16, vd=32, seed=9)
    export_seq, export_offset = torch.tensor([0, 0, 3, 4, 4]), torch.tensor([64, 192, 128, 64, 192])
    results = [forward_backward(chunk_gated_delta_rule, tensors, cu, export_seq, export_offset, config=config,
                                use_qk_l2norm=True) for config in configs]
    for name, a, b in zip(NAMES, *results):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("block_v", [16, 32])
def test_descriptor_loads_equal_pointer_loads_bitwise(block_v):
    """The scans' full chunks through tensor descriptors (GDNKernelConfig.scan_tma_max_block_v) give the same bits as
    through pointers."""
    assert_same_bits(*(GDNKernelConfig(scan_tma_max_block_v=tma_cols, scan_block_v=block_v, scan_min_programs=0)
                       for tma_cols in (32, 0)))


@pytest.mark.parametrize("tma", [True, False])
def test_scan_formed_dv_local_equals_buffer_bitwise(tma):
    """Full-width backward scans form each chunk's dv_local themselves; where a launch runs narrower, every scan reads
    A^T (dv_local = A^T do) from gated_at_bwd's buffer instead (state_bwd.py). Both give the same bits across scan
    widths (a tree round may scan narrower than its trajectories): every launch at 32 columns (formed) against
    narrowed to 16 (read)."""
    assert_same_bits(*(GDNKernelConfig(scan_tma_max_block_v=32 if tma else 0, scan_block_v=32, scan_min_programs=n,
                                       scan_local_dv_min_chunks=0) for n in (0, 10**6)))


def test_precise_q_do_remainder_is_zero_in_fp32():
    """The backward scan's bf16 hi + lo q^T do (GDNKernelConfig.scan_q_do_precision "bf16x2"): the interpreter
    runs fp32 operands, whose remainder is exactly 0, so the second dot must add nothing: the same bits as one
    dot, every gradient (a wrong operand in the second dot would double or drop the term)."""
    lengths = [200, 5, 130]
    tensors, cu = make_inputs(lengths, hk=1, hv=2, kd=16, vd=32, seed=10)
    export_seq, export_offset = torch.tensor([0, 2]), torch.tensor([64, 128])
    for block_v in (32, 16):  # per width: numpy's fp32 dots of other widths may round differently
        results = []
        for precision in ("bf16", "bf16x2"):
            config = GDNKernelConfig(scan_q_do_precision=precision, scan_block_v=block_v, scan_min_programs=0)
            results.append(forward_backward(chunk_gated_delta_rule, tensors, cu, export_seq, export_offset,
                                            config=config))
        for name, a, b in zip(NAMES, *results):
            assert torch.equal(a, b), f"{name} at {block_v} columns"


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_group_sum_and_grouped_l2norm_backward(groups):
    """The value heads' rows of dq/dk are summed per key head in a fixed order, on their own (group_sum) or inside
    the l2 norm's backward; both equal torch's sum over the group, and each other bitwise."""
    from harts_compiler.codegen.kernels.chunk_gdn.l2norm import group_sum, l2norm_rows, l2norm_rows_backward
    gen = torch.Generator().manual_seed(groups)
    x = torch.randn(37, 3, 16, generator=gen, dtype=torch.float64)
    dy = torch.randn(37, 3 * groups, 16, generator=gen, dtype=torch.float64)
    summed = group_sum(dy, groups)
    torch.testing.assert_close(summed, dy.view(37, 3, groups, 16).sum(2).to(summed.dtype), rtol=1e-6, atol=1e-6)
    _, rstd = l2norm_rows(x)
    fused = l2norm_rows_backward(x, rstd, dy, groups=groups)
    assert torch.equal(fused, l2norm_rows_backward(x, rstd, summed))
    x_leaf = x.clone().requires_grad_(True)
    y = x_leaf / torch.sqrt((x_leaf * x_leaf).sum(-1, keepdim=True) + 1e-6)
    want, = torch.autograd.grad(y, x_leaf, dy.view(37, 3, groups, 16).sum(2))
    torch.testing.assert_close(fused, want, rtol=1e-5, atol=1e-5)
