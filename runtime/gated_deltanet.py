"""Gated DeltaNet mixer (Qwen3NextGatedDeltaNet / Qwen3_5GatedDeltaNet) in tree mode.

Parameters carry transformers' names and shapes, so `from_hf` can share them and checkpoints load
by name. Token-local parts (projections, gates, gated norm, out_proj) run once per compact token;
the short conv reads each token's path predecessors (`plan.conv_pred`) and the recurrence runs over
the plan's rounds (`ops.linear_attention`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import GatedRMSNorm, compute_dtype
from .ops.conv import tree_causal_conv
from .ops.linear_attention import gated_delta_rule_rounds


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.flat = config.flat_linear_projections
        hidden = config.hidden_size
        conv_dim = 2 * self.key_dim + self.value_dim
        # nn.Conv1d only as a parameter holder, so the weight has transformers' name and shape [Ch, 1, W]
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel_size=self.conv_kernel_size, groups=conv_dim,
                                bias=False, padding=self.conv_kernel_size - 1)
        if self.flat:  # Qwen3.5
            self.in_proj_qkv = nn.Linear(hidden, conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        else:  # Qwen3-Next: outputs grouped per key head
            self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden, 2 * self.num_v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(self.head_v_dim, eps=config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def _project(self, x: torch.Tensor):
        """x [T, hidden] -> the conv's parts q, k [T, key_dim], v [T, value_dim] (column slices of one projection),
        z [T, HV, dv], b, a [T, HV]."""
        T = x.shape[0]
        if self.flat:
            z = self.in_proj_z(x).reshape(T, self.num_v_heads, self.head_v_dim)
            q, k, v = torch.split(self.in_proj_qkv(x), [self.key_dim, self.key_dim, self.value_dim], dim=1)
            return q, k, v, z, self.in_proj_b(x), self.in_proj_a(x)
        # transformers' rows are grouped per key head (q, k, v, z of head 0, then head 1, ...): regrouping the
        # weight's rows into q | k | v | z order (a copy of the weight, not of the activations) makes q, k, v and z
        # column slices of one product, which the conv reads in place
        group = self.num_v_heads // self.num_k_heads
        widths = [self.head_k_dim, self.head_k_dim, group * self.head_v_dim, group * self.head_v_dim]
        weight = self.in_proj_qkvz.weight.view(self.num_k_heads, sum(widths), -1)
        weight = torch.cat([rows.reshape(-1, weight.shape[-1]) for rows in weight.split(widths, dim=1)])
        q, k, v, z = torch.split(F.linear(x, weight), [self.key_dim, self.key_dim, self.value_dim, self.value_dim],
                                 dim=1)
        b, a = torch.split(self.in_proj_ba(x).view(T, self.num_k_heads, 2 * group), [group, group], dim=2)
        return (q, k, v, z.reshape(T, self.num_v_heads, self.head_v_dim), b.reshape(T, self.num_v_heads),
                a.reshape(T, self.num_v_heads))

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """x [T, hidden] (normed) -> [T, hidden]. ctx: the per-forward `ExecutionContext`."""
        T = x.shape[0]
        q, k, v, z, b, a = self._project(x)
        carry = ctx.layer_carry(self.layer_idx)
        # in a piece the outputs have the carried replay rows after the own T rows
        q, k, v = (t.to(x.dtype) for t in tree_causal_conv((q, k, v), self.conv1d.weight.squeeze(1), ctx.plan,
                                                           activation="silu", carry=carry))
        q = q.reshape(-1, self.num_k_heads, self.head_k_dim)
        k = k.reshape(-1, self.num_k_heads, self.head_k_dim)
        v = v.reshape(-1, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid()
        wide = compute_dtype(x.dtype)
        # as transformers: g in fp32 (wider for fp64 runs), A_log never in low precision
        g = -self.A_log.to(wide).exp() * F.softplus(a.to(wide) + self.dt_bias)
        # gated_delta_rule_rounds = linear_attention_rounds(rule="gdn"), under the name bench/breakdown.py times
        o = gated_delta_rule_rounds(q, k, v, g, beta, ctx.plan, scale=self.head_k_dim ** -0.5, state_dtype=wide,
                                    use_qk_l2norm=True, kernel=ctx.gdn_kernel, carry=carry)
        o = self.norm(o, z)  # z: a column slice of the projection, which the norm kernel reads in place
        return self.out_proj(o.reshape(T, self.value_dim))
