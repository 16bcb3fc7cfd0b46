"""Gated full attention (Qwen3NextAttention) over compact tokens with the tree mask.

q/gate interleaved per head in q_proj, zero-centred q/k norms over the head dim, partial RoPE at
trajectory positions (`index.positions`), GQA, sigmoid output gate, o_proj. The attention itself is
`tree_attention(q, k, v, subtree_end)` (DESIGN.md section 7): the Triton kernel on CUDA when it
exists, the plain torch reference elsewhere.
"""
from __future__ import annotations

import torch
from torch import nn

from harts_compiler.codegen.kernels.tree_attention import (build_block_index, config_for,
                                                           tree_attention as tree_attention_kernel,
                                                           tree_attention_reference,
                                                           tree_attention_reference_chunked)

from .config import ModelConfig
from .layers import ZeroCentredRMSNorm, apply_partial_rope

# Below this many tokens the dense [H, T, T] reference is cheapest; above it the query-chunked one
# bounds memory.
_DENSE_REFERENCE_MAX_TOKENS = 1024


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, subtree_end: torch.Tensor, *,
                   scale: float, block_cache: dict | None = None) -> torch.Tensor:
    """CUDA: the Triton kernel, its block index built once per microbatch (cached in `block_cache`).
    CPU and fp64: the plain torch reference (not Triton's interpreter, which is for kernel tests)."""
    if q.is_cuda and q.dtype != torch.float64:
        block_index = None
        if block_cache is not None:
            key = q.shape[2]
            if key not in block_cache:
                config = config_for(q.shape[2])
                block_cache[key] = build_block_index(subtree_end, config.block_m, config.block_n)
            block_index = block_cache[key]
        return tree_attention_kernel(q, k, v, subtree_end, scale=scale, block_index=block_index)
    if q.shape[0] <= _DENSE_REFERENCE_MAX_TOKENS:
        return tree_attention_reference(q, k, v, subtree_end, scale=scale)
    return tree_attention_reference_chunked(q, k, v, subtree_end, scale=scale)


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """x [T, hidden] (normed) -> [T, hidden]; RoPE tables come from the per-forward context."""
        T = x.shape[0]
        q, gate = torch.chunk(self.q_proj(x).view(T, self.num_heads, 2 * self.head_dim), 2, dim=-1)
        gate = gate.reshape(T, -1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(T, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        cos, sin = ctx.rope(x.dtype)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        out = tree_attention(q, k, v, ctx.index.subtree_end, scale=self.scaling, block_cache=ctx.attention_blocks)
        out = out.reshape(T, -1) * torch.sigmoid(gate)
        return self.o_proj(out)
