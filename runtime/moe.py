"""Sparse MoE block (Qwen3NextSparseMoeBlock / Qwen3_5MoeSparseMoeBlock) and its routing statistics.

Routing is per token, deterministic and dropless, so a shared compact token routes exactly as it
would in every trajectory containing it. The load-balancing statistics of trajectory-wise training
count every token once per trajectory; here each compact token is weighted by its multiplicity
(docs/design.md section 8), which makes them equal to transformers' `load_balancing_loss_func` on the
right-padded batch of all trajectories with its 2-D attention mask.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ..codegen.kernels.moe_combine import moe_combine, moe_dispatch
from .config import ModelConfig
from .layers import DenseMLP, compute_dtype

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@dataclasses.dataclass
class RouterStats:
    """Multiplicity-weighted routing sums of one MoE layer (all [E] except `weight`)."""

    assigned: torch.Tensor  # sum over tokens of m_t * [e in top-k(t)]  (no gradient, like transformers)
    prob_sum: torch.Tensor | None  # sum over tokens of m_t * softmax(router_logits_t)[e]  (differentiable);
                                   # None where the block has no load-balancing loss (Kimi's biased routing)
    weight: torch.Tensor  # scalar: sum of m_t


class Router(nn.Module):
    """Qwen3NextTopKRouter: fp32 softmax (wider for fp64 runs), top-k, optional renormalisation."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.normalise = config.normalise_topk
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def forward(self, x: torch.Tensor):
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=compute_dtype(logits.dtype))
        top_value, top_index = torch.topk(probs, self.top_k, dim=-1)
        if self.normalise:
            top_value = top_value / top_value.sum(dim=-1, keepdim=True)
        return probs, top_value.to(logits.dtype), top_index


class Experts(nn.Module):
    """Experts stored fused like transformers: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def forward(self, x: torch.Tensor, top_index: torch.Tensor, top_weight: torch.Tensor,
                shared: torch.Tensor | None = None, shared_logit: torch.Tensor | None = None) -> torch.Tensor:
        """[T, H]: the routed experts' weighted sum, plus the shared expert's output (gated by
        sigmoid(shared_logit) where given) in the same pass."""
        routing = sort_by_expert(top_index, self.num_experts)
        rows = moe_dispatch(x, routing.token_of, routing.position)  # each token's row once per slot, by expert
        hidden = expert_ffn(rows, self.gate_up_proj, self.down_proj, routing.counts)
        # each token's k slots summed in slot order plus the shared term, no atomics (codegen/kernels/moe_combine)
        return moe_combine(hidden, routing.position, top_weight, shared, shared_logit)


@dataclasses.dataclass
class ExpertRouting:
    """A microbatch's (token, slot) assignments sorted by expert (stable: tokens in order within an expert)."""

    token_of: torch.Tensor  # [T*k]: the token of each sorted assignment
    position: torch.Tensor  # [T, k]: the sorted row of each (token, slot)
    counts: torch.Tensor  # [E]: assignments per expert (long)


def sort_by_expert(top_index: torch.Tensor, num_experts: int) -> ExpertRouting:
    top_k = top_index.shape[1]
    flat_expert = top_index.reshape(-1)
    order = torch.argsort(flat_expert, stable=True)  # flat (token, slot) index of each sorted assignment
    # scatter_add, not bincount: bincount sizes its output from the data, a device read on CUDA
    counts = torch.zeros(num_experts, dtype=torch.long, device=top_index.device).scatter_add_(
        0, flat_expert, torch.ones_like(flat_expert))
    position = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return ExpertRouting(token_of=order // top_k, position=position.view(-1, top_k), counts=counts)


def expert_ffn(xs: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
               counts: torch.Tensor) -> torch.Tensor:
    """SwiGLU of each expert over its rows: xs [N, H] grouped by expert, counts[e] rows for expert e of
    gate_up_proj [E, 2I, H] / down_proj [E, H, I] -> [N, H]."""
    if xs.is_cuda and _grouped_mm is not None and xs.dtype == torch.bfloat16:
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        gate_up = _grouped_mm(xs, gate_up_proj.transpose(1, 2), offs=offsets)
        gate, up = gate_up.chunk(2, dim=-1)
        return _grouped_mm(F.silu(gate) * up, down_proj.transpose(1, 2), offs=offsets)
    pieces, start = [], 0  # a plain loop over the experts that received rows
    for expert, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        rows = xs[start:start + count]
        gate, up = F.linear(rows, gate_up_proj[expert]).chunk(2, dim=-1)
        pieces.append(F.linear(F.silu(gate) * up, down_proj[expert]))
        start += count
    if pieces:
        return torch.cat(pieces)
    # no rows: an empty result that still depends on the weights, so that their gradient exists (exact
    # zeros) on every rank: FSDP2 reduce-scatters only the gradients a rank has, and all ranks must agree
    return xs + 0.0 * (gate_up_proj.sum() + down_proj.sum())


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config)
        self.shared_expert = DenseMLP(config.hidden_size, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, multiplicity: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        """x [T, H] -> (y [T, H], routing statistics weighted by multiplicity [T])."""
        shared = self.shared_expert(x)
        probs, top_weight, top_index = self.gate(x)
        y = self.experts(x, top_index, top_weight, shared, self.shared_expert_gate(x))
        m = multiplicity.to(probs.dtype)
        with torch.no_grad():
            assigned = torch.zeros(probs.shape[1], dtype=probs.dtype, device=x.device).index_add(
                0, top_index.reshape(-1), m.repeat_interleave(top_index.shape[1]))
        stats = RouterStats(assigned=assigned, prob_sum=(probs * m[:, None]).sum(0), weight=m.sum())
        return y, stats


def load_balancing_loss(stats: list[RouterStats], num_experts: int) -> torch.Tensor | None:
    """transformers' load_balancing_loss_func over all MoE layers, multiplicity-weighted.

    f_e = sum_layers assigned_e / (layers * tokens), P_e = sum_layers prob_sum_e / (layers * tokens),
    loss = E * sum_e f_e P_e, with tokens counted once per trajectory.
    """
    if not stats or any(s.prob_sum is None for s in stats):
        return None
    total = sum(s.weight for s in stats)
    total = torch.where(total > 0, total, torch.ones_like(total))  # empty microbatch: loss 0, not NaN
    tokens_per_expert = sum(s.assigned for s in stats) / total
    prob_per_expert = sum(s.prob_sum for s in stats) / total
    return num_experts * torch.sum(tokens_per_expert * prob_per_expert)
