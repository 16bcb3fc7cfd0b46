"""Gated full attention (Qwen3NextAttention) over compact tokens with the tree mask.

q/gate interleaved per head in q_proj, zero-centred q/k norms over the head dim, partial RoPE at
trajectory positions (`index.positions`), GQA, sigmoid output gate, o_proj. The attention itself is
`tree_attention(q, k, v, subtree_end)` (DESIGN.md section 7): the Triton kernel on CUDA for bf16/fp16,
the plain torch path elsewhere.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from harts_compiler.codegen.kernels.tree_attention import (build_block_index, check_tree_attention_inputs,
                                                           config_for, tree_mask)
from harts_compiler.codegen.kernels.tree_attention import tree_attention as tree_attention_kernel
from harts_compiler.codegen.kernels.tree_attention.configs import SUPPORTED_HEAD_DIMS

from .config import ModelConfig
from .layers import ZeroCentredRMSNorm, apply_partial_rope

_QUERY_BLOCK = 256  # CPU path: queries per block


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, subtree_end: torch.Tensor, *,
                   scale: float, block_cache: dict | None = None) -> torch.Tensor:
    """CUDA, bf16/fp16: the Triton kernel, its block index built once per microbatch (cached in
    `block_cache`). CPU, fp32/fp64 and head dims the kernel lacks: plain torch (not Triton's
    interpreter, which is for kernel tests). fp32 stays off the kernel because its dots would round
    fp32 operands through TF32 (~1e-3 relative), which is not what an fp32 model asks for."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[2] in SUPPORTED_HEAD_DIMS:
        block_index = None
        if block_cache is not None:
            key = q.shape[2]
            if key not in block_cache:
                config = config_for(q.shape[2])
                block_cache[key] = build_block_index(subtree_end, config.block_m, config.block_n)
            block_index = block_cache[key]
        return tree_attention_kernel(q, k, v, subtree_end, scale=scale, block_index=block_index)
    windows = None
    if block_cache is not None:  # the same for every attention layer of the microbatch
        if "windows" not in block_cache:
            block_cache["windows"] = query_windows(subtree_end, _QUERY_BLOCK)
        windows = block_cache["windows"]
    return windowed_tree_attention(q, k, v, subtree_end, scale=scale, windows=windows)


def query_windows(subtree_end: torch.Tensor, query_block: int = _QUERY_BLOCK) -> list[tuple[int, int, int]]:
    """(start, end, lo) per query block [start, end): lo = the first key still open at `start`
    (subtree_end[k] > start, k < start), else start. Keys before lo are masked for the whole block.

    The first k with subtree_end[k] > s is the first k whose running maximum of subtree_end
    exceeds s, so all blocks take one cummax + searchsorted and one host transfer.
    """
    T = subtree_end.numel()
    starts = torch.arange(0, T, query_block, device=subtree_end.device)
    if not T:
        return []
    running_max = torch.cummax(subtree_end.long(), dim=0).values
    first_open = torch.searchsorted(running_max, starts, right=True)
    lows = torch.minimum(first_open, starts).tolist()
    return [(start, min(start + query_block, T), lo) for start, lo in zip(range(0, T, query_block), lows)]


def windowed_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, subtree_end: torch.Tensor, *,
                            scale: float, query_block: int = _QUERY_BLOCK,
                            windows: list[tuple[int, int, int]] | None = None) -> torch.Tensor:
    """Plain torch tree attention that only touches keys a query block can see.

    Same masked softmax as the kernels' dense reference, but query block [s, e) only reads keys
    [lo, e), lo = the first key still open at s (subtree_end > s). Many trees or trajectories in
    one microbatch (the trajectory-wise baseline) then cost O(T * tree length), not O(T^2).
    Masked keys contribute exact zeros, so the result is the reference's up to summation order.
    `windows`: `query_windows(subtree_end, query_block)`, passed when already computed for the microbatch.
    """
    check_tree_attention_inputs(q, k, v, subtree_end)
    T, HQ, _ = q.shape
    group = HQ // k.shape[1]
    positions = torch.arange(T, device=q.device)
    # under autograd each block is checkpointed, so only one block's [HQ, M, N] scores are alive
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))

    def block(q_rows, k_rows, v_rows, query_index, key_index):
        mask = tree_mask(subtree_end, query_index, key_index)  # [M, N]
        k_heads = k_rows.transpose(0, 1).repeat_interleave(group, dim=0)  # [HQ, N, D]
        v_heads = v_rows.transpose(0, 1).repeat_interleave(group, dim=0)
        scores = torch.matmul(q_rows.transpose(0, 1), k_heads.transpose(1, 2)) * scale
        probs = torch.softmax(scores.masked_fill(~mask[None], float("-inf")), dim=-1)
        return torch.matmul(probs, v_heads).transpose(0, 1)  # [M, HQ, D]

    outputs = []
    for start, end, lo in query_windows(subtree_end, query_block) if windows is None else windows:
        args = (q[start:end], k[lo:end], v[lo:end], positions[start:end], positions[lo:end])
        outputs.append(checkpoint(block, *args, use_reentrant=False) if needs_grad else block(*args))
    return torch.cat(outputs) if outputs else q.new_empty(q.shape)


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
