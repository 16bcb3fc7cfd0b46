"""Token embedding whose backward sums the gradient rows of equal tokens in a fixed order, planned on the host.

torch's CUDA embedding backward reads a data-dependent count back from the device (a synchronisation per
step); here the launch plan already holds the compact tokens grouped by id (`codegen.lower`), so the backward
is one `segment_add` launch: deterministic, fp32 sums rounded once, no device read.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from harts_compiler.codegen import LaunchPlan
from harts_compiler.codegen.kernels.segment_add import segment_add


class _PlannedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, plan: LaunchPlan, padding_idx: int | None = None):
        ctx.plan, ctx.shape, ctx.dtype, ctx.padding_idx = plan, weight.shape, weight.dtype, padding_idx
        return weight.index_select(0, plan.token_ids)

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        grad_weight = torch.zeros(ctx.shape, dtype=ctx.dtype, device=grad.device)
        segment_add(grad_weight, plan.embed_ids, grad.to(ctx.dtype).contiguous(), plan.embed_bounds,
                    plan.embed_order)
        if ctx.padding_idx is not None:
            grad_weight[ctx.padding_idx] = 0
        return grad_weight, None, None


def embed_tokens(weight: torch.Tensor, plan: LaunchPlan, padding_idx: int | None = None) -> torch.Tensor:
    """[T, hidden]: the embedding rows of the plan's compact tokens. `padding_idx`: a row that gets no gradient,
    as transformers' nn.Embedding(padding_idx=pad_token_id) gives it none."""
    if plan.target.embed_triton:
        return _PlannedEmbedding.apply(weight, plan, padding_idx)
    return F.embedding(plan.token_ids, weight, padding_idx=padding_idx)
