"""Gluon dk/dv kernel of the tree-attention backward for Hopper (sm_90): warp-specialised.

Same contract as ``backward.bwd_dkdv``: one CTA per (key block of BN = 64 keys, KV head), key blocks in
``k_order``, KV heads fastest. It walks the key block's transposed visit list (the query blocks that see it,
full ones first, then the partially masked ones with the mask ``j <= i < subtree_end[j]``, ``i = local +
q_offset``) for every query head of its GQA group, in query sub-tiles of BMS = 64 rows, in the Triton kernel's
order (all full steps of all group heads, then all partial ones; heads, then visits, then sub-tiles fastest):
p = exp2(s * scale * log2(e) - lse), dp = do v^T, ds = p * (dp - delta), dv = sum p^T do, dk = scale * sum
ds^T q (scale applied once, at the store). Rows past Tq read q = do = 0 (TMA) and are masked out of p in the
partial steps (the only ones that reach past Tq); keys past Tk read subtree_end = 0, so no row sees them, and
are not stored. Key blocks that no query sees store zeros.

Partitions (``gl.warp_specialize``):

- producer, 1 warp, 24 registers: TMA-loads the K and V tiles once (one mbarrier), then per step the q and do
  sub-tiles into STAGES-deep rings (q and do with their own ready mbarrier, so S can start before do lands;
  one empty mbarrier per slot, released once the slot's last wgmma, dK, retired);
- consumer (default partition), 8 warps = 2 warpgroups.

Per step, the consumer issues S = q K^T and dP = do V^T as [BMS, BN] tiles split by KEY columns across the two
warpgroups (warps [4, 2]: each warpgroup an m64 n32 wgmma, no score work done twice), then waits with
wait(1): dV, dK of the previous step and S retired, dP may still run. p goes to shared memory (bf16) and
dV^T += do^T p is issued (do read transposed from its ring slot) while ds waits for dP; ds goes to shared memory
and dK^T += q^T ds is issued; both run on the tensor cores behind the next step's S / dP. The transposed
accumulators dK^T [D, BN], dV^T [DV, BN] (fp32) are split by D rows across the warpgroups (warps [8, 1], two m64
tiles each) and keep k / v out of registers (they are only shared-memory B operands), as in the Triton kernel.
p and ds cross warpgroups (each warpgroup writes its key columns, each reads all), hence the partition-wide
barriers: after fence_async_shared (generic-proxy stores before an async-proxy wgmma read) and before
overwriting p / ds (the other warpgroup's previous dV / dK may still read them).

Shared memory at D = DV = 256: K 32 KB + V 32 KB + q ring 2 x 32 KB + do ring 2 x 32 KB + p 8 KB + ds 8 KB =
208 KB (212,992 B + barriers; Hopper's limit 232,448 B). Registers (maxnreg 168 x 12 warps, as the forward):
producer 24, consumer 240 a thread: dK^T + dV^T 2 x 64, S and dP 16 each, p / ds 16 each.

``consumers=2`` splits the work by matmul instead of by key columns (the n32 score wgmma of the above read
their 64 x 256 A tile from shared memory for half an n64's work; by the operand bytes a Hopper SM's shared memory
delivers, an n32 bf16 wgmma is shared-memory bound, an n64 one just not): a 4-warp partition computes S (m64 n64),
p and dV^T, a 4-warp one dP (m64 n64), ds and dK^T, each accumulator 128 registers a thread. p crosses in fp32
(16 KB, one buffer, p_ready / p_free mbarriers) so ds has the Triton kernel's precision; smem 224 KB.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)

from .block_index import BlockIndex
from .forward import LOG2E
from .forward_gluon import CONSUMER_REGS, MAXNREG, PRODUCER_REGS, gluon_descriptor, supports


@gluon.jit
def _step(it, k_rows, start, n_full, n_visits, i_kvh, G: gl.constexpr, BM: gl.constexpr, BMS: gl.constexpr):
    """(query head, first local row, masked) of flat step `it`: the G * n_full * SUBS full steps come first,
    then the partial ones, each range ordered (group head, visit, sub-tile) with sub-tiles fastest."""
    SUBS: gl.constexpr = BM // BMS
    full_steps = G * n_full * SUBS
    masked = it >= full_steps
    m = masked.to(gl.int32)  # branch-free selection of the range (scalars)
    local = it - m * full_steps
    first = start + m * n_full
    count = n_full + m * (n_visits - 2 * n_full)  # > 0 whenever a step falls in its range
    sub = local % SUBS
    pair = local // SUBS
    i_h = i_kvh * G + pair // count
    i_m = gl.load(k_rows + first + pair % count)
    return i_h, i_m * BM + sub * BMS, masked


@gluon.jit
def _producer(q_desc, do_desc, k_desc, v_desc, k_rows, q_bufs, do_bufs, k_smem, v_smem, kv_bar, q_ready, do_ready,
              empty, i_n, i_kvh, start, n_full, n_visits, G: gl.constexpr, D: gl.constexpr, DV: gl.constexpr,
              BM: gl.constexpr, BN: gl.constexpr, BMS: gl.constexpr, STAGES: gl.constexpr):
    # K and V once, then q_it, do_it per step. A fresh mbarrier counts as having completed phase "1", so the
    # first STAGES waits on `empty` pass at once.
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [i_n * BN, i_kvh * D], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [i_n * BN, i_kvh * DV], kv_bar, v_smem)
    for it in range(G * n_visits * (BM // BMS)):
        i_h, row0, masked = _step(it, k_rows, start, n_full, n_visits, i_kvh, G, BM, BMS)
        slot = it % STAGES
        mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row0, i_h * D], q_ready.index(slot), q_bufs.index(slot))
        mbarrier.expect(do_ready.index(slot), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [row0, i_h * DV], do_ready.index(slot), do_bufs.index(slot))


@gluon.constexpr_function
def _acc_layout(rows, bn):
    """wgmma accumulator layout of a transposed gradient [rows, bn] on 8 warps: split by rows (each warpgroup
    rows / 2, two m64 tiles at 256) when rows >= 128, else (rows = 64: one m64 tile) by key columns."""
    if rows >= 128:
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, bn, 16])
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, bn // 2, 16])


@gluon.jit
def _store_transposed(out, acc, i_n, i_kvh, TK, HKV: gl.constexpr, ROWS: gl.constexpr, BN: gl.constexpr,
                      layout: gl.constexpr):
    # acc [ROWS, BN] is out[keys, i_kvh, :]^T: stored through transposed pointers, keys past TK dropped
    offs_n = i_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    offs_d = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    ptrs = out + (offs_n.to(gl.int64) * (HKV * ROWS) + i_kvh * ROWS)[None, :] + offs_d[:, None]
    gl.store(ptrs, acc.to(out.dtype.element_ty), mask=(offs_n < TK)[None, :])


@gluon.jit
def _mask_probs(p, offs_n, end, offs_m, m_valid, q_offset, HAS_OFFSET: gl.constexpr):
    """p of a partial step with the tree mask applied (keys offs_n with ends `end`, local query rows offs_m,
    rows past Tq dropped)."""
    rows_g = offs_m
    if HAS_OFFSET:
        rows_g = offs_m + q_offset
    visible = (offs_n[None, :] <= rows_g[:, None]) & (rows_g[:, None] < end[None, :]) & m_valid[:, None]
    return gl.where(visible, p, 0.0)


@gluon.jit
def _consumer(q_bufs, do_bufs, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready, do_ready, empty, k_rows,
              subtree_end, dk, dv, lse, delta, scale, scale_log2, i_n, i_kvh, start, n_full, n_visits, TQ, TK,
              q_offset, HKV: gl.constexpr, G: gl.constexpr, D: gl.constexpr, DV: gl.constexpr, BM: gl.constexpr,
              BN: gl.constexpr, BMS: gl.constexpr, STAGES: gl.constexpr, HAS_OFFSET: gl.constexpr):
    # score tiles [BMS, BN] split by key columns: warpgroup w owns keys [w * BN / 2, (w + 1) * BN / 2)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BN // 2, 16])
    dk_layout: gl.constexpr = _acc_layout(D, BN)
    dv_layout: gl.constexpr = _acc_layout(DV, BN)
    dtype: gl.constexpr = q_bufs.dtype

    offs_n = i_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
    end = gl.load(subtree_end + offs_n, mask=offs_n < TK, other=0)  # keys past TK: end 0, seen by no row
    rows = gl.arange(0, BMS, layout=gl.SliceLayout(1, s_layout))
    # accumulator "tokens" from the start, so the loop carries one type (the first use_acc=True adds zeros)
    dkt = warpgroup_mma_init(gl.zeros([D, BN], gl.float32, dk_layout))
    dvt = warpgroup_mma_init(gl.zeros([DV, BN], gl.float32, dv_layout))
    mbarrier.wait(kv_bar, 0)
    k_t = k_smem.permute((1, 0))
    v_t = v_smem.permute((1, 0))

    for it in range(G * n_visits * (BM // BMS)):
        i_h, row0, masked = _step(it, k_rows, start, n_full, n_visits, i_kvh, G, BM, BMS)
        slot = it % STAGES
        phase = (it // STAGES) & 1
        prev = (it + STAGES - 1) % STAGES
        offs_m = row0 + rows  # local query rows
        m_valid = offs_m < TQ
        # lse / delta early: their latency hides behind the waits (rows past TQ read 0)
        lse_i = gl.load(lse + i_h.to(gl.int64) * TQ + offs_m, mask=m_valid, other=0.0)
        delta_i = gl.load(delta + i_h.to(gl.int64) * TQ + offs_m, mask=m_valid, other=0.0)
        q_s = q_bufs.index(slot)
        do_s = do_bufs.index(slot)

        mbarrier.wait(q_ready.index(slot), phase)
        s_tok = warpgroup_mma(q_s, k_t, gl.zeros([BMS, BN], gl.float32, s_layout), use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(slot), phase)
        dp_tok = warpgroup_mma(do_s, v_t, gl.zeros([BMS, BN], gl.float32, s_layout), use_acc=False,
                               is_async=True)
        # wgmma groups retire in order: dV, dK of the previous step, then S; dP may still run
        done = warpgroup_mma_wait(1, deps=(dvt, dkt, s_tok, p_smem, ds_smem, q_bufs.index(prev),
                                           do_bufs.index(prev), k_smem))
        dvt = done[0]
        dkt = done[1]
        s = done[2]
        # both warpgroups past that wait: the previous step's ring slot, p_smem and ds_smem are free
        gl.thread_barrier()
        mbarrier.arrive(empty.index(prev), count=1, pred=it > 0)

        p = gl.exp2(s * scale_log2 - lse_i[:, None])
        if masked:
            p = _mask_probs(p, offs_n, end, offs_m, m_valid, q_offset, HAS_OFFSET)
        p_smem.store(p.to(dtype))
        fence_async_shared()
        gl.thread_barrier()  # all of p written before either warpgroup's wgmma reads it
        dvt = warpgroup_mma(do_s.permute((1, 0)), p_smem, dvt, is_async=True)

        dp = warpgroup_mma_wait(1, deps=(dp_tok, do_s, v_smem))[0]  # dP retired, dV may run
        ds = p * (dp - delta_i[:, None])
        ds_smem.store(ds.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        dkt = warpgroup_mma(q_s.permute((1, 0)), ds_smem, dkt, is_async=True)

    # the last step's slot needs no release (the producer is done)
    done = warpgroup_mma_wait(0, deps=(dvt, dkt, p_smem, ds_smem, q_bufs, do_bufs))
    dvt = done[0]
    dkt = done[1]
    _store_transposed(dk, dkt * scale, i_n, i_kvh, TK, HKV, D, BN, dk_layout)
    _store_transposed(dv, dvt, i_n, i_kvh, TK, HKV, DV, BN, dv_layout)


@gluon.jit
def _consumer_s(q_bufs, do_bufs, k_smem, p_smem, p32_smem, kv_bar, q_ready, do_ready, empty, p_ready, p_free,
                k_rows, subtree_end, dv, lse, scale_log2, i_n, i_kvh, start, n_full, n_visits, TQ, TK, q_offset,
                HKV: gl.constexpr, G: gl.constexpr, DV: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                BMS: gl.constexpr, STAGES: gl.constexpr, HAS_OFFSET: gl.constexpr):
    """CONSUMERS = 2, 4 warps: S = q K^T (one m64 n64 wgmma), p, dV^T += do^T p; hands p (fp32) to _consumer_d."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BN, 16])
    dv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BN, 16])
    rows = gl.arange(0, BMS, layout=gl.SliceLayout(1, s_layout))
    dvt = gl.zeros([DV, BN], gl.float32, dv_layout)
    mbarrier.wait(kv_bar, 0)
    k_t = k_smem.permute((1, 0))
    for it in range(G * n_visits * (BM // BMS)):
        i_h, row0, masked = _step(it, k_rows, start, n_full, n_visits, i_kvh, G, BM, BMS)
        slot = it % STAGES
        phase = (it // STAGES) & 1
        offs_m = row0 + rows
        m_valid = offs_m < TQ
        lse_i = gl.load(lse + i_h.to(gl.int64) * TQ + offs_m, mask=m_valid, other=0.0)
        q_s = q_bufs.index(slot)
        do_s = do_bufs.index(slot)
        mbarrier.wait(q_ready.index(slot), phase)
        s_tok = warpgroup_mma(q_s, k_t, gl.zeros([BMS, BN], gl.float32, s_layout), use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s_tok, q_s, k_smem))[0]
        p = gl.exp2(s * scale_log2 - lse_i[:, None])
        if masked:  # key columns and ends loaded here: n64 tiles give a thread 16 columns, 32 registers to keep
            offs_n = i_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
            end = gl.load(subtree_end + offs_n, mask=offs_n < TK, other=0)
            p = _mask_probs(p, offs_n, end, offs_m, m_valid, q_offset, HAS_OFFSET)
        p_smem.store(p.to(p_smem.dtype))
        mbarrier.wait(p_free, (it & 1) ^ 1)  # _consumer_d has read the previous p
        p32_smem.store(p)
        fence_async_shared()
        gl.thread_barrier()  # all 4 warps' p stored before the arrive and the wgmma
        mbarrier.arrive(p_ready, count=1)
        mbarrier.wait(do_ready.index(slot), phase)
        # dV retires within the step: left in flight into the next one, ptxas serialises every wgmma of the kernel
        # (C7514; bisected to the tree-mask code of this loop); the dP / dK partition keeps the tensor cores busy
        dv_tok = warpgroup_mma(do_s.permute((1, 0)), p_smem, dvt, is_async=True)
        dvt = warpgroup_mma_wait(0, deps=(dv_tok, p_smem, do_s))[0]
        gl.thread_barrier()
        mbarrier.arrive(empty.index(slot), count=1)  # this partition is done with the slot (and p_smem)
    _store_transposed(dv, dvt, i_n, i_kvh, TK, HKV, DV, BN, dv_layout)


@gluon.jit
def _consumer_d(q_bufs, do_bufs, v_smem, ds_smem, p32_smem, kv_bar, q_ready, do_ready, empty, p_ready, p_free,
                k_rows, dk, delta, scale, i_n, i_kvh, start, n_full, n_visits, TQ, TK, HKV: gl.constexpr,
                G: gl.constexpr, D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BMS: gl.constexpr,
                STAGES: gl.constexpr):
    """CONSUMERS = 2, 4 warps: dP = do V^T (one m64 n64 wgmma), ds from _consumer_s's fp32 p (the Triton
    kernel's precision), dK^T += q^T ds."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BN, 16])
    dk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BN, 16])
    rows = gl.arange(0, BMS, layout=gl.SliceLayout(1, s_layout))
    dkt = warpgroup_mma_init(gl.zeros([D, BN], gl.float32, dk_layout))
    mbarrier.wait(kv_bar, 0)
    v_t = v_smem.permute((1, 0))
    for it in range(G * n_visits * (BM // BMS)):
        i_h, row0, masked = _step(it, k_rows, start, n_full, n_visits, i_kvh, G, BM, BMS)
        slot = it % STAGES
        phase = (it // STAGES) & 1
        prev = (it + STAGES - 1) % STAGES
        offs_m = row0 + rows
        delta_i = gl.load(delta + i_h.to(gl.int64) * TQ + offs_m, mask=offs_m < TQ, other=0.0)
        q_s = q_bufs.index(slot)
        do_s = do_bufs.index(slot)
        mbarrier.wait(do_ready.index(slot), phase)
        dp_tok = warpgroup_mma(do_s, v_t, gl.zeros([BMS, BN], gl.float32, s_layout), use_acc=False,
                               is_async=True)
        done = warpgroup_mma_wait(0, deps=(dkt, dp_tok, ds_smem, q_bufs.index(prev), do_bufs.index(prev), v_smem))
        dkt = done[0]
        dp = done[1]
        gl.thread_barrier()
        mbarrier.arrive(empty.index(prev), count=1, pred=it > 0)
        mbarrier.wait(p_ready, it & 1)
        p = p32_smem.load(s_layout)
        gl.thread_barrier()  # all 4 warps read p before it may be overwritten
        mbarrier.arrive(p_free, count=1)
        ds_smem.store((p * (dp - delta_i[:, None])).to(ds_smem.dtype))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.wait(q_ready.index(slot), phase)
        dkt = warpgroup_mma(q_s.permute((1, 0)), ds_smem, dkt, is_async=True)
    dkt = warpgroup_mma_wait(0, deps=(dkt, ds_smem, q_bufs))[0]
    _store_transposed(dk, dkt * scale, i_n, i_kvh, TK, HKV, D, BN, dk_layout)


@gluon.jit
def tree_attn_bwd_dkdv_gluon_kernel(q_desc, k_desc, v_desc, do_desc, dk, dv, lse, delta, subtree_end, k_ptr,
                                    k_rows, k_full, k_order, scale, scale_log2, TQ, TK, q_offset,
                                    HQ: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, DV: gl.constexpr,
                                    BM: gl.constexpr, BN: gl.constexpr, BMS: gl.constexpr, STAGES: gl.constexpr,
                                    HAS_OFFSET: gl.constexpr, CONSUMERS: gl.constexpr, num_warps: gl.constexpr):
    gl.static_assert(num_warps * CONSUMERS == 8, "2 warpgroups: one 8-warp consumer or two 4-warp ones")
    gl.static_assert(BMS == 64, "query sub-tiles of 64 rows: one m64 score wgmma per warpgroup")
    gl.static_assert(STAGES >= 2, "a ring slot is released one step after its own step")
    G: gl.constexpr = HQ // HKV
    pid = gl.program_id(0)
    i_kvh = pid % HKV
    i_n = gl.load(k_order + pid // HKV)
    start = gl.load(k_ptr + i_n)
    n_visits = gl.load(k_ptr + i_n + 1) - start  # 0 for keys no query sees: zeros are stored
    n_full = gl.load(k_full + i_n)

    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, v_desc.block_type.shape, v_desc.layout)
    pds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BMS, BN], q_desc.dtype)
    p_smem = gl.allocate_shared_memory(q_desc.dtype, [BMS, BN], pds_layout)
    ds_smem = gl.allocate_shared_memory(q_desc.dtype, [BMS, BN], pds_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        # ready: completed by the TMA transaction bytes; empty: one arrive per consumer partition
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)

    if CONSUMERS == 1:
        gl.warp_specialize([
            (_consumer, (q_bufs, do_bufs, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready, do_ready, empty, k_rows,
                         subtree_end, dk, dv, lse, delta, scale, scale_log2, i_n, i_kvh, start, n_full, n_visits, TQ,
                         TK, q_offset, HKV, G, D, DV, BM, BN, BMS, STAGES, HAS_OFFSET)),
            (_producer, (q_desc, do_desc, k_desc, v_desc, k_rows, q_bufs, do_bufs, k_smem, v_smem, kv_bar, q_ready,
                         do_ready, empty, i_n, i_kvh, start, n_full, n_visits, G, D, DV, BM, BN, BMS, STAGES)),
        ], [1], [PRODUCER_REGS])
    else:
        gl.static_assert(CONSUMERS == 2, "one or two consumer partitions")
        # p in fp32 for ds (single buffer, handed over with p_ready / p_free), p in bf16 for the dV wgmma
        p32_smem = gl.allocate_shared_memory(gl.float32, [BMS, BN],
                                             gl.NVMMASharedLayout.get_default_for([BMS, BN], gl.float32))
        p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(p_ready, count=1)
        mbarrier.init(p_free, count=1)
        gl.warp_specialize([
            (_consumer_s, (q_bufs, do_bufs, k_smem, p_smem, p32_smem, kv_bar, q_ready, do_ready, empty, p_ready,
                           p_free, k_rows, subtree_end, dv, lse, scale_log2, i_n, i_kvh, start, n_full, n_visits, TQ,
                           TK, q_offset, HKV, G, DV, BM, BN, BMS, STAGES, HAS_OFFSET)),
            (_consumer_d, (q_bufs, do_bufs, v_smem, ds_smem, p32_smem, kv_bar, q_ready, do_ready, empty, p_ready,
                           p_free, k_rows, dk, delta, scale, i_n, i_kvh, start, n_full, n_visits, TQ, TK, HKV, G, D,
                           BM, BN, BMS, STAGES)),
            (_producer, (q_desc, do_desc, k_desc, v_desc, k_rows, q_bufs, do_bufs, k_smem, v_smem, kv_bar, q_ready,
                         do_ready, empty, i_n, i_kvh, start, n_full, n_visits, G, D, DV, BM, BN, BMS, STAGES)),
        ], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])


def dkdv_launch(launch: dict | None = None) -> dict:
    """The full launch dict (defaults filled in); ValueError if unsupported. Keys of a Triton launch that this
    kernel has no use for (num_stages) are ignored; block_ms must be 64 and num_warps 8 if given."""
    launch = {"block_m": 128, "block_n": 64, "stages": 2, "consumers": 1, **(launch or {})}
    launch["block_ms"] = launch.get("block_ms", 64)
    if (launch["block_n"] != 64 or launch["block_ms"] != 64 or launch["block_m"] not in (64, 128)
            or launch["consumers"] not in (1, 2) or launch.get("num_warps", 8 // launch["consumers"])
            != 8 // launch["consumers"]):
        raise ValueError(f"Gluon dk/dv launch {launch}: needs block_n 64, block_ms 64, block_m 64 or 128, "
                         "consumers 1 or 2 (num_warps 8 or 4 per consumer partition)")
    if launch["stages"] < 2:  # a slot is released one step after its own: one buffer would deadlock
        raise ValueError(f"Gluon dk/dv launch {launch}: stages (the q / do ring depth) must be >= 2")
    if launch.get("heads", 1) != 1:
        raise ValueError("the Gluon dk/dv kernel does not pack query heads (launch heads must be 1)")
    return launch


def bwd_dkdv_gluon(q, k, v, do, lse, delta, subtree_end, index: BlockIndex, scale: float,
                   launch: dict | None = None):
    """As ``backward.bwd_dkdv``: (dk [Tk, HKV, D], dv [Tk, HKV, DV]) in k's and v's dtypes. ``launch``: block_m
    (128), block_n (64), block_ms (64), stages (2, the q / do ring depth), consumers (1: one 8-warp consumer
    with S / dP split by key columns; 2: a 4-warp S / p / dV partition and a 4-warp dP / ds / dK one). The index
    must hold the (block_m, block_n) lists. bf16 / fp16 with power-of-two head dims in [64, 256] (not MLA's
    192 / 128). consumers defaults to 1, to 2 when a head dim is 64."""
    # default consumers 2 below head dim 128: the [4, 2] accumulator of consumers=1 gets its wgmma serialised
    launch = dkdv_launch({"consumers": 1 if min(q.shape[2], v.shape[2]) >= 128 else 2, **(launch or {})})
    if not supports(q, k, v) or k.dtype != q.dtype or v.dtype != q.dtype or do.dtype != q.dtype:
        raise ValueError(f"the Gluon dk/dv kernel takes bf16/fp16 (one dtype) with power-of-two head dims in "
                         f"[64, 256], got {q.dtype}/{k.dtype}/{v.dtype}, D={q.shape[2]}, DV={v.shape[2]}")
    index = index.with_blocks(launch["block_m"], launch["block_n"])
    if q.shape[0] == 0:  # no query sees any key (as bwd_dkdv)
        return torch.zeros_like(k), torch.zeros_like(v)
    n_queries, n_q_heads, head_dim = q.shape
    n_keys, n_kv_heads, value_dim = v.shape
    bms, bn = launch["block_ms"], index.block_n
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    grid = (index.num_key_blocks * n_kv_heads,)
    if grid[0]:
        tree_attn_bwd_dkdv_gluon_kernel[grid](
            gluon_descriptor(q, bms, head_dim), gluon_descriptor(k, bn, head_dim), gluon_descriptor(v, bn, value_dim),
            gluon_descriptor(do.contiguous(), bms, value_dim), dk, dv, lse, delta, subtree_end, index.k_ptr,
            index.k_rows, index.k_full, index.k_order, scale, scale * LOG2E, n_queries, n_keys, n_keys - n_queries,
            HQ=n_q_heads, HKV=n_kv_heads, D=head_dim, DV=value_dim, BM=index.block_m, BN=bn, BMS=bms,
            STAGES=launch["stages"], HAS_OFFSET=n_keys != n_queries, CONSUMERS=launch["consumers"],
            num_warps=8 // launch["consumers"], maxnreg=MAXNREG)
    return dk, dv
