"""GPU: a tree run as pieces with the Triton kernels (bf16) against the same tree run whole.

Every chunk of a piece's linear attention is the chunk the whole tree computes, from the same entering state, so
the bf16 log-probs of pieces and of the whole tree differ only where attention's block order differs; both are
compared with an fp64 reference: the pieces' difference is no larger than the whole tree's times BF16_FACTOR,
for log-probs and every parameter gradient.
"""
from __future__ import annotations

import random

import pytest
import torch

import harts_compiler as hc
from harts_compiler.runtime import TreeModel
from test_runtime_gpu import GPU_CONFIG, _rel, _worst_grad
from test_runtime_helpers import random_rollout_batch

pytestmark = pytest.mark.gpu
BF16_FACTOR = 2.0


def _step(model, microbatches, weights, order):
    model.zero_grad(set_to_none=True)
    rows = []
    for mb in microbatches:
        out = model(mb)
        lp = out.logprobs.float()
        index = torch.as_tensor([order[t] for t in out.trajectory_ids], device=lp.device)
        (lp * weights[index, :lp.shape[1]]).sum().add(out.aux_loss.float()).backward()
        rows.append((index, lp.detach().double()))
    width = weights.shape[1]
    logprobs = torch.zeros(weights.shape, dtype=torch.float64, device=weights.device)
    for index, lp in rows:
        logprobs[index, :lp.shape[1]] += lp
    return logprobs[:, :width], {n: p.grad.detach().double() for n, p in model.named_parameters()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pieces_bf16_match_the_whole_tree():
    rng = random.Random(1)
    root = [rng.randrange(1024) for _ in range(900)]
    batch = [root + [rng.randrange(1024) for _ in range(rng.randint(50, 700))] for _ in range(6)]
    batch += random_rollout_batch(rng, vocab=1024, n_traj=6, max_len=500)
    trees = hc.TreeBatch.from_trajectories(batch)
    reference = TreeModel.from_config(GPU_CONFIG, seed=0, dtype=torch.float64, device="cuda")
    model = TreeModel.from_config(GPU_CONFIG, seed=0, dtype=torch.bfloat16, device="cuda")
    whole = hc.compile(trees, hc.CompileOptions.for_model(model))
    pieces = hc.compile(trees, hc.CompileOptions.for_model(model, microbatch_tokens=1024))
    assert pieces.stats["pieces"]["pieces"] >= 3
    order = {t: j for j, t in enumerate(whole.program.forest.traj_ids)}
    width = max(len(t) for t in batch)
    weights = torch.randn(len(batch), width, generator=torch.Generator().manual_seed(0)).cuda()
    want = _step(reference, whole.microbatches(), weights.double(), order)
    got_whole = _step(model, whole.microbatches(), weights, order)
    got_pieces = _step(model, pieces.microbatches(), weights, order)
    whole_err, pieces_err = _rel(got_whole[0], want[0]), _rel(got_pieces[0], want[0])
    assert pieces_err <= BF16_FACTOR * whole_err + 1e-6, (pieces_err, whole_err)
    whole_grad, pieces_grad = _worst_grad(got_whole[1], want[1]), _worst_grad(got_pieces[1], want[1])
    assert pieces_grad <= BF16_FACTOR * whole_grad + 1e-6, (pieces_grad, whole_grad)
