"""The plain-torch chunked Gated DeltaNet reference against its token loop, transformers, and itself split."""
import pytest
import torch

from harts_compiler.codegen.kernels.chunk_gdn.reference import (
    chunk_gated_delta_rule_reference,
    recurrent_gated_delta_rule_reference,
)


def make_inputs(lengths, hk=2, hv=4, kd=8, vd=6, dtype=torch.float64, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(lengths)
    q = torch.randn(rows, hk, kd, generator=gen, dtype=dtype)
    k = torch.randn(rows, hk, kd, generator=gen, dtype=dtype)
    v = torch.randn(rows, hv, vd, generator=gen, dtype=dtype)
    g = -torch.rand(rows, hv, generator=gen, dtype=dtype) * 0.3
    beta = torch.rand(rows, hv, generator=gen, dtype=dtype)
    h0 = torch.randn(len(lengths), hv, kd, vd, generator=gen, dtype=torch.float64 if dtype == torch.float64
                     else torch.float32) * 0.1
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    tensors = [q, k, v, g, beta, h0]
    for t in tensors:
        t.requires_grad_(requires_grad)
    return tensors, cu


def run(fn, tensors, cu, **kw):
    q, k, v, g, beta, h0 = tensors
    kw.setdefault("scale", q.shape[-1] ** -0.5)
    return fn(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, **kw)


@pytest.mark.parametrize("l2norm", [False, True])
def test_chunk_matches_token_loop_fp64(l2norm):
    lengths = [13, 1, 20, 0, 9]
    tensors, cu = make_inputs(lengths, requires_grad=True)
    exports = dict(export_seq=torch.tensor([0, 2, 2, 4]), export_offset=torch.tensor([8, 8, 16, 8]))
    o1, s1 = run(chunk_gated_delta_rule_reference, tensors, cu, chunk_size=4, use_qk_l2norm=l2norm, **exports)
    o2, s2 = run(recurrent_gated_delta_rule_reference, tensors, cu, chunk_size=4, use_qk_l2norm=l2norm, **exports)
    assert o1.dtype == torch.float64 and s1.shape == (4, 4, 8, 6)
    torch.testing.assert_close(o1, o2, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s1, s2, rtol=1e-10, atol=1e-10)
    gen = torch.Generator().manual_seed(1)
    do, ds = torch.randn(o1.shape, generator=gen, dtype=o1.dtype), torch.randn(s1.shape, generator=gen, dtype=s1.dtype)
    g1 = torch.autograd.grad((o1 * do).sum() + (s1 * ds).sum(), tensors)
    g2 = torch.autograd.grad((o2 * do).sum() + (s2 * ds).sum(), tensors)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_matches_transformers_one_sequence_fp32():
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    (q, k, v, g, beta, h0), cu = make_inputs([150], hk=2, hv=4, kd=16, vd=16, dtype=torch.float32)
    o, final = chunk_gated_delta_rule_reference(
        q, k, v, g, beta, scale=16 ** -0.5, initial_state=h0, cu_seqlens=cu, chunk_size=64, use_qk_l2norm=True,
        export_seq=torch.tensor([0]), export_offset=torch.tensor([128]))
    o_hf, _ = modeling.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], chunk_size=64,
                                                    initial_state=h0, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, o_hf[0], rtol=1e-5, atol=1e-5)
    # transformers' state after the first 128 rows is our export at offset 128
    _, s_hf = modeling.torch_chunk_gated_delta_rule(q[None, :128], k[None, :128], v[None, :128], g[None, :128],
                                                    beta[None, :128], chunk_size=64, initial_state=h0,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(final, s_hf, rtol=1e-5, atol=1e-5)


def test_split_at_aligned_boundary_restarts_exactly_fp32():
    """A sequence split at 2C and restarted from the exported state reproduces outputs bitwise, and gradients."""
    C = 8
    (q, k, v, g, beta, h0), _ = make_inputs([37], dtype=torch.float32, seed=3)
    leaves = [q, k, v, g, beta, h0]
    for t in leaves:
        t.requires_grad_(True)
    whole_cu = torch.tensor([0, 37], dtype=torch.int32)
    o_whole, _ = chunk_gated_delta_rule_reference(q, k, v, g, beta, scale=0.3, initial_state=h0, cu_seqlens=whole_cu,
                                                  chunk_size=C)
    # round 1: the first 16 rows, exporting the boundary state; round 2: the rest from that state
    o_head, s_mid = chunk_gated_delta_rule_reference(
        q[:16], k[:16], v[:16], g[:16], beta[:16], scale=0.3, initial_state=h0, cu_seqlens=torch.tensor([0, 16]),
        chunk_size=C, export_seq=torch.tensor([0]), export_offset=torch.tensor([16]))
    o_tail, _ = chunk_gated_delta_rule_reference(
        q[16:], k[16:], v[16:], g[16:], beta[16:], scale=0.3, initial_state=s_mid, cu_seqlens=torch.tensor([0, 21]),
        chunk_size=C)
    o_split = torch.cat([o_head, o_tail])
    assert torch.equal(o_whole, o_split)
    do = torch.randn(o_whole.shape, generator=torch.Generator().manual_seed(5))
    g_whole = torch.autograd.grad((o_whole * do).sum(), leaves)
    g_split = torch.autograd.grad((o_split * do).sum(), leaves)
    for a, b in zip(g_whole, g_split):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_packed_sequences_are_independent_fp32():
    """Packing several sequences in one call equals calling each alone, bitwise (chunks align to starts)."""
    lengths = [11, 24, 5]
    (q, k, v, g, beta, h0), cu = make_inputs(lengths, dtype=torch.float32, seed=4)
    o_packed, _ = chunk_gated_delta_rule_reference(q, k, v, g, beta, scale=0.5, initial_state=h0, cu_seqlens=cu,
                                                   chunk_size=8)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_alone, _ = chunk_gated_delta_rule_reference(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], scale=0.5,
                                                      initial_state=h0[n:n + 1], cu_seqlens=torch.tensor([0, b - a]),
                                                      chunk_size=8)
        assert torch.equal(o_packed[a:b], o_alone)


def test_exported_state_gradient_flows_to_every_input():
    tensors, cu = make_inputs([10, 12], requires_grad=True)
    _, states = run(chunk_gated_delta_rule_reference, tensors, cu, chunk_size=4,
                    export_seq=torch.tensor([1]), export_offset=torch.tensor([8]))
    grads = torch.autograd.grad(states.square().sum(), tensors, allow_unused=True)
    q_grad, k_grad, v_grad, g_grad, beta_grad, h0_grad = grads
    rows_seq1 = slice(10, 18)  # only sequence 1's first 8 rows feed that state
    for name, grad in (("k", k_grad), ("v", v_grad), ("g", g_grad), ("beta", beta_grad)):
        assert grad[rows_seq1].abs().sum() > 0, name
        assert grad[:10].abs().sum() == 0 and grad[18:].abs().sum() == 0, name
    assert q_grad is None or q_grad.abs().sum() == 0  # states do not read q
    assert h0_grad[1].abs().sum() > 0 and h0_grad[0].abs().sum() == 0


@pytest.mark.parametrize("field, change, message", [
    ("export_offset", torch.tensor([6]), "export_offset"),
    ("export_seq", torch.tensor([5]), "export_seq"),
    ("cu_seqlens", torch.tensor([0, 30], dtype=torch.int32), "cu_seqlens"),
    ("initial_state", torch.zeros(2, 4, 8, 6), "initial_state"),
])
def test_bad_input_names_the_field(field, change, message):
    (q, k, v, g, beta, h0), cu = make_inputs([10])
    kw = dict(scale=1.0, initial_state=h0, cu_seqlens=cu, chunk_size=4, export_seq=torch.tensor([0]),
              export_offset=torch.tensor([8]))
    kw[field] = change
    with pytest.raises(ValueError, match=message):
        chunk_gated_delta_rule_reference(q, k, v, g, beta, **kw)
