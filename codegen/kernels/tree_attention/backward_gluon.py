"""Gluon dq kernel of the tree-attention backward for Hopper (sm_90): warp-specialised.

Same contract as ``backward.bwd_dq``: per query block, walk its visit list (full key blocks first, then the
partially masked ones with the mask ``j <= i < subtree_end[j]``, ``i = local + q_offset``), s = q k^T,
p = exp2(s * scale * log2(e) - lse) (lse base 2, [HQ, Tq]), dp = do v^T, ds = p * (dp - delta),
dq = scale * sum_j ds k (the scale applied once, at the store, as the Triton kernel does), dq in q's dtype.
Rows past Tq read q = do = 0 (TMA) and lse = delta = 0, so their ds is 0; they are not stored. Keys past Tk
only occur in masked blocks, where ``subtree_end`` reads 0 for them and the mask drops them.

One CTA per (query block of BM = 128 rows, query head), query blocks in ``q_order``, heads fastest. Partitions:

- producer, 1 warp, 24 registers: TMA-loads the q and do tiles once (one mbarrier), then K and V tiles of the
  visit list into a K ring of K_STAGES and a V ring of V_STAGES buffers (ready/empty mbarriers each);
- consumer (default partition, 8 warps = 2 warpgroups of 64 rows), or two 4-warp consumers of 64 rows each
  (``consumers=2``: the warp schedulers interleave one's ds math with the other's wgmma).

Per block j the consumer issues S_j = q K_j^T behind the still running dq += ds_{j-1} K_{j-1}, waits for
that one only (wait(1)) and releases K_{j-1}, issues dP_j = do V_j^T, computes p_j while dP_j runs, then
releases V_j, forms ds_j and issues dq += ds_j K_j (ds from registers, the RS form; K not transposed) without
waiting: the tensor cores see dq_{j-1}, S_j, dP_j back to back. K_j is read until dq_j retires in block j + 1,
so the K ring needs two buffers to prefetch at all; V is free once dP retired and makes do with one.

Shared memory at D = DV = 256, BN = 64: q 64 KB + do 64 KB + K 2 x 32 KB + V 1 x 32 KB = 224 KB (229,376 B
+ barriers, Hopper's limit is 232,448 B). A second V buffer (256 KB) does not fit; BN = 32 with deeper rings
would, but an n32 score wgmma reads its 128 x 256 A tile from shared memory for half the work.
Registers (maxnreg 168 x 12 warps, as the forward): producer 24, consumers 240 a thread: dq 128 x 256 fp32
is 128 a thread, S and dP 32 each, ds in bf16 16, lse / delta / row indices a few.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .block_index import BlockIndex
from .forward import LOG2E
from .forward_gluon import (CONSUMER_REGS, HEAD_DIMS, MAXNREG, PRODUCER_REGS, column_tiles, gluon_descriptor,
                            issue_scores, qk_descriptors, query_block_program, ring_barriers, supports)


@gluon.jit
def _producer(q_desc, q2_desc, do_desc, k_desc, k2_desc, v_desc, q_cols, q_smem, q2_smem, do_smem, k_bufs, k2_bufs,
              v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, row_q, col_q, col_do, col_k, col_v, start, count,
              D1: gl.constexpr, D2: gl.constexpr, BN: gl.constexpr, K_STAGES: gl.constexpr,
              V_STAGES: gl.constexpr):
    # q and do once on one barrier (their bytes summed), then K_it, V_it in visit-list order. A fresh
    # mbarrier counts as having completed phase "1", so the first waits on `empty` pass at once. D2 > 0: q and
    # K come as two column tiles each (MLA's 192 = 128 + 64), on the same barriers.
    q_bytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes
                             + (q2_desc.block_type.nbytes if D2 > 0 else 0))
    k_bytes: gl.constexpr = k_desc.block_type.nbytes + (k2_desc.block_type.nbytes if D2 > 0 else 0)
    mbarrier.expect(q_bar, q_bytes)
    tma.async_copy_global_to_shared(q_desc, [row_q, col_q], q_bar, q_smem)
    if D2 > 0:
        tma.async_copy_global_to_shared(q2_desc, [row_q, col_q + D1], q_bar, q2_smem)
    tma.async_copy_global_to_shared(do_desc, [row_q, col_do], q_bar, do_smem)
    for it in range(count):
        row_k = gl.load(q_cols + start + it) * BN
        ks = it % K_STAGES
        mbarrier.wait(k_empty.index(ks), ((it // K_STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(ks), k_bytes)
        tma.async_copy_global_to_shared(k_desc, [row_k, col_k], k_ready.index(ks), k_bufs.index(ks))
        if D2 > 0:
            tma.async_copy_global_to_shared(k2_desc, [row_k, col_k + D1], k_ready.index(ks), k2_bufs.index(ks))
        vs = it % V_STAGES
        mbarrier.wait(v_empty.index(vs), ((it // V_STAGES) & 1) ^ 1)
        mbarrier.expect(v_ready.index(vs), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row_k, col_v], v_ready.index(vs), v_bufs.index(vs))


@gluon.jit
def _probs(s, lse_i, n_blk, masked, subtree_end, rows_g, TK, scale_log2, BN: gl.constexpr, s_layout: gl.constexpr):
    """p = exp2(s * scale * log2(e) - lse) of key block n_blk; masked: apply the tree mask (a runtime branch,
    only the partial blocks pay for it; p of a hidden pair is 0, as in the Triton kernel)."""
    p = gl.exp2(s * scale_log2 - lse_i[:, None])
    if masked:
        offs_n = n_blk * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        end = gl.load(subtree_end + offs_n, mask=offs_n < TK, other=0)
        visible = (offs_n[None, :] <= rows_g[:, None]) & (rows_g[:, None] < end[None, :])
        p = gl.where(visible, p, 0.0)
    return p


@gluon.jit
def _consumer(q_smem, q2_smem, do_smem, k_bufs, k2_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, q_cols,
              subtree_end, dq, lse, delta, scale, scale_log2, i_m, i_h, start, n_full, count, TQ, TK, q_offset,
              HQ: gl.constexpr, D: gl.constexpr, D1: gl.constexpr, D2: gl.constexpr, BM: gl.constexpr,
              BN: gl.constexpr, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr, HAS_OFFSET: gl.constexpr,
              ROW0: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr):
    """Rows [ROW0, ROW0 + ROWS) of the query block, on WARPS warps (ROWS = 16 * WARPS). D2 > 0: S sums two
    chained wgmma over the q / K column tiles and dq is two accumulators, [ROWS, D1] and [ROWS, D2]."""
    # warps [WARPS, 1]: every warpgroup owns an m64 slice of the rows; S / dP are one n64 instruction wide,
    # the dq accumulator one n-D1 (D1 <= 256)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BN, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                        instr_shape=[16, D1, 16])
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    dtype: gl.constexpr = q_smem.dtype

    q_rows = q_smem.slice(ROW0, ROWS)
    q2_rows = q2_smem.slice(ROW0, ROWS)
    do_rows = do_smem.slice(ROW0, ROWS)
    offs_m = i_m * BM + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))  # local query rows
    rows_g = offs_m
    if HAS_OFFSET:
        rows_g = offs_m + q_offset
    m_valid = offs_m < TQ
    lse_i = gl.load(lse + i_h.to(gl.int64) * TQ + offs_m, mask=m_valid, other=0.0)
    delta_i = gl.load(delta + i_h.to(gl.int64) * TQ + offs_m, mask=m_valid, other=0.0)
    if D2 > 0:
        dq2_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                             instr_shape=[16, D2, 16])
        ds2_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq2_layout, k_width=2)

    # block 0: nothing in flight yet; dq starts from its first wgmma (use_acc=False ignores the zeros)
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    s_tok = issue_scores(q_rows, q2_rows, k_bufs.index(0), k2_bufs.index(0), ROWS, BN, D2, s_layout)
    mbarrier.wait(v_ready.index(0), 0)
    dp_tok = warpgroup_mma(do_rows, v_bufs.index(0).permute((1, 0)), gl.zeros([ROWS, BN], gl.float32, s_layout),
                           use_acc=False, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s_tok, q_rows, k_bufs.index(0)))[0]
    p = _probs(s, lse_i, gl.load(q_cols + start), n_full == 0, subtree_end, rows_g, TK, scale_log2, BN, s_layout)
    dp = warpgroup_mma_wait(0, deps=(dp_tok, do_rows, v_bufs.index(0)))[0]
    mbarrier.arrive(v_empty.index(0), count=1)
    ds = (p * (dp - delta_i[:, None])).to(dtype)
    ds_op = gl.convert_layout(ds, ds_layout)
    dq_tok = warpgroup_mma(ds_op, k_bufs.index(0), gl.zeros([ROWS, D1], gl.float32, dq_layout), use_acc=False,
                           is_async=True)
    if D2 > 0:
        ds2_op = gl.convert_layout(ds, ds2_layout)
        dq2_tok = warpgroup_mma(ds2_op, k2_bufs.index(0), gl.zeros([ROWS, D2], gl.float32, dq2_layout),
                                use_acc=False, is_async=True)

    # Block it: S_it queues behind dq += ds_{it-1} K_{it-1}; once that retired (wait(1): S may still run),
    # dP_it is issued, p_it computed while dP_it runs, then ds_it and its dq wgmma. The accumulators in flight
    # never exceed dq + two score tiles: 128 + 32 + 32 registers a thread at D = 256 (dq, S and dP all in flight
    # at once would add the 16 of ds_{it-1} and spill). wgmma groups retire in order, so wait(1) after S_it
    # means every dq wgmma of block it-1 retired.
    for it in range(1, count):
        ks = it % K_STAGES
        prev = (it - 1) % K_STAGES
        vs = it % V_STAGES
        n_blk = gl.load(q_cols + start + it)  # early: its latency hides behind the waits below
        mbarrier.wait(k_ready.index(ks), (it // K_STAGES) & 1)
        s_tok = issue_scores(q_rows, q2_rows, k_bufs.index(ks), k2_bufs.index(ks), ROWS, BN, D2, s_layout)
        if D2 > 0:
            acc, acc2 = warpgroup_mma_wait(1, deps=(dq_tok, dq2_tok, ds_op, ds2_op, k_bufs.index(prev),
                                                    k2_bufs.index(prev)))[:2]
        else:
            acc = warpgroup_mma_wait(1, deps=(dq_tok, ds_op, k_bufs.index(prev)))[0]
        mbarrier.arrive(k_empty.index(prev), count=1)  # K_{it-1} read by its last wgmma
        mbarrier.wait(v_ready.index(vs), (it // V_STAGES) & 1)
        dp_tok = warpgroup_mma(do_rows, v_bufs.index(vs).permute((1, 0)),
                               gl.zeros([ROWS, BN], gl.float32, s_layout), use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_tok, q_rows, k_bufs.index(ks)))[0]
        p = _probs(s, lse_i, n_blk, it >= n_full, subtree_end, rows_g, TK, scale_log2, BN, s_layout)
        dp = warpgroup_mma_wait(0, deps=(dp_tok, do_rows, v_bufs.index(vs)))[0]
        mbarrier.arrive(v_empty.index(vs), count=1)
        ds = (p * (dp - delta_i[:, None])).to(dtype)
        ds_op = gl.convert_layout(ds, ds_layout)
        dq_tok = warpgroup_mma(ds_op, k_bufs.index(ks), acc, is_async=True)
        if D2 > 0:
            ds2_op = gl.convert_layout(ds, ds2_layout)
            dq2_tok = warpgroup_mma(ds2_op, k2_bufs.index(ks), acc2, is_async=True)

    # the last dq wgmma; its K slot needs no release (the producer is done)
    last = (count - 1) % K_STAGES
    rows_o = i_m * BM + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, dq_layout))
    row_ptrs = dq + (rows_o.to(gl.int64) * (HQ * D) + i_h * D)[:, None]
    if D2 > 0:
        acc, acc2 = warpgroup_mma_wait(0, deps=(dq_tok, dq2_tok, ds_op, ds2_op, k_bufs.index(last),
                                                k2_bufs.index(last)))[:2]
        rows_o2 = i_m * BM + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, dq2_layout))
        offs_d2 = D1 + gl.arange(0, D2, layout=gl.SliceLayout(0, dq2_layout))
        ptrs2 = dq + (rows_o2.to(gl.int64) * (HQ * D) + i_h * D)[:, None] + offs_d2[None, :]
        gl.store(ptrs2, (acc2 * scale).to(dtype), mask=(rows_o2 < TQ)[:, None])
    else:
        acc = warpgroup_mma_wait(0, deps=(dq_tok, ds_op, k_bufs.index(last)))[0]
    offs_d = gl.arange(0, D1, layout=gl.SliceLayout(0, dq_layout))
    gl.store(row_ptrs + offs_d[None, :], (acc * scale).to(dtype), mask=(rows_o < TQ)[:, None])


@gluon.jit
def tree_attn_bwd_dq_gluon_kernel(q_desc, q2_desc, k_desc, k2_desc, v_desc, do_desc, dq, lse, delta, subtree_end,
                                  q_ptr, q_cols, q_full, q_order, scale, scale_log2, TQ, TK, q_offset,
                                  HQ: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, D1: gl.constexpr,
                                  D2: gl.constexpr, DV: gl.constexpr,
                                  BM: gl.constexpr, BN: gl.constexpr, K_STAGES: gl.constexpr,
                                  V_STAGES: gl.constexpr, HAS_OFFSET: gl.constexpr, CONSUMERS: gl.constexpr,
                                  num_warps: gl.constexpr):
    gl.static_assert(K_STAGES >= 2, "K_j is read by two wgmma a block apart: the K ring needs >= 2 buffers")
    i_h, i_m, i_kvh, start, count, n_full = query_block_program(q_ptr, q_full, q_order, HQ, HKV)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, do_desc.block_type.shape, do_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [K_STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [V_STAGES] + v_desc.block_type.shape, v_desc.layout)
    if D2 > 0:  # the second column tiles of q and K
        q2_smem = gl.allocate_shared_memory(q2_desc.dtype, q2_desc.block_type.shape, q2_desc.layout)
        k2_bufs = gl.allocate_shared_memory(k2_desc.dtype, [K_STAGES] + k2_desc.block_type.shape, k2_desc.layout)
    else:  # unused (every use sits under D2 > 0)
        q2_smem = q_smem
        k2_bufs = k_bufs
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    k_ready, k_empty = ring_barriers(K_STAGES, CONSUMERS)
    v_ready, v_empty = ring_barriers(V_STAGES, CONSUMERS)

    # (the partition lists are spelled out: a jit function cannot be held in a variable)
    if CONSUMERS == 1:
        gl.warp_specialize([
            (_consumer, (q_smem, q2_smem, do_smem, k_bufs, k2_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready,
                         v_empty, q_cols, subtree_end, dq, lse, delta, scale, scale_log2, i_m, i_h, start, n_full,
                         count, TQ, TK, q_offset, HQ, D, D1, D2, BM, BN, K_STAGES, V_STAGES, HAS_OFFSET, 0, BM,
                         num_warps)),
            (_producer, (q_desc, q2_desc, do_desc, k_desc, k2_desc, v_desc, q_cols, q_smem, q2_smem, do_smem,
                         k_bufs, k2_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, i_m * BM, i_h * D,
                         i_h * DV, i_kvh * D, i_kvh * DV, start, count, D1, D2, BN, K_STAGES, V_STAGES)),
        ], [1], [PRODUCER_REGS])
    else:
        gl.static_assert(CONSUMERS == 2, "one or two consumer partitions")
        gl.warp_specialize([
            (_consumer, (q_smem, q2_smem, do_smem, k_bufs, k2_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready,
                         v_empty, q_cols, subtree_end, dq, lse, delta, scale, scale_log2, i_m, i_h, start, n_full,
                         count, TQ, TK, q_offset, HQ, D, D1, D2, BM, BN, K_STAGES, V_STAGES, HAS_OFFSET, 0, BM // 2,
                         num_warps)),
            (_consumer, (q_smem, q2_smem, do_smem, k_bufs, k2_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready,
                         v_empty, q_cols, subtree_end, dq, lse, delta, scale, scale_log2, i_m, i_h, start, n_full,
                         count, TQ, TK, q_offset, HQ, D, D1, D2, BM, BN, K_STAGES, V_STAGES, HAS_OFFSET, BM // 2,
                         BM // 2, num_warps)),
            (_producer, (q_desc, q2_desc, do_desc, k_desc, k2_desc, v_desc, q_cols, q_smem, q2_smem, do_smem,
                         k_bufs, k2_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, i_m * BM, i_h * D,
                         i_h * DV, i_kvh * D, i_kvh * DV, start, count, D1, D2, BN, K_STAGES, V_STAGES)),
        ], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])


def dq_launch(launch: dict | None = None) -> tuple[dict, int]:
    """The full launch dict (defaults filled in) and its warps per consumer partition; ValueError if unsupported."""
    launch = {"block_m": 128, "block_n": 64, "k_stages": 2, "v_stages": 1, "consumers": 1, **(launch or {})}
    warps = launch["block_m"] // (16 * launch["consumers"])  # a consumer's rows: 16 per warp (m64 per warpgroup)
    if launch["consumers"] not in (1, 2) or warps not in (4, 8) or launch.get("num_warps", warps) != warps:
        raise ValueError(f"Gluon dq launch {launch}: block_m / consumers must be 64 or 128 rows "
                         "(num_warps 4 or 8 per consumer partition)")
    if launch["k_stages"] < 2 or launch["v_stages"] < 1:
        raise ValueError(f"Gluon dq launch {launch}: k_stages must be >= 2 (K is read a block apart), v_stages >= 1")
    if launch.get("heads", 1) != 1:
        raise ValueError("the Gluon dq kernel does not pack query heads (launch heads must be 1)")
    return launch, warps


def bwd_dq_gluon(q, k, v, do, lse, delta, subtree_end, index: BlockIndex, scale: float,
                 launch: dict | None = None) -> torch.Tensor:
    """As ``backward.bwd_dq``: dq [Tq, HQ, D] in q's dtype. ``launch``: block_m (128), block_n (64), k_stages
    (2), v_stages (1), consumers (1 or 2, as the Gluon forward); other keys of a Triton launch (num_stages,
    block_ms) are ignored. The index must hold the (block_m, block_n) lists. ``do`` must be contiguous."""
    launch, warps = dq_launch(launch)
    if not supports(q, k, v):
        raise ValueError(f"the Gluon dq kernel takes bf16/fp16 with {HEAD_DIMS}, got {q.dtype}, D={q.shape[2]}, "
                         f"DV={v.shape[2]}")
    n_queries, n_q_heads, head_dim = q.shape
    n_keys, n_kv_heads, value_dim = v.shape
    index = index.with_blocks(launch["block_m"], launch["block_n"])
    bm, bn = index.block_m, index.block_n
    d1, d2 = column_tiles(head_dim)
    dq = torch.empty_like(q)
    grid = (index.num_query_blocks * n_q_heads,)
    if grid[0]:
        tree_attn_bwd_dq_gluon_kernel[grid](
            *qk_descriptors(q, bm), *qk_descriptors(k, bn), gluon_descriptor(v, bn, value_dim),
            gluon_descriptor(do.contiguous(), bm, value_dim), dq, lse, delta, subtree_end, index.q_ptr,
            index.q_cols, index.q_full, index.q_order, scale, scale * LOG2E, n_queries, n_keys, n_keys - n_queries,
            HQ=n_q_heads, HKV=n_kv_heads, D=head_dim, D1=d1, D2=d2, DV=value_dim, BM=bm, BN=bn,
            K_STAGES=launch["k_stages"], V_STAGES=launch["v_stages"], HAS_OFFSET=n_keys != n_queries,
            CONSUMERS=launch["consumers"], num_warps=warps, maxnreg=MAXNREG)
    return dq
