"""Triton forward of tree attention: flash-style online softmax over the block visit lists.

One program per (query block, query head); programs are numbered heavy query blocks first
(``q_order``), heads fastest. Each program runs two loops over its visit list: the full key
blocks with no mask, then the partially masked ones with the per-element tree mask
``j <= i < subtree_end[j]`` (which also masks rows/columns past T). Softmax runs in base 2 with
``scale * log2(e)`` folded into the scores; the saved ``lse`` is in that base-2 domain.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_index import BlockIndex
from ..interpreter_safe import interpreting

LOG2E = 1.4426950408889634


@triton.jit
def _attend_block(b_q, acc, m_i, l_i, k, v, subtree_end, i_n, offs_m, offs_d, T, i_kvh,
                  scale_log2, HKV: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
                  MASKED: tl.constexpr):
    offs_n = i_n * BN + tl.arange(0, BN)
    rows_n = offs_n.to(tl.int64) * (HKV * D) + i_kvh * D
    if MASKED:
        in_range = offs_n < T
        b_k = tl.load(k + rows_n[:, None] + offs_d[None, :], mask=in_range[:, None], other=0.0)
        b_v = tl.load(v + rows_n[:, None] + offs_d[None, :], mask=in_range[:, None], other=0.0)
        b_end = tl.load(subtree_end + offs_n, mask=in_range, other=0)
    else:
        b_k = tl.load(k + rows_n[:, None] + offs_d[None, :])
        b_v = tl.load(v + rows_n[:, None] + offs_d[None, :])
    # [BM, BN] scores, base-2 scaled
    b_s = tl.dot(b_q, tl.trans(b_k)) * scale_log2
    if MASKED:
        visible = (offs_n[None, :] <= offs_m[:, None]) & (offs_m[:, None] < b_end[None, :])
        b_s = tl.where(visible, b_s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(b_s, 1))
    b_p = tl.exp2(b_s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(b_p, 1)
    acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
    return acc, m_new, l_i


@triton.jit
def _attend_range(b_q, acc, m_i, l_i, k, v, subtree_end, q_cols, lo, hi, offs_m, offs_d, T,
                  i_kvh, scale_log2, HKV: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
                  MASKED: tl.constexpr, INTERPRET: tl.constexpr):
    # visit list entries [lo, hi); see interpreter_safe.py for the while loop
    if INTERPRET:
        idx = lo
        while idx < hi:
            acc, m_i, l_i = _attend_block(b_q, acc, m_i, l_i, k, v, subtree_end,
                                          tl.load(q_cols + idx), offs_m, offs_d, T, i_kvh,
                                          scale_log2, HKV, D, BN, MASKED)
            idx += 1
    else:
        for idx in range(lo, hi):
            acc, m_i, l_i = _attend_block(b_q, acc, m_i, l_i, k, v, subtree_end,
                                          tl.load(q_cols + idx), offs_m, offs_d, T, i_kvh,
                                          scale_log2, HKV, D, BN, MASKED)
    return acc, m_i, l_i


@triton.jit
def tree_attn_fwd_kernel(q, k, v, o, lse, subtree_end, q_ptr, q_cols, q_full, q_order,
                         scale_log2, T,
                         HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    i_h = pid % HQ
    i_m = tl.load(q_order + pid // HQ)
    i_kvh = i_h // (HQ // HKV)
    offs_m = i_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    rows_m = offs_m.to(tl.int64) * (HQ * D) + i_h * D
    m_valid = offs_m < T
    # [BM, D]
    b_q = tl.load(q + rows_m[:, None] + offs_d[None, :], mask=m_valid[:, None], other=0.0)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    # finite "minus infinity" for the running max: a row whose first visited block masks all of
    # its keys must give exp2(-inf - m) = 0, not exp2(-inf - (-inf)) = nan
    m_i = tl.full([BM], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    start = tl.load(q_ptr + i_m)
    stop = tl.load(q_ptr + i_m + 1)
    full_stop = start + tl.load(q_full + i_m)
    acc, m_i, l_i = _attend_range(b_q, acc, m_i, l_i, k, v, subtree_end, q_cols, start, full_stop,
                                  offs_m, offs_d, T, i_kvh, scale_log2, HKV, D, BN, False,
                                  INTERPRET)
    acc, m_i, l_i = _attend_range(b_q, acc, m_i, l_i, k, v, subtree_end, q_cols, full_stop, stop,
                                  offs_m, offs_d, T, i_kvh, scale_log2, HKV, D, BN, True,
                                  INTERPRET)
    # rows past T saw nothing (l_i = 0); keep them finite, they are not stored
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    b_o = acc / l_safe[:, None]
    tl.store(o + rows_m[:, None] + offs_d[None, :], b_o.to(o.dtype.element_ty),
             mask=m_valid[:, None])
    tl.store(lse + i_h.to(tl.int64) * T + offs_m, m_i + tl.log2(l_safe), mask=m_valid)


def tree_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           subtree_end: torch.Tensor, index: BlockIndex, scale: float,
                           launch: dict):
    """Returns o [T, HQ, D] (dtype of q) and lse [HQ, T] fp32 (base 2, scaled scores).
    ``launch``: block_m, block_n, num_warps, num_stages (configs.py)."""
    n_tokens, n_q_heads, head_dim = q.shape
    index = index.with_blocks(launch["block_m"], launch["block_n"])
    o = torch.empty_like(q)
    lse = torch.empty(n_q_heads, n_tokens, dtype=torch.float32, device=q.device)
    grid = (index.num_query_blocks * n_q_heads,)
    if grid[0]:
        tree_attn_fwd_kernel[grid](
            q, k, v, o, lse, subtree_end, index.q_ptr, index.q_cols, index.q_full, index.q_order,
            scale * LOG2E, n_tokens, HQ=n_q_heads, HKV=k.shape[1], D=head_dim,
            BM=index.block_m, BN=index.block_n, INTERPRET=interpreting(),
            num_warps=launch["num_warps"], num_stages=launch["num_stages"])
    return o, lse
