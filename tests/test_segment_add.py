"""segment_add (codegen/kernels/segment_add.py): the Triton kernel (CUDA, or the interpreter without
it) against its plain-torch reference, bit for bit: the same fp32 sums in the same order, rounded once."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_compiler.codegen.kernels.scaled16 import ScaledRows
from harts_compiler.codegen.kernels.segment_add import segment_add, segment_add_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(seed: int, dtype, heads: int, width: int, segments: list[int], indexed: bool):
    """dst [T, heads, width], src [R, heads, width]; segment d of `segments[d]` source rows."""
    gen = torch.Generator().manual_seed(seed)
    tokens, rows = len(segments) + 3, sum(segments) + 2
    dst = torch.randn(tokens, heads, width, generator=gen).to(dtype)
    src = torch.randn(rows, heads, width, generator=gen).to(dtype)
    dst_rows = torch.randperm(tokens, generator=gen)[:len(segments)]
    seg_start = torch.tensor([0] + segments).cumsum(0)
    src_rows = torch.randint(0, rows, (sum(segments),), generator=gen) if indexed else None
    return [x.to(DEVICE) if x is not None else None for x in (dst, dst_rows, src, seg_start, src_rows)]


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       heads=st.sampled_from([1, 2]), width=st.sampled_from([1, 3, 16]),
       segments=st.lists(st.integers(0, 4), min_size=1, max_size=5), indexed=st.booleans())
def test_segment_add_equals_reference(seed, dtype, heads, width, segments, indexed):
    dst, dst_rows, src, seg_start, src_rows = case(seed, dtype, heads, width, segments, indexed)
    expect = segment_add_reference(dst.clone(), dst_rows, src, seg_start, src_rows)
    got = segment_add(dst.clone(), dst_rows, src, seg_start, src_rows)
    assert torch.equal(got, expect)
    untouched = torch.ones(dst.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[dst_rows] = False
    assert torch.equal(got[untouched], dst[untouched])


def test_wide_rows_take_several_column_blocks():
    """A bank state row (HV x K x V elements) spans several programs' columns."""
    dst, dst_rows, src, seg_start, src_rows = case(1, torch.float32, 4, 640, [3, 1], True)
    expect = segment_add_reference(dst.clone(), dst_rows, src, seg_start, src_rows)
    assert torch.equal(segment_add(dst.clone(), dst_rows, src, seg_start, src_rows), expect)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), segments=st.lists(st.integers(0, 4), min_size=1, max_size=4),
       indexed=st.booleans(), block=st.sampled_from([8, 16]))
def test_segment_add_into_block_scaled_rows(seed, segments, indexed, block):
    """Into block-scaled fp16 rows (the GDN backward's final dk): each touched block decoded, added to in fp32 and
    encoded again with its own new scale, as the reference does; blocks of very different magnitudes keep their
    precision, and untouched rows keep their bits."""
    dst, dst_rows, src, seg_start, src_rows = case(seed, torch.float32, 2, 16, segments, indexed)
    dst = dst * torch.tensor([1e-20, 1e3], device=DEVICE)[:, None]  # a magnitude per head
    src = src * torch.tensor([1e-20, 1e3], device=DEVICE)[:, None]
    scaled = ScaledRows.encode(dst, block)
    expect = segment_add_reference(ScaledRows(scaled.payload.clone(), scaled.inverse.clone()), dst_rows, src,
                                   seg_start, src_rows)
    got = segment_add(ScaledRows(scaled.payload.clone(), scaled.inverse.clone()), dst_rows, src, seg_start, src_rows)
    assert torch.equal(got.payload, expect.payload) and torch.equal(got.inverse, expect.inverse)
    exact = segment_add_reference(dst.clone(), dst_rows, src, seg_start, src_rows)
    # two fp16 roundings (dst's encoding, the sum's), each within 2^-11 of its block's largest magnitude
    size = torch.maximum(exact.view(-1, block).abs().amax(-1), dst.view(-1, block).abs().amax(-1))
    assert float(((got.float() - exact).view(-1, block).abs().amax(-1) / size).max()) <= 2 ** -10
    untouched = torch.ones(dst.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[dst_rows] = False
    assert torch.equal(got.payload[untouched], scaled.payload[untouched])


def test_bad_shapes_are_named():
    dst, dst_rows, src, seg_start, _ = case(2, torch.float32, 2, 4, [1], False)
    with pytest.raises(ValueError, match="source row has 16 elements, a destination row 8"):
        segment_add(dst, dst_rows, torch.cat([src, src], dim=1), seg_start)
    with pytest.raises(ValueError, match="contiguous"):
        segment_add(dst.transpose(1, 2), dst_rows, src, seg_start)
    with pytest.raises(ValueError, match="seg_start has 3 bounds for 1 rows"):
        segment_add(dst, dst_rows, src, torch.tensor([0, 1, 1], device=DEVICE))


def test_planned_embedding_gradient_equals_torch():
    """The runtime's embedding backward (the plan's token groups summed by segment_add) == F.embedding's."""
    import numpy as np

    from harts_compiler.codegen import trajectory_index
    from harts_compiler.runtime.ops.embedding import _PlannedEmbedding
    from test_runtime_helpers import cpu_plan

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU
    plan = cpu_plan(trajectory_index([[3, 1, 3, 3], [0, 1, 7]]), vocab_size=9).to(device)
    assert plan.embed_ids.tolist() == [0, 1, 3, 7] and plan.embed_bounds.tolist() == [0, 1, 3, 6, 7]
    weight = torch.randn(9, 5, dtype=torch.float32, device=device, requires_grad=True)
    grad = torch.randn(7, 5, device=device)
    got, = torch.autograd.grad((_PlannedEmbedding.apply(weight, plan) * grad).sum(), weight)
    want, = torch.autograd.grad((torch.nn.functional.embedding(plan.token_ids, weight) * grad).sum(), weight)
    torch.testing.assert_close(got, want)
    assert np.array_equal(got[[2, 4, 5, 6, 8]].cpu().numpy(), np.zeros((5, 5)))
