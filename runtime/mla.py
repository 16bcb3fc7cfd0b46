"""Multi-head latent attention (transformers' KimiLinearAttention / BailingHybridAttention) over compact tokens.

Low-rank queries (`q_a_proj` -> `q_a_layernorm` -> `q_b_proj`, or a plain `q_proj` without `q_lora_rank`), one
compressed key/value latent per token (`kv_a_proj_with_mqa` -> `kv_a_layernorm` -> `kv_b_proj`) plus a rope key
part shared by all heads. q/k heads are nope + rope wide, v heads `v_head_dim`. With `mla_use_nope` (Kimi Linear,
and all that transformers' KimiLinearAttention computes) no RoPE is applied; otherwise the rope parts of q and k
are rotated at each token's position in its trajectory, i.e. its depth in the tree: on interleaved pairs with
`rope_interleave` (DeepSeek's layout, Ling 3.0), rotate-half otherwise. Gated MLA (`mla_output_gate`, Ling 3.0)
scales each head's output by sigmoid(g_proj(x)) before o_proj.
The tree attention takes one head size for q, k and v, so v is zero-padded to the q/k width and the padding
sliced off the output: the padded columns of the output are exact zeros and the result is unchanged.
"""
from __future__ import annotations

import torch
from torch import nn

from .attention import tree_attention
from .config import ModelConfig
from .layers import RMSNorm, apply_interleaved_rope, apply_partial_rope, compute_dtype


class MultiLatentAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, bias = config.hidden_size, config.attention_bias
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.qk_dim = self.nope_dim + self.rope_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.use_rope = not config.mla_use_nope
        self.rotate = apply_interleaved_rope if config.rope_interleave else apply_partial_rope
        self.scaling = self.qk_dim ** -0.5
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.num_heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=1e-6)  # transformers' default eps here
            self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=1e-6)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=bias)
        if config.mla_output_gate:
            self.g_proj = nn.Linear(hidden, self.num_heads, bias=False)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """x [T, hidden] (normed) -> [T, hidden]; RoPE tables (rope part only) from the per-forward context."""
        T, H = x.shape[0], self.num_heads
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, H, self.qk_dim)
        latent, k_rot = torch.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(T, H, self.nope_dim + self.v_dim)
        k_nope, v = torch.split(kv, [self.nope_dim, self.v_dim], dim=-1)
        k_rot = k_rot.view(T, 1, self.rope_dim)
        if self.use_rope:
            cos, sin = ctx.rope(x.dtype)
            q = torch.cat([q[..., :self.nope_dim], self.rotate(q[..., self.nope_dim:], cos, sin)], dim=-1)
            k_rot = self.rotate(k_rot, cos, sin)
        k = torch.cat([k_nope, k_rot.expand(T, H, self.rope_dim)], dim=-1)
        carry = ctx.layer_carry(self.layer_idx)
        if carry is not None:
            k, v = carry.attention_keys(k, v)
        out = (ctx.attention_kernel or tree_attention)(q, k, v.contiguous(), ctx.plan, scale=self.scaling)
        if hasattr(self, "g_proj"):  # as transformers: the gate in fp32 (wider for fp64), then the model dtype
            out = out * torch.sigmoid(self.g_proj(x).to(compute_dtype(x.dtype))).to(x.dtype).unsqueeze(-1)
        return self.o_proj(out.reshape(T, H * self.v_dim))
