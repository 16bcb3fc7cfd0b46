"""Triton backward of tree attention: delta preprocess, a dq kernel and a dk/dv kernel.

Deterministic: every gradient element is written by exactly one program, with a fixed loop
order (no atomics).
- ``delta[h, i] = sum_d o[i, h, d] * do[i, h, d]`` (fp32);
- dq: one program per (query sub-tile of ``BMS`` rows, query head) walks the visit list of the
  query block that holds the sub-tile (small sub-tiles keep q, do and the fp32 dq accumulator
  in registers at head dim 256);
- dk/dv: one program per (key block, kv head) walks the *transposed* visit list (query blocks
  that see the key block), in sub-tiles of ``BMS`` rows, for every query head of its GQA group.
  It accumulates the *transposed* gradients ``dk^T, dv^T [D, BN]`` (fp32) as
  ``do^T p`` and ``q^T ds``: k and v then only ever serve as shared-memory B operands, which
  leaves the registers to the two accumulators (with ``k q^T`` as A operand, k and v would sit
  in registers too and spill at D = 256). Its q and do sub-tiles come in through tensor descriptors
  (no register staging); the dq kernel loads k and v with pointers, which measured faster there.
No ``tl.trans`` of a dot accumulator feeds another dot (Triton 3.6 Hopper miscompile, docs/gdn_kernels.md):
only loaded tiles are transposed; p and ds enter the next dots untransposed.
Suffix queries and head dims as in forward.py: q, do, dq, lse and delta by local query rows, the mask
by global rows (``HAS_OFFSET``); q/k/dq/dk in tiles D1 (+ D2), v/do/dv with DV. Key blocks that no
query sees (context keys, say) have empty lists and get zero dk/dv.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_index import BlockIndex
from .forward import LOG2E, head_descriptors, head_dims, load_key_block, query_rows, scores, token_descriptor
from ..interpreter_safe import interpreting


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
def _key_block_by_pointers(k, v, subtree_end, i_n, i_kvh, TK, HKV: tl.constexpr, D: tl.constexpr,
                           D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr, BN: tl.constexpr,
                           MASKED: tl.constexpr):
    """load_key_block with pointer loads, for the dq kernel: there tensor descriptors measured 8% slower at
    head dim 256 (its one-stage loop then stages each tile through shared memory and registers) and 1.5% faster
    at MLA's 192 / 128; the forward and the dk/dv kernel gain from them."""
    offs_n = i_n * BN + tl.arange(0, BN)
    rows_k = offs_n.to(tl.int64) * (HKV * D) + i_kvh * D
    rows_v = offs_n.to(tl.int64) * (HKV * DV) + i_kvh * DV
    in_range = offs_n < TK
    b_k, b_k2 = query_rows(k, rows_k, in_range, D1, D2, MASKED)
    if MASKED:
        b_v = tl.load(v + rows_v[:, None] + tl.arange(0, DV)[None, :], mask=in_range[:, None], other=0.0)
        b_end = tl.load(subtree_end + offs_n, mask=in_range, other=0)
    else:
        b_v = tl.load(v + rows_v[:, None] + tl.arange(0, DV)[None, :])
        b_end = offs_n  # dummy: unmasked blocks need no ends
    return offs_n, b_k, b_k2, b_v, b_end


@triton.jit
def _dq_block(b_q, b_q2, b_do, b_lse, b_delta, b_dq, b_dq2, k, v, subtree_end, i_n, rows_g, TK,
              i_kvh, scale_log2, HKV: tl.constexpr, D: tl.constexpr, D1: tl.constexpr,
              D2: tl.constexpr, DV: tl.constexpr, BN: tl.constexpr, MASKED: tl.constexpr):
    offs_n, b_k, b_k2, b_v, b_end = _key_block_by_pointers(k, v, subtree_end, i_n, i_kvh, TK, HKV, D, D1, D2,
                                                           DV, BN, MASKED)
    # [BMS, BN]
    b_p = tl.exp2(scores(b_q, b_q2, b_k, b_k2, D2) * scale_log2 - b_lse[:, None])
    if MASKED:
        visible = (offs_n[None, :] <= rows_g[:, None]) & (rows_g[:, None] < b_end[None, :])
        b_p = tl.where(visible, b_p, 0.0)
    b_dp = tl.dot(b_do, tl.trans(b_v))
    b_ds = (b_p * (b_dp - b_delta[:, None])).to(b_k.dtype)
    b_dq = b_dq + tl.dot(b_ds, b_k)
    if D2 > 0:
        b_dq2 = b_dq2 + tl.dot(b_ds, b_k2)
    return b_dq, b_dq2


@triton.jit
def _dq_range(b_q, b_q2, b_do, b_lse, b_delta, b_dq, b_dq2, k, v, subtree_end, q_cols, lo, hi,
              rows_g, TK, i_kvh, scale_log2, HKV: tl.constexpr, D: tl.constexpr,
              D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr, BN: tl.constexpr,
              MASKED: tl.constexpr, INTERPRET: tl.constexpr):
    # visit list entries [lo, hi); the while loop is for the interpreter (interpreter_safe.py)
    if INTERPRET:
        idx = lo
        while idx < hi:
            b_dq, b_dq2 = _dq_block(b_q, b_q2, b_do, b_lse, b_delta, b_dq, b_dq2, k, v,
                                    subtree_end, tl.load(q_cols + idx), rows_g, TK, i_kvh,
                                    scale_log2, HKV, D, D1, D2, DV, BN, MASKED)
            idx += 1
    else:
        for idx in range(lo, hi):
            b_dq, b_dq2 = _dq_block(b_q, b_q2, b_do, b_lse, b_delta, b_dq, b_dq2, k, v,
                                    subtree_end, tl.load(q_cols + idx), rows_g, TK, i_kvh,
                                    scale_log2, HKV, D, D1, D2, DV, BN, MASKED)
    return b_dq, b_dq2


@triton.jit
def tree_attn_bwd_dq_kernel(q, k, v, do, dq, lse, delta, subtree_end,
                            q_ptr, q_cols, q_full, q_order, scale, scale_log2, TQ, TK, q_offset,
                            HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                            D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, BMS: tl.constexpr,
                            HAS_OFFSET: tl.constexpr, INTERPRET: tl.constexpr):
    SUBS: tl.constexpr = BM // BMS
    pid = tl.program_id(0)
    i_h = pid % HQ
    sub = (pid // HQ) % SUBS
    i_m = tl.load(q_order + pid // (HQ * SUBS))
    i_kvh = i_h // (HQ // HKV)
    offs_m = i_m * BM + sub * BMS + tl.arange(0, BMS)  # local query rows
    rows_g = offs_m  # global rows, for the mask
    if HAS_OFFSET:
        rows_g = offs_m + q_offset
    m_valid = offs_m < TQ
    rows_m = offs_m.to(tl.int64) * (HQ * D) + i_h * D
    b_q, b_q2 = query_rows(q, rows_m, m_valid, D1, D2, True)
    offs_dv = tl.arange(0, DV)
    rows_do = offs_m.to(tl.int64) * (HQ * DV) + i_h * DV
    b_do = tl.load(do + rows_do[:, None] + offs_dv[None, :], mask=m_valid[:, None], other=0.0)
    b_lse = tl.load(lse + i_h.to(tl.int64) * TQ + offs_m, mask=m_valid, other=0.0)
    b_delta = tl.load(delta + i_h.to(tl.int64) * TQ + offs_m, mask=m_valid, other=0.0)
    b_dq = tl.zeros([BMS, D1], dtype=tl.float32)
    b_dq2 = 0.0  # dummy when D2 == 0
    if D2 > 0:
        b_dq2 = tl.zeros([BMS, D2], dtype=tl.float32)
    start = tl.load(q_ptr + i_m)
    stop = tl.load(q_ptr + i_m + 1)
    full_stop = start + tl.load(q_full + i_m)
    b_dq, b_dq2 = _dq_range(b_q, b_q2, b_do, b_lse, b_delta, b_dq, b_dq2, k, v, subtree_end,
                            q_cols, start, full_stop, rows_g, TK, i_kvh, scale_log2, HKV, D, D1,
                            D2, DV, BN, False, INTERPRET)
    b_dq, b_dq2 = _dq_range(b_q, b_q2, b_do, b_lse, b_delta, b_dq, b_dq2, k, v, subtree_end,
                            q_cols, full_stop, stop, rows_g, TK, i_kvh, scale_log2, HKV, D, D1,
                            D2, DV, BN, True, INTERPRET)
    offs_d = tl.arange(0, D1)
    tl.store(dq + rows_m[:, None] + offs_d[None, :], (b_dq * scale).to(dq.dtype.element_ty),
             mask=m_valid[:, None])
    if D2 > 0:
        offs_d2 = D1 + tl.arange(0, D2)
        tl.store(dq + rows_m[:, None] + offs_d2[None, :], (b_dq2 * scale).to(dq.dtype.element_ty),
                 mask=m_valid[:, None])


@triton.jit
def _dkdv_step(b_k, b_k2, b_v, b_dkt, b_dkt2, b_dvt, q, q2, do, lse, delta, offs_n, b_end, k_rows,
               first, count, it, i_kvh, TQ, q_offset, scale_log2, HQ: tl.constexpr,
               HKV: tl.constexpr, D: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
               DV: tl.constexpr, BM: tl.constexpr, BMS: tl.constexpr, HAS_OFFSET: tl.constexpr,
               MASKED: tl.constexpr):
    # flat step `it` = (group head, visiting query block, sub-tile), sub-tile fastest
    G: tl.constexpr = HQ // HKV
    SUBS: tl.constexpr = BM // BMS
    sub = it % SUBS
    pair = it // SUBS
    i_h = i_kvh * G + pair // count
    i_m = tl.load(k_rows + first + pair % count)
    row0 = i_m * BM + sub * BMS
    offs_m = row0 + tl.arange(0, BMS)  # local query rows
    head_row = i_h.to(tl.int64) * TQ
    # q and do through descriptors (rows past TQ read as zeros)
    b_q = q.load([row0, i_h * D])
    b_q2 = 0.0  # dummy when D2 == 0
    if D2 > 0:
        b_q2 = q2.load([row0, i_h * D + D1])
    b_do = do.load([row0, i_h * DV])
    if MASKED:
        m_valid = offs_m < TQ
        b_lse = tl.load(lse + head_row + offs_m, mask=m_valid, other=0.0)
        b_delta = tl.load(delta + head_row + offs_m, mask=m_valid, other=0.0)
    else:
        b_lse = tl.load(lse + head_row + offs_m)
        b_delta = tl.load(delta + head_row + offs_m)
    # [BMS, BN] probabilities of this query sub-tile against the key block
    b_p = tl.exp2(scores(b_q, b_q2, b_k, b_k2, D2) * scale_log2 - b_lse[:, None])
    if MASKED:
        rows_g = offs_m
        if HAS_OFFSET:
            rows_g = offs_m + q_offset
        visible = ((offs_n[None, :] <= rows_g[:, None]) & (rows_g[:, None] < b_end[None, :])
                   & (offs_m[:, None] < TQ))
        b_p = tl.where(visible, b_p, 0.0)
    b_dvt += tl.dot(tl.trans(b_do), b_p.to(b_do.dtype))
    b_dp = tl.dot(b_do, tl.trans(b_v))
    b_ds = b_p * (b_dp - b_delta[:, None])
    b_dkt += tl.dot(tl.trans(b_q), b_ds.to(b_q.dtype))
    if D2 > 0:
        b_dkt2 += tl.dot(tl.trans(b_q2), b_ds.to(b_q.dtype))
    return b_dkt, b_dkt2, b_dvt


@triton.jit
def _dkdv_range(b_k, b_k2, b_v, b_dkt, b_dkt2, b_dvt, q, q2, do, lse, delta, offs_n, b_end, k_rows,
                first, count, i_kvh, TQ, q_offset, scale_log2, HQ: tl.constexpr,
                HKV: tl.constexpr, D: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                DV: tl.constexpr, BM: tl.constexpr, BMS: tl.constexpr, HAS_OFFSET: tl.constexpr,
                MASKED: tl.constexpr, INTERPRET: tl.constexpr):
    # one flat loop: Triton software-pipelines only innermost loops, and a single loop body
    # keeps one set of pipeline buffers; the while loop is for the interpreter
    G: tl.constexpr = HQ // HKV
    SUBS: tl.constexpr = BM // BMS
    if INTERPRET:
        it = count * 0
        while it < G * count * SUBS:
            b_dkt, b_dkt2, b_dvt = _dkdv_step(b_k, b_k2, b_v, b_dkt, b_dkt2, b_dvt, q, q2, do, lse,
                                              delta, offs_n, b_end, k_rows, first, count, it,
                                              i_kvh, TQ, q_offset, scale_log2, HQ, HKV, D, D1, D2,
                                              DV, BM, BMS, HAS_OFFSET, MASKED)
            it += 1
    else:
        for it in range(0, G * count * SUBS):
            b_dkt, b_dkt2, b_dvt = _dkdv_step(b_k, b_k2, b_v, b_dkt, b_dkt2, b_dvt, q, q2, do, lse,
                                              delta, offs_n, b_end, k_rows, first, count, it,
                                              i_kvh, TQ, q_offset, scale_log2, HQ, HKV, D, D1, D2,
                                              DV, BM, BMS, HAS_OFFSET, MASKED)
    return b_dkt, b_dkt2, b_dvt


@triton.jit
def tree_attn_bwd_dkdv_kernel(q, q2, k, k2, v, do, dk, dv, lse, delta, subtree_end,
                              k_ptr, k_rows, k_full, k_order, scale, scale_log2, TQ, TK, q_offset,
                              HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                              D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
                              BM: tl.constexpr, BN: tl.constexpr, BMS: tl.constexpr,
                              HAS_OFFSET: tl.constexpr, INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    i_kvh = pid % HKV
    i_n = tl.load(k_order + pid // HKV)
    offs_n, b_k, b_k2, b_v, b_end = load_key_block(k, k2, v, subtree_end, i_n, i_kvh, TK, D, D1, D2, DV, BN,
                                                   True)
    n_valid = offs_n < TK
    # transposed accumulators [D1, BN] (+ [D2, BN]) and [DV, BN]
    b_dkt = tl.zeros([D1, BN], dtype=tl.float32)
    b_dkt2 = 0.0  # dummy when D2 == 0
    if D2 > 0:
        b_dkt2 = tl.zeros([D2, BN], dtype=tl.float32)
    b_dvt = tl.zeros([DV, BN], dtype=tl.float32)
    start = tl.load(k_ptr + i_n)
    n_full = tl.load(k_full + i_n)
    n_partial = tl.load(k_ptr + i_n + 1) - start - n_full
    b_dkt, b_dkt2, b_dvt = _dkdv_range(b_k, b_k2, b_v, b_dkt, b_dkt2, b_dvt, q, q2, do, lse, delta,
                                       offs_n, b_end, k_rows, start, n_full, i_kvh, TQ, q_offset,
                                       scale_log2, HQ, HKV, D, D1, D2, DV, BM, BMS, HAS_OFFSET,
                                       False, INTERPRET)
    b_dkt, b_dkt2, b_dvt = _dkdv_range(b_k, b_k2, b_v, b_dkt, b_dkt2, b_dvt, q, q2, do, lse, delta,
                                       offs_n, b_end, k_rows, start + n_full, n_partial, i_kvh, TQ,
                                       q_offset, scale_log2, HQ, HKV, D, D1, D2, DV, BM, BMS,
                                       HAS_OFFSET, True, INTERPRET)
    # store through transposed pointers (no tl.trans of the accumulators)
    rows_k = offs_n.to(tl.int64) * (HKV * D) + i_kvh * D
    p_t = rows_k[None, :] + tl.arange(0, D1)[:, None]
    tl.store(dk + p_t, (b_dkt * scale).to(dk.dtype.element_ty), mask=n_valid[None, :])
    if D2 > 0:
        p_t2 = rows_k[None, :] + (D1 + tl.arange(0, D2))[:, None]
        tl.store(dk + p_t2, (b_dkt2 * scale).to(dk.dtype.element_ty), mask=n_valid[None, :])
    if DV != D:
        p_t = (offs_n.to(tl.int64) * (HKV * DV) + i_kvh * DV)[None, :] + tl.arange(0, DV)[:, None]
    tl.store(dv + p_t, b_dvt.to(dv.dtype.element_ty), mask=n_valid[None, :])


def bwd_delta(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """delta [HQ, Tq] fp32 = rowsum(o * do)."""
    n_tokens, n_q_heads, head_dim = o.shape
    delta = torch.empty(n_q_heads, n_tokens, dtype=torch.float32, device=o.device)
    rows = 64 if head_dim <= 128 else 32
    if n_tokens:
        tree_attn_bwd_delta_kernel[(triton.cdiv(n_tokens, rows), n_q_heads)](
            o, do, delta, n_tokens, HQ=n_q_heads, D=head_dim, BT=rows)
    return delta


def _launch_args(q, k, v, index: BlockIndex, launch: dict) -> dict:
    return dict(HQ=q.shape[1], HKV=k.shape[1], **head_dims(q, v), BM=index.block_m,
                BN=index.block_n, BMS=min(launch["block_ms"], index.block_m),
                HAS_OFFSET=k.shape[0] != q.shape[0], INTERPRET=interpreting(),
                num_warps=launch["num_warps"], num_stages=launch["num_stages"])


def bwd_dq(q, k, v, do, lse, delta, subtree_end, index: BlockIndex, scale: float,
           launch: dict) -> torch.Tensor:
    index = index.with_blocks(launch["block_m"], launch["block_n"])
    dq = torch.empty_like(q)
    args = _launch_args(q, k, v, index, launch)
    grid = (index.num_query_blocks * (index.block_m // args["BMS"]) * q.shape[1],)
    if grid[0]:
        tree_attn_bwd_dq_kernel[grid](
            q, k, v, do, dq, lse, delta, subtree_end, index.q_ptr, index.q_cols, index.q_full,
            index.q_order, scale, scale * LOG2E, q.shape[0], k.shape[0], k.shape[0] - q.shape[0],
            **args)
    return dq


def bwd_dkdv(q, k, v, do, lse, delta, subtree_end, index: BlockIndex, scale: float,
             launch: dict):
    index = index.with_blocks(launch["block_m"], launch["block_n"])
    if q.shape[0] == 0:  # no query sees any key
        return torch.zeros_like(k), torch.zeros_like(v)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    grid = (index.num_key_blocks * k.shape[1],)
    if grid[0]:
        args = _launch_args(q, k, v, index, launch)
        rows = args["BMS"]  # the q / do sub-tile each step loads
        tree_attn_bwd_dkdv_kernel[grid](
            *head_descriptors(q, rows), *head_descriptors(k, index.block_n),
            token_descriptor(v, index.block_n, v.shape[2]), token_descriptor(do, rows, do.shape[2]), dk, dv, lse,
            delta, subtree_end, index.k_ptr, index.k_rows, index.k_full, index.k_order, scale, scale * LOG2E,
            q.shape[0], k.shape[0], k.shape[0] - q.shape[0], **args)
    return dk, dv
