"""Gated full attention (Qwen3NextAttention) over compact tokens with the tree mask.

q/gate interleaved per head in q_proj, zero-centred q/k norms over the head dim, partial RoPE at
trajectory positions (`index.positions`), GQA, sigmoid output gate, o_proj. The attention itself is
`tree_attention(q, k, v, subtree_end)` (docs/design.md section 7): the Triton kernel on CUDA for bf16/fp16,
the plain torch path elsewhere.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from harts_compiler.codegen import LaunchPlan
from harts_compiler.codegen.kernels.tree_attention import check_tree_attention_inputs, tree_mask
from harts_compiler.codegen.kernels.tree_attention import tree_attention as tree_attention_kernel

from .config import ModelConfig
from .layers import ZeroCentredRMSNorm, apply_partial_rope


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: LaunchPlan, *,
                   scale: float) -> torch.Tensor:
    """The Triton kernel with the plan's block lists where the plan's target runs it (16-bit on CUDA), else
    plain torch over the plan's query windows (not Triton's interpreter, which is for kernel tests). fp32 stays
    off the kernel because its dots would round fp32 operands through TF32 (~1e-3 relative)."""
    if plan.target.attention_tiles:
        return tree_attention_kernel(q, k, v, plan.subtree_end, scale=scale, block_index=plan.attention)
    return windowed_tree_attention(q, k, v, plan.subtree_end, scale=scale, windows=plan.windows)


def windowed_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, subtree_end: torch.Tensor, *,
                            scale: float, windows) -> torch.Tensor:
    """Plain torch tree attention that only touches keys a query block can see.

    Same masked softmax as the kernels' dense reference, but query block [s, e) only reads keys
    [lo, e), lo = the first key still open at s (subtree_end > s). Many trees or trajectories in
    one microbatch (the trajectory-wise baseline) then cost O(T * tree length), not O(T^2).
    Masked keys contribute exact zeros, so the result is the reference's up to summation order.
    `windows`: `tree_attention.query_windows(subtree_end, query_block, num_queries)` (host), computed with the
    plan; the queries are the last q.shape[0] keys (a piece of a split tree has context keys before them).
    """
    check_tree_attention_inputs(q, k, v, subtree_end)
    Tq, HQ, _ = q.shape
    q0 = k.shape[0] - Tq
    group = HQ // k.shape[1]
    positions = torch.arange(k.shape[0], device=q.device)
    # under autograd each block is checkpointed, so only one block's [HQ, M, N] scores are alive
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))

    def block(q_rows, k_rows, v_rows, query_index, key_index):
        mask = tree_mask(subtree_end, query_index, key_index)  # [M, N]
        k_heads = k_rows.transpose(0, 1).repeat_interleave(group, dim=0)  # [HQ, N, D]
        v_heads = v_rows.transpose(0, 1).repeat_interleave(group, dim=0)
        scores = torch.matmul(q_rows.transpose(0, 1), k_heads.transpose(1, 2)) * scale
        probs = torch.softmax(scores.masked_fill(~mask[None], float("-inf")), dim=-1)
        return torch.matmul(probs, v_heads).transpose(0, 1)  # [M, HQ, Dv]

    outputs = []
    for start, end, lo in windows:
        args = (q[start - q0:end - q0], k[lo:end], v[lo:end], positions[start:end], positions[lo:end])
        outputs.append(checkpoint(block, *args, use_reentrant=False) if needs_grad else block(*args))
    return torch.cat(outputs) if outputs else q.new_empty((Tq, HQ, v.shape[-1]))


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
        carry = ctx.layer_carry(self.layer_idx)
        if carry is not None:  # a piece: the context's K/V in front, its queries are the last T keys
            k, v = carry.attention_keys(k, v)
        out = (ctx.attention_kernel or tree_attention)(q, k, v, ctx.plan, scale=self.scaling)
        out = out.reshape(T, -1) * torch.sigmoid(gate)
        return self.o_proj(out)
