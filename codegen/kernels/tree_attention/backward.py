"""Triton backward of tree attention: delta preprocess, a dq kernel and a dk/dv kernel.

Deterministic: every gradient element is written by exactly one program, with a fixed loop
order (no atomics).
- ``delta[h, i] = sum_d o[i, h, d] * do[i, h, d]`` (fp32);
- dq: one program per (query block, query head) walks the query block's visit list, in
  sub-tiles of ``BMS`` rows (keeps q, do and the dq accumulator small at head dim 256);
- dk/dv: one program per (key block, kv head) walks the *transposed* visit list (query blocks
  that see the key block) for every query head of its GQA group, accumulating dk and dv in fp32.
No ``tl.trans`` of a dot accumulator feeds another dot (Triton 3.6 Hopper miscompile, GPU.md):
the dk/dv kernel computes the transposed scores ``k q^T`` directly, and only loaded tiles are
transposed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_index import BlockIndex
from .forward import LOG2E
from .interpreter_safe import interpreting


@triton.jit
def tree_attn_bwd_delta_kernel(o, do, delta, T, HQ: tl.constexpr, D: tl.constexpr,
                               BT: tl.constexpr):
    i_t = tl.program_id(0)
    i_h = tl.program_id(1)
    offs_t = i_t * BT + tl.arange(0, BT)
    offs_d = tl.arange(0, D)
    rows = offs_t.to(tl.int64) * (HQ * D) + i_h * D
    valid = offs_t < T
    b_o = tl.load(o + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    b_do = tl.load(do + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    b_delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), 1)
    tl.store(delta + i_h.to(tl.int64) * T + offs_t, b_delta, mask=valid)


@triton.jit
def _dq_block(b_q, b_do, b_lse, b_delta, b_dq, k, v, subtree_end, i_n, offs_m, offs_d, T, i_kvh,
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
    # [BMS, BN]
    b_p = tl.exp2(tl.dot(b_q, tl.trans(b_k)) * scale_log2 - b_lse[:, None])
    if MASKED:
        visible = (offs_n[None, :] <= offs_m[:, None]) & (offs_m[:, None] < b_end[None, :])
        b_p = tl.where(visible, b_p, 0.0)
    b_dp = tl.dot(b_do, tl.trans(b_v))
    b_ds = b_p * (b_dp - b_delta[:, None])
    return b_dq + tl.dot(b_ds.to(b_k.dtype), b_k)


@triton.jit
def _dq_range(b_q, b_do, b_lse, b_delta, b_dq, k, v, subtree_end, q_cols, lo, hi, offs_m, offs_d,
              T, i_kvh, scale_log2, HKV: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
              MASKED: tl.constexpr, INTERPRET: tl.constexpr):
    # visit list entries [lo, hi); the while loop is for the interpreter (interpreter_safe.py)
    if INTERPRET:
        idx = lo
        while idx < hi:
            b_dq = _dq_block(b_q, b_do, b_lse, b_delta, b_dq, k, v, subtree_end,
                             tl.load(q_cols + idx), offs_m, offs_d, T, i_kvh, scale_log2,
                             HKV, D, BN, MASKED)
            idx += 1
    else:
        for idx in range(lo, hi):
            b_dq = _dq_block(b_q, b_do, b_lse, b_delta, b_dq, k, v, subtree_end,
                             tl.load(q_cols + idx), offs_m, offs_d, T, i_kvh, scale_log2,
                             HKV, D, BN, MASKED)
    return b_dq


@triton.jit
def tree_attn_bwd_dq_kernel(q, k, v, do, dq, lse, delta, subtree_end,
                            q_ptr, q_cols, q_full, q_order, scale, scale_log2, T,
                            HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, BMS: tl.constexpr,
                            INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    i_h = pid % HQ
    i_m = tl.load(q_order + pid // HQ)
    i_kvh = i_h // (HQ // HKV)
    offs_d = tl.arange(0, D)
    start = tl.load(q_ptr + i_m)
    stop = tl.load(q_ptr + i_m + 1)
    full_stop = start + tl.load(q_full + i_m)
    for sub in tl.static_range(BM // BMS):
        offs_m = i_m * BM + sub * BMS + tl.arange(0, BMS)
        m_valid = offs_m < T
        rows_m = offs_m.to(tl.int64) * (HQ * D) + i_h * D
        b_q = tl.load(q + rows_m[:, None] + offs_d[None, :], mask=m_valid[:, None], other=0.0)
        b_do = tl.load(do + rows_m[:, None] + offs_d[None, :], mask=m_valid[:, None], other=0.0)
        b_lse = tl.load(lse + i_h.to(tl.int64) * T + offs_m, mask=m_valid, other=0.0)
        b_delta = tl.load(delta + i_h.to(tl.int64) * T + offs_m, mask=m_valid, other=0.0)
        b_dq = tl.zeros([BMS, D], dtype=tl.float32)
        b_dq = _dq_range(b_q, b_do, b_lse, b_delta, b_dq, k, v, subtree_end, q_cols, start,
                         full_stop, offs_m, offs_d, T, i_kvh, scale_log2, HKV, D, BN, False,
                         INTERPRET)
        b_dq = _dq_range(b_q, b_do, b_lse, b_delta, b_dq, k, v, subtree_end, q_cols, full_stop,
                         stop, offs_m, offs_d, T, i_kvh, scale_log2, HKV, D, BN, True, INTERPRET)
        tl.store(dq + rows_m[:, None] + offs_d[None, :], (b_dq * scale).to(dq.dtype.element_ty),
                 mask=m_valid[:, None])


@triton.jit
def _dkdv_block(b_k, b_v, b_dk, b_dv, q, do, lse, delta, offs_n, b_end, i_h, i_m, sub, offs_d,
                T, scale_log2, HQ: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                BMS: tl.constexpr, MASKED: tl.constexpr):
    offs_m = i_m * BM + sub * BMS + tl.arange(0, BMS)
    rows_m = offs_m.to(tl.int64) * (HQ * D) + i_h * D
    head_row = i_h.to(tl.int64) * T
    if MASKED:
        m_valid = offs_m < T
        b_q = tl.load(q + rows_m[:, None] + offs_d[None, :], mask=m_valid[:, None], other=0.0)
        b_do = tl.load(do + rows_m[:, None] + offs_d[None, :], mask=m_valid[:, None], other=0.0)
        b_lse = tl.load(lse + head_row + offs_m, mask=m_valid, other=0.0)
        b_delta = tl.load(delta + head_row + offs_m, mask=m_valid, other=0.0)
    else:
        b_q = tl.load(q + rows_m[:, None] + offs_d[None, :])
        b_do = tl.load(do + rows_m[:, None] + offs_d[None, :])
        b_lse = tl.load(lse + head_row + offs_m)
        b_delta = tl.load(delta + head_row + offs_m)
    # transposed probabilities [BN, BMS], computed directly from k q^T
    b_pt = tl.exp2(tl.dot(b_k, tl.trans(b_q)) * scale_log2 - b_lse[None, :])
    if MASKED:
        visible = ((offs_n[:, None] <= offs_m[None, :]) & (offs_m[None, :] < b_end[:, None])
                   & (offs_m[None, :] < T))
        b_pt = tl.where(visible, b_pt, 0.0)
    b_dv += tl.dot(b_pt.to(b_do.dtype), b_do)
    b_dpt = tl.dot(b_v, tl.trans(b_do))
    b_dst = b_pt * (b_dpt - b_delta[None, :])
    b_dk += tl.dot(b_dst.to(b_q.dtype), b_q)
    return b_dk, b_dv


@triton.jit
def _dkdv_step(b_k, b_v, b_dk, b_dv, q, do, lse, delta, offs_n, b_end, k_rows, first, count, it,
               i_kvh, offs_d, T, scale_log2, HQ: tl.constexpr, HKV: tl.constexpr,
               D: tl.constexpr, BM: tl.constexpr, BMS: tl.constexpr, MASKED: tl.constexpr):
    G: tl.constexpr = HQ // HKV
    i_h = i_kvh * G + it // count
    i_m = tl.load(k_rows + first + it % count)
    for sub in tl.static_range(BM // BMS):
        b_dk, b_dv = _dkdv_block(b_k, b_v, b_dk, b_dv, q, do, lse, delta, offs_n, b_end, i_h, i_m,
                                 sub, offs_d, T, scale_log2, HQ, D, BM, BMS, MASKED)
    return b_dk, b_dv


@triton.jit
def _dkdv_range(b_k, b_v, b_dk, b_dv, q, do, lse, delta, offs_n, b_end, k_rows, first, count,
                i_kvh, offs_d, T, scale_log2, HQ: tl.constexpr, HKV: tl.constexpr,
                D: tl.constexpr, BM: tl.constexpr, BMS: tl.constexpr, MASKED: tl.constexpr,
                INTERPRET: tl.constexpr):
    # one flat loop over (group head, visiting query block) pairs: Triton software-pipelines
    # only innermost loops; the while loop is for the interpreter (interpreter_safe.py)
    G: tl.constexpr = HQ // HKV
    if INTERPRET:
        it = count * 0
        while it < G * count:
            b_dk, b_dv = _dkdv_step(b_k, b_v, b_dk, b_dv, q, do, lse, delta, offs_n, b_end, k_rows,
                                    first, count, it, i_kvh, offs_d, T, scale_log2, HQ, HKV, D,
                                    BM, BMS, MASKED)
            it += 1
    else:
        for it in range(0, G * count):
            b_dk, b_dv = _dkdv_step(b_k, b_v, b_dk, b_dv, q, do, lse, delta, offs_n, b_end, k_rows,
                                    first, count, it, i_kvh, offs_d, T, scale_log2, HQ, HKV, D,
                                    BM, BMS, MASKED)
    return b_dk, b_dv


@triton.jit
def tree_attn_bwd_dkdv_kernel(q, k, v, do, dk, dv, lse, delta, subtree_end,
                              k_ptr, k_rows, k_full, k_order, scale, scale_log2, T,
                              HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                              BM: tl.constexpr, BN: tl.constexpr, BMS: tl.constexpr,
                              INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    i_kvh = pid % HKV
    i_n = tl.load(k_order + pid // HKV)
    offs_n = i_n * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    n_valid = offs_n < T
    rows_n = offs_n.to(tl.int64) * (HKV * D) + i_kvh * D
    b_k = tl.load(k + rows_n[:, None] + offs_d[None, :], mask=n_valid[:, None], other=0.0)
    b_v = tl.load(v + rows_n[:, None] + offs_d[None, :], mask=n_valid[:, None], other=0.0)
    b_end = tl.load(subtree_end + offs_n, mask=n_valid, other=0)
    b_dk = tl.zeros([BN, D], dtype=tl.float32)
    b_dv = tl.zeros([BN, D], dtype=tl.float32)
    start = tl.load(k_ptr + i_n)
    n_full = tl.load(k_full + i_n)
    n_partial = tl.load(k_ptr + i_n + 1) - start - n_full
    b_dk, b_dv = _dkdv_range(b_k, b_v, b_dk, b_dv, q, do, lse, delta, offs_n, b_end, k_rows,
                             start, n_full, i_kvh, offs_d, T, scale_log2, HQ, HKV, D, BM, BMS,
                             False, INTERPRET)
    b_dk, b_dv = _dkdv_range(b_k, b_v, b_dk, b_dv, q, do, lse, delta, offs_n, b_end, k_rows,
                             start + n_full, n_partial, i_kvh, offs_d, T, scale_log2, HQ, HKV, D,
                             BM, BMS, True, INTERPRET)
    tl.store(dk + rows_n[:, None] + offs_d[None, :], (b_dk * scale).to(dk.dtype.element_ty),
             mask=n_valid[:, None])
    tl.store(dv + rows_n[:, None] + offs_d[None, :], b_dv.to(dv.dtype.element_ty),
             mask=n_valid[:, None])


def tree_attention_backward(q, k, v, o, do, lse, subtree_end, index: BlockIndex, scale: float,
                            *, dq_config: dict, dkdv_config: dict):
    """Gradients (dq, dk, dv) with the dtypes of q, k, v. Configs: dicts with keys
    ``block_ms`` (query sub-tile rows), ``num_warps``, ``num_stages``."""
    n_tokens, n_q_heads, head_dim = q.shape
    n_kv_heads = k.shape[1]
    do = do.contiguous()
    delta = torch.empty(n_q_heads, n_tokens, dtype=torch.float32, device=q.device)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    if n_tokens == 0:
        return dq, dk, dv
    delta_rows = 64 if head_dim <= 128 else 32
    tree_attn_bwd_delta_kernel[(triton.cdiv(n_tokens, delta_rows), n_q_heads)](
        o, do, delta, n_tokens, HQ=n_q_heads, D=head_dim, BT=delta_rows)
    common = dict(HQ=n_q_heads, HKV=n_kv_heads, D=head_dim, BM=index.block_m, BN=index.block_n,
                  INTERPRET=interpreting())
    tree_attn_bwd_dq_kernel[(index.num_query_blocks * n_q_heads,)](
        q, k, v, do, dq, lse, delta, subtree_end, index.q_ptr, index.q_cols, index.q_full,
        index.q_order, scale, scale * LOG2E, n_tokens, **common,
        BMS=min(dq_config["block_ms"], index.block_m), num_warps=dq_config["num_warps"],
        num_stages=dq_config["num_stages"])
    tree_attn_bwd_dkdv_kernel[(index.num_key_blocks * n_kv_heads,)](
        q, k, v, do, dk, dv, lse, delta, subtree_end, index.k_ptr, index.k_rows, index.k_full,
        index.k_order, scale, scale * LOG2E, n_tokens, **common,
        BMS=min(dkdv_config["block_ms"], index.block_m), num_warps=dkdv_config["num_warps"],
        num_stages=dkdv_config["num_stages"])
    return dq, dk, dv
