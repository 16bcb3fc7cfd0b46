"""Kimi Delta Attention mixer (transformers' KimiLinearDeltaAttention, BailingHybridDeltaAttention) in tree mode.

Parameters carry transformers' names and shapes (`self_attn.q_proj`, `conv1d`, `forget_gate.f_a_proj`, ...), so
`from_hf` shares them. Token-local parts (projections, the low-rank forget gate, beta, the output gate and its
norm, o_proj) run once per compact token; the short conv over [q|k|v] reads each token's path predecessors and
the recurrence runs over the plan's rounds with the "kda" rule of `ops.linear_attention`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import SigmoidGatedRMSNorm, compute_dtype
from .ops.conv import tree_causal_conv
from .ops.linear_attention import linear_attention_rounds


class ForgetGate(nn.Module):
    """One log decay per key channel. Kimi (KimiLinearForgetGate): g = -exp(A_log_h) * softplus(f_b(f_a(x)) +
    dt_bias). Ling 3.0 (BailingHybridForgetGate): full-rank f_proj, and with the safe gate
    g = lower_bound * sigmoid(exp(A_log_h) * (f_proj(x) + dt_bias)), bounded in (lower_bound, 0)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.linear_num_value_heads, config.linear_key_head_dim
        self.full_rank, self.safe, self.lower_bound = (config.kda_full_rank_gates, config.kda_safe_gate,
                                                       config.kda_lower_bound)
        width = self.num_heads * self.head_dim
        if self.full_rank:
            self.f_proj = nn.Linear(config.hidden_size, width, bias=False)
            self.A_log = nn.Parameter(torch.empty(self.num_heads))
        else:
            self.f_a_proj = nn.Linear(config.hidden_size, self.head_dim, bias=False)
            self.f_b_proj = nn.Linear(self.head_dim, width, bias=False)
            self.A_log = nn.Parameter(torch.empty(1, 1, self.num_heads, 1))  # transformers' shape
        self.dt_bias = nn.Parameter(torch.empty(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> g [T, H, K] in fp32 (fp64 for fp64 runs), as transformers computes it."""
        wide = compute_dtype(x.dtype)
        f = self.f_proj(x) if self.full_rank else self.f_b_proj(self.f_a_proj(x))
        g = (f.to(wide) + self.dt_bias.to(wide)).view(x.shape[0], self.num_heads, -1)
        rate = self.A_log.to(wide).exp().view(self.num_heads, 1)
        if self.safe:
            return self.lower_bound * torch.sigmoid(rate * g)
        if self.full_rank:
            return -rate * F.softplus(g)
        # transformers' Kimi softplus with its threshold (identity above 20), written the same way
        return -rate * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads, self.head_dim = config.linear_num_value_heads, config.linear_key_head_dim
        self.qkv_dim = self.num_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, self.qkv_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.qkv_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.qkv_dim, bias=False)
        width = config.linear_conv_kernel_dim
        # nn.Conv1d only as a parameter holder: transformers' name and shape [3 * qkv, 1, W]
        self.conv1d = nn.Conv1d(3 * self.qkv_dim, 3 * self.qkv_dim, kernel_size=width, groups=3 * self.qkv_dim,
                                bias=False, padding=width - 1)
        self.forget_gate = ForgetGate(config)
        self.b_proj = nn.Linear(hidden, self.num_heads, bias=False)
        if config.kda_full_rank_gates:
            self.g_proj = nn.Linear(hidden, self.qkv_dim, bias=False)
        else:
            self.g_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
            self.g_b_proj = nn.Linear(self.head_dim, self.qkv_dim, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(self.qkv_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """x [T, hidden] (normed) -> [T, hidden]. ctx: the per-forward `ExecutionContext`."""
        T, heads = x.shape[0], (x.shape[0], self.num_heads, self.head_dim)
        carry = ctx.layer_carry(self.layer_idx)
        # in a piece the outputs have the carried replay rows after the own T rows
        q, k, v = (t.to(x.dtype).reshape(-1, self.num_heads, self.head_dim) for t in tree_causal_conv(
            (self.q_proj(x), self.k_proj(x), self.v_proj(x)), self.conv1d.weight.squeeze(1), ctx.plan,
            activation="silu", carry=carry))
        g = self.forget_gate(x)
        beta = torch.sigmoid(self.b_proj(x))
        o = linear_attention_rounds(q, k, v, g, beta, ctx.plan, rule="kda", scale=self.head_dim ** -0.5,
                                    state_dtype=compute_dtype(x.dtype), use_qk_l2norm=True, kernel=ctx.kda_kernel,
                                    carry=carry)
        gate = (self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))).view(heads)
        return self.o_proj(self.o_norm(o, gate).reshape(T, self.qkv_dim))
