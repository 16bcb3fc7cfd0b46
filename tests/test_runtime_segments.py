"""TreeModel.gdn_segment_chunks (opt-in): rounds of few sequences cut long sequences into segments whose
GDN state maps compose. Tree mode must still equal trajectory-wise training (fp64: to rounding, every
gradient), and the segmented path must really run."""
from __future__ import annotations

import copy

import pytest
import torch

from harts_compiler.runtime.ops.linear_attention import plan_linear_rounds
from test_runtime_helpers import naive_tree_index
from test_runtime_tree import rel, run_and_grad, tiny_model, tricky_batches

CHUNK = 4


def segmented_model(segment_chunks: int):
    model = copy.deepcopy(tiny_model(torch.float64))
    model.gdn_segment_chunks = segment_chunks
    return model


@pytest.mark.parametrize("name", ["branch_on_chunk_boundary", "replay_across_short_nodes"])
@pytest.mark.parametrize("segment_chunks", [1, 2])
def test_segmented_rounds_equal_trajectory_wise_fp64(name, segment_chunks):
    batch = tricky_batches(CHUNK)[name]
    index = naive_tree_index(batch, chunk_size=CHUNK)
    plan = plan_linear_rounds(index, use_triton=False, segment_chunks=segment_chunks)
    assert any(s is not None for s in plan.segments), "no round was segmented: the test would prove nothing"
    model = segmented_model(segment_chunks)
    gen = torch.Generator().manual_seed(1)
    max_len = max(map(len, batch))
    weights = (torch.randn(len(batch), max_len, generator=gen, dtype=torch.float64),
               torch.randn(len(batch), max_len, generator=gen, dtype=torch.float64), 0.7)
    tree = run_and_grad(model, index, weights, chunk_size=CHUNK)
    flat = run_and_grad(tiny_model(torch.float64), batch, weights, chunk_size=CHUNK)
    assert rel(tree[0], flat[0]) < 1e-10 and rel(tree[1], flat[1]) < 1e-10
    worst = max((rel(tree[4][n], flat[4][n]), n) for n in flat[4])
    assert worst[0] < 1e-10, worst


def test_segment_chunks_must_be_positive():
    from harts_compiler.runtime import TreeModel
    with pytest.raises(ValueError, match="gdn_segment_chunks"):
        TreeModel.from_config("tiny-qwen3-next", gdn_segment_chunks=0)


def test_gdn_config_must_be_a_kernel_config():
    from harts_compiler.codegen.kernels.chunk_gdn import GDNKernelConfig
    from harts_compiler.runtime import TreeModel
    with pytest.raises(TypeError, match="gdn_config"):
        TreeModel.from_config("tiny-qwen3-next", gdn_config={"tree_rows_in_kernels": True})
    model = TreeModel.from_config("tiny-qwen3-next", gdn_config=GDNKernelConfig(tree_rows_in_kernels=False))
    assert not model.gdn_config.tree_rows_in_kernels

