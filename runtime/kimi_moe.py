"""Kimi Linear's MoE block (KimiLinearMoE): sigmoid scores, grouped top-k with a score-correction bias,
routed scaling, shared experts; and the expert-load statistics that update that bias.

Routing is per token, deterministic and dropless, so a shared compact token routes exactly as in every
trajectory through it. The bias `e_score_correction_bias` only chooses experts (the weights are the unbiased
scores); trainers update it from each expert's load, which trajectory-wise training counts once per token per
trajectory: here each compact token's assignments are weighted by its multiplicity (`RouterStats.assigned`, in
`TreeOutput.expert_load`). transformers computes no auxiliary loss for this block, so neither do we.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import DenseMLP, compute_dtype
from .moe import Experts, RouterStats


class GroupedRouter(nn.Module):
    """KimiLinearTopkRouter: experts in groups, each group scored by its best two biased scores; the top
    `topk_group` groups stay, the top-k experts of those are chosen by biased score and weighted by unbiased."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k, self.num_experts = config.num_experts_per_tok, config.num_experts
        self.num_group, self.topk_group = config.num_expert_group, config.topk_group
        self.normalise, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in the compute dtype, expert ids [T, k])."""
        wide = compute_dtype(x.dtype)
        scores = F.linear(x.to(wide), self.weight.to(wide)).sigmoid()
        with torch.no_grad():  # the choice has no gradient (as in transformers: topk indices)
            choice = scores + self.e_score_correction_bias.to(wide)
            per_group = choice.view(-1, self.num_group, self.num_experts // self.num_group)
            group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1)[0].sum(dim=-1)
            groups = torch.topk(group_scores, k=self.topk_group, dim=-1)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
            keep = keep.unsqueeze(-1).expand_as(per_group).reshape(-1, self.num_experts)
            # sorted: the slot order of a token is the same in any batch (the sum over slots rounds alike)
            top_index = torch.topk(choice.masked_fill(~keep, float("-inf")), k=self.top_k, dim=-1)[1]
        top_weight = scores.gather(1, top_index)
        if self.normalise:
            top_weight = top_weight / (top_weight.sum(dim=-1, keepdim=True) + 1e-20)
        return top_weight * self.scaling, top_index


class KimiMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.experts = Experts(config)
        self.gate = GroupedRouter(config)
        self.shared_experts = DenseMLP(config.hidden_size, config.moe_intermediate_size * config.num_shared_experts)

    def forward(self, x: torch.Tensor, multiplicity: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        """x [T, H] -> (y [T, H], expert loads counted once per trajectory: multiplicity [T] weighted)."""
        top_weight, top_index = self.gate(x)
        y = self.experts(x, top_index, top_weight, self.shared_experts(x))
        m = multiplicity.to(top_weight.dtype)
        with torch.no_grad():
            assigned = torch.zeros(self.gate.num_experts, dtype=m.dtype, device=x.device).index_add(
                0, top_index.reshape(-1), m.repeat_interleave(top_index.shape[1]))
        return y, RouterStats(assigned=assigned, prob_sum=None, weight=m.sum())
