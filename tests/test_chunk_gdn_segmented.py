"""Segmented Gated DeltaNet (long sequences cut into segments whose state maps compose) vs the uncut call.

fp64 through the plain-torch reference proves the algebra (maps, composition, export remapping, every
gradient through the three calls); the Triton kernels under the interpreter prove the plumbing of the
prepared launch indices.
"""
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from harts_compiler.codegen.kernels.chunk_gdn import (GDNKernelConfig, chunk_gated_delta_rule,
                                                      chunk_gated_delta_rule_reference)
from harts_compiler.codegen.kernels.chunk_gdn.segmented import needs_segments, plan_segments, segmented_gated_delta_rule

NAMES = ["o", "exported", "dq", "dk", "dv", "dg", "dbeta", "d_initial_state"]


def make_inputs(lengths, hk=1, hv=2, kd=16, vd=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(lengths)
    tensors = [
        torch.randn(rows, hk, kd, generator=gen, dtype=dtype),
        torch.nn.functional.normalize(torch.randn(rows, hk, kd, generator=gen, dtype=dtype), dim=-1),
        torch.randn(rows, hv, vd, generator=gen, dtype=dtype),
        -torch.rand(rows, hv, generator=gen, dtype=dtype) * 0.3,
        torch.rand(rows, hv, generator=gen, dtype=dtype),
        torch.randn(len(lengths), hv, kd, vd, generator=gen, dtype=torch.float64 if dtype == torch.float64
                    else torch.float32) * 0.1,
    ]
    return [t.requires_grad_(True) for t in tensors]


def run(fn, tensors, **kw):
    q, k, v, g, beta, h0 = tensors
    o, exported = fn(q, k, v, g, beta, scale=0.3, initial_state=h0, use_qk_l2norm=True, **kw)
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    ds = torch.randn(exported.shape, generator=gen, dtype=exported.dtype)
    grads = torch.autograd.grad((o * do).sum() + (exported * ds).sum(), tensors)
    return [o, exported, *grads]


@pytest.mark.parametrize("segment_chunks", [1, 2, 3])
def test_segments_match_the_uncut_call_fp64(segment_chunks):
    chunk = 16
    lengths = [150, 7, 0, 64, 200]
    # segment ends, the final state of a partial last segment, a duplicate
    export_seq, export_offset = [0, 0, 4, 4, 0, 3, 0], [16, 96, 192, 32, 144, 64, 96]
    tensors = make_inputs(lengths)
    cu = torch.tensor([0] + lengths).cumsum(0)
    assert needs_segments(lengths, segment_chunks, chunk)
    plan = plan_segments(lengths, export_seq, export_offset, segment_chunks=segment_chunks, chunk_size=chunk)
    got = run(segmented_gated_delta_rule, tensors, plan=plan, kernel=chunk_gated_delta_rule_reference)
    want = run(chunk_gated_delta_rule_reference, tensors, cu_seqlens=cu,
               export_seq=torch.tensor(export_seq), export_offset=torch.tensor(export_offset), chunk_size=chunk)
    for name, a, b in zip(NAMES, got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("seq,off,field", [(0, 0, "export_offset"), (0, 80, "export_offset"),
                                           (1, 16, "export_offset"), (3, 16, "export_seq")])
def test_bad_exports_are_rejected_in_sequence_coordinates(seq, off, field):
    """Remapped into segments, an offset past its sequence's end would name another sequence's segment."""
    with pytest.raises(ValueError, match=field):
        plan_segments([64, 10, 32], [seq], [off], segment_chunks=1, chunk_size=16)


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match="segment_chunks"):
        plan_segments([64], segment_chunks=2.0, chunk_size=16)
    with pytest.raises(ValueError, match="bwd_qk_block_k"):
        GDNKernelConfig(bwd_qk_block_k=48)


def test_plan_layout():
    plan = plan_segments([130, 10, 64], [0], [128], segment_chunks=1, chunk_size=64)
    assert plan.cu_segments.tolist() == [0, 64, 128, 130, 140, 204]   # 64 + 64 + 2 | 10 | 64
    assert plan.inner_seq == (0, 1) and plan.inner_len == (64, 64)
    assert (plan.export_seg, plan.export_off) == ((1,), (64,))      # the end of sequence 0's second segment
    assert not needs_segments([64, 10], 1, 64)


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs CUDA or TRITON_INTERPRET=1")
def test_triton_segments_with_prepared_indices():
    lengths = [200, 5, 130]
    export_seq, export_offset = [0, 2, 0], [64, 128, 192]
    tensors = make_inputs(lengths, kd=16, vd=32, dtype=torch.float32, seed=3)
    cu = torch.tensor([0] + lengths).cumsum(0)
    plan = plan_segments(lengths, export_seq, export_offset, segment_chunks=1, chunk_size=64,
                         device="cpu", kernel_config=GDNKernelConfig())
    got = run(segmented_gated_delta_rule, tensors, plan=plan)
    want = run(chunk_gated_delta_rule, tensors, cu_seqlens=cu,
               export_seq=torch.tensor(export_seq), export_offset=torch.tensor(export_offset))
    for name, a, b in zip(NAMES, got, want):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4, msg=lambda m: f"{name}: {m}")


def test_two_level_tree_with_segmented_roots_fp64():
    """bench/gdn.py's use: a two-round tree whose root round is segmented (its aligned export lands in a
    later segment) gives the uncut tree's outputs and gradients."""
    from harts_compiler.codegen.kernels.chunk_gdn.two_level import run_tree, two_level_plan
    chunk = 16
    tree = two_level_plan([(150, 3, 40), (20, 2, 33)], chunk_size=chunk)
    tensors = make_inputs([tree.compact_rows], seed=4)[:5]
    seg = plan_segments(torch.diff(tree.root_cu).tolist(), tree.root_export_seq.tolist(),
                        tree.root_export_offset.tolist(), segment_chunks=2, chunk_size=chunk)

    def root_segmented(q, k, v, g, beta, *, scale, initial_state, segmented=False, **kw):
        if segmented:
            return segmented_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state.double(),
                                              plan=seg, kernel=chunk_gated_delta_rule_reference)
        return chunk_gated_delta_rule_reference(q, k, v, g, beta, scale=scale, initial_state=initial_state.double(),
                                                chunk_size=chunk, **kw)

    def grads(**kw):
        o = run_tree(root_segmented, tree, *tensors, scale=0.3, **kw)
        return [o, *torch.autograd.grad(o.square().sum(), tensors)]

    got = grads(root_kw=dict(segmented=True), branch_kw={})
    want = grads()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_segments_match_the_uncut_call_on_random_layouts(data):
    """Random lengths (empty, exact multiples of the segment), exports (segment ends, final states,
    duplicates) and segment sizes, chunk 4, fp64 reference: outputs, exports and every gradient."""
    chunk = 4
    lengths = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=4).filter(lambda n: sum(n) > 0))
    segment_chunks = data.draw(st.integers(1, 4))
    boundaries = [(s, off) for s, n in enumerate(lengths) for off in range(chunk, n + 1, chunk)]
    exports = data.draw(st.lists(st.sampled_from(boundaries), max_size=5)) if boundaries else []
    export_seq, export_offset = [s for s, _ in exports], [o for _, o in exports]
    tensors = make_inputs(lengths, kd=8, vd=4, seed=len(lengths))
    cu = torch.tensor([0] + lengths).cumsum(0)
    plan = plan_segments(lengths, export_seq, export_offset, segment_chunks=segment_chunks, chunk_size=chunk)
    got = run(segmented_gated_delta_rule, tensors, plan=plan, kernel=chunk_gated_delta_rule_reference)
    want = run(chunk_gated_delta_rule_reference, tensors, cu_seqlens=cu, export_seq=torch.tensor(export_seq,
               dtype=torch.long), export_offset=torch.tensor(export_offset, dtype=torch.long), chunk_size=chunk)
    for name, a, b in zip(NAMES, got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
