"""Gluon dk/dv kernel of the tree-attention backward for Hopper (sm_90): warp-specialised.

Same contract as ``backward.bwd_dkdv``: one CTA per (key block of BN = 64 keys, KV head), key blocks in
``k_order``, KV heads fastest; it walks the key block's transposed visit list (full query blocks first, then the
partially masked ones) for every query head of its GQA group, in query sub-tiles of BMS = 64 rows, in the Triton
kernel's order (heads, then visits, then sub-tiles fastest): p = exp2(s * scale * log2(e) - lse), dp = do v^T,
ds = p * (dp - delta), dv = sum p^T do, dk = scale * sum ds^T q (scale applied once, at the store). Rows past Tq
read q = do = 0 (TMA) and are masked out of p in the partial steps; keys past Tk read subtree_end = 0 and are not
stored. Key blocks that no query sees store zeros. q/k head dim D = D1 + D2 (D2 > 0 for MLA's 192 = 128 + 64):
q and K come as two column tiles, S sums two chained wgmma and dK^T is two accumulators.

Partitions: a 1-warp TMA producer (24 registers) loads K and V once, then per step the q and do sub-tiles into
STAGES-deep rings (q and do with their own ready mbarrier; one empty mbarrier per slot, released once the slot's
last wgmma retired). ``consumers=1``: one 8-warp consumer splits the [BMS, BN] S / dP tiles by key columns (m64
n32 wgmma per warpgroup), stages p and ds in shared memory (bf16) and queues dV^T += do^T p, dK^T += q^T ds behind
the next step's S / dP; the transposed accumulators dK^T [D, BN], dV^T [DV, BN] keep k / v out of registers, as
in the Triton kernel. ``consumers=2``: a 4-warp partition computes S (m64 n64), p and dV^T, another dP, ds and
dK^T, p handed over in fp32 through shared memory (the Triton kernel's precision for ds). ``consumers=2,
key_major=True`` (backward_dkdv_gluon_parts.consumer_s_keys / consumer_d_keys): the same split with the keys on the
wgmma's M side, S^T = K q^T and dP^T = V do^T, so p^T and ds^T enter dV += p^T do and dK += ds^T q from registers
and dK, dV accumulate as [keys, dims]. Shared memory at D = DV = 256: 208 KB (consumers=1) / 224 KB (2) / 213 KB
(key-major). docs/tree_attention_kernels.md ("Hopper kernels") gives the timings.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)

from .block_index import BlockIndex
from .backward_dkdv_gluon_parts import (acc_layout, consumer_d_any, consumer_s_any, mask_probs, step_of,
                                        step_rows, store_transposed)
from .forward import LOG2E
from .forward_gluon import (CONSUMER_REGS, HEAD_DIMS, MAXNREG, PRODUCER_REGS, column_tiles, gluon_descriptor,
                            issue_scores, qk_descriptors, supports)


@gluon.jit
def _producer(q_desc, q2_desc, do_desc, k_desc, k2_desc, v_desc, k_rows, q_bufs, q2_bufs, do_bufs, k_smem, k2_smem,
              v_smem, kv_bar, q_ready, do_ready, empty, i_n, i_kvh, start, n_full, n_visits, G: gl.constexpr,
              D: gl.constexpr, D1: gl.constexpr, D2: gl.constexpr, DV: gl.constexpr, BM: gl.constexpr,
              BN: gl.constexpr, BMS: gl.constexpr, STAGES: gl.constexpr):
    # K and V once, then q_it, do_it per step. A fresh mbarrier counts as having completed phase "1", so the
    # first STAGES waits on `empty` pass at once. D2 > 0: q and K come as two column tiles each, on the same
    # barriers (MLA's 192 = 128 + 64).
    kv_bytes: gl.constexpr = (k_desc.block_type.nbytes + v_desc.block_type.nbytes
                              + (k2_desc.block_type.nbytes if D2 > 0 else 0))
    q_bytes: gl.constexpr = q_desc.block_type.nbytes + (q2_desc.block_type.nbytes if D2 > 0 else 0)
    mbarrier.expect(kv_bar, kv_bytes)
    tma.async_copy_global_to_shared(k_desc, [i_n * BN, i_kvh * D], kv_bar, k_smem)
    if D2 > 0:
        tma.async_copy_global_to_shared(k2_desc, [i_n * BN, i_kvh * D + D1], kv_bar, k2_smem)
    tma.async_copy_global_to_shared(v_desc, [i_n * BN, i_kvh * DV], kv_bar, v_smem)
    for it in range(G * n_visits * (BM // BMS)):
        i_h, row0, masked = step_of(it, k_rows, start, n_full, n_visits, i_kvh, G, BM, BMS)
        slot = it % STAGES
        mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(q_ready.index(slot), q_bytes)
        tma.async_copy_global_to_shared(q_desc, [row0, i_h * D], q_ready.index(slot), q_bufs.index(slot))
        if D2 > 0:
            tma.async_copy_global_to_shared(q2_desc, [row0, i_h * D + D1], q_ready.index(slot), q2_bufs.index(slot))
        mbarrier.expect(do_ready.index(slot), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [row0, i_h * DV], do_ready.index(slot), do_bufs.index(slot))


@gluon.jit
def _consumer(q_bufs, q2_bufs, do_bufs, k_smem, k2_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready, do_ready, empty,
              k_rows, subtree_end, dk, dv, lse, delta, scale, scale_log2, i_n, i_kvh, start, n_full, n_visits, TQ,
              TK, q_offset, HKV: gl.constexpr, G: gl.constexpr, D: gl.constexpr, D1: gl.constexpr,
              D2: gl.constexpr, DV: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BMS: gl.constexpr,
              STAGES: gl.constexpr, HAS_OFFSET: gl.constexpr):
    # score tiles [BMS, BN] split by key columns: warpgroup w owns keys [w * BN / 2, (w + 1) * BN / 2)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BN // 2, 16])
    dk_layout: gl.constexpr = acc_layout(D1, BN)
    dv_layout: gl.constexpr = acc_layout(DV, BN)
    dtype: gl.constexpr = q_bufs.dtype

    offs_n = i_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
    end = gl.load(subtree_end + offs_n, mask=offs_n < TK, other=0)  # keys past TK: end 0, seen by no row
    rows = gl.arange(0, BMS, layout=gl.SliceLayout(1, s_layout))
    # accumulator "tokens" from the start, so the loop carries one type (the first use_acc=True adds zeros)
    dkt = warpgroup_mma_init(gl.zeros([D1, BN], gl.float32, dk_layout))
    dvt = warpgroup_mma_init(gl.zeros([DV, BN], gl.float32, dv_layout))
    if D2 > 0:  # dK^T's last D2 rows (q2^T ds)
        dk2_layout: gl.constexpr = acc_layout(D2, BN)
        dkt2 = warpgroup_mma_init(gl.zeros([D2, BN], gl.float32, dk2_layout))
    mbarrier.wait(kv_bar, 0)
    v_t = v_smem.permute((1, 0))

    for it in range(G * n_visits * (BM // BMS)):
        # lse / delta early: their latency hides behind the waits (rows past TQ read 0)
        i_h, masked, slot, phase, offs_m, m_valid, lse_i = step_rows(it, k_rows, start, n_full, n_visits, i_kvh,
                                                                     rows, TQ, lse, G, BM, BMS, STAGES)
        delta_i = gl.load(delta + i_h.to(gl.int64) * TQ + offs_m, mask=m_valid, other=0.0)
        prev = (it + STAGES - 1) % STAGES
        q_s = q_bufs.index(slot)
        q2_s = q2_bufs.index(slot)
        do_s = do_bufs.index(slot)

        mbarrier.wait(q_ready.index(slot), phase)
        s_tok = issue_scores(q_s, q2_s, k_smem, k2_smem, BMS, BN, D2, s_layout)
        mbarrier.wait(do_ready.index(slot), phase)
        dp_tok = warpgroup_mma(do_s, v_t, gl.zeros([BMS, BN], gl.float32, s_layout), use_acc=False,
                               is_async=True)
        # wgmma groups retire in order: dV, dK of the previous step, then S; dP may still run
        if D2 > 0:
            done = warpgroup_mma_wait(1, deps=(dvt, dkt, dkt2, s_tok, p_smem, ds_smem, q_bufs.index(prev),
                                               q2_bufs.index(prev), do_bufs.index(prev), k_smem, k2_smem))
            dkt2 = done[2]
            s = done[3]
        else:
            done = warpgroup_mma_wait(1, deps=(dvt, dkt, s_tok, p_smem, ds_smem, q_bufs.index(prev),
                                               do_bufs.index(prev), k_smem))
            s = done[2]
        dvt = done[0]
        dkt = done[1]
        # both warpgroups past that wait: the previous step's ring slot, p_smem and ds_smem are free
        gl.thread_barrier()
        mbarrier.arrive(empty.index(prev), count=1, pred=it > 0)

        p = gl.exp2(s * scale_log2 - lse_i[:, None])
        if masked:
            p = mask_probs(p, offs_n[None, :], end[None, :], offs_m[:, None], m_valid[:, None], q_offset,
                           HAS_OFFSET)
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
        if D2 > 0:
            dkt2 = warpgroup_mma(q2_s.permute((1, 0)), ds_smem, dkt2, is_async=True)

    # the last step's slot needs no release (the producer is done)
    if D2 > 0:
        done = warpgroup_mma_wait(0, deps=(dvt, dkt, dkt2, p_smem, ds_smem, q_bufs, q2_bufs, do_bufs))
        store_transposed(dk, done[2] * scale, i_n, i_kvh, TK, HKV, D, D1, D2, BN, dk2_layout)
    else:
        done = warpgroup_mma_wait(0, deps=(dvt, dkt, p_smem, ds_smem, q_bufs, do_bufs))
    store_transposed(dk, done[1] * scale, i_n, i_kvh, TK, HKV, D, 0, D1, BN, dk_layout)
    store_transposed(dv, done[0], i_n, i_kvh, TK, HKV, DV, 0, DV, BN, dv_layout)


@gluon.jit
def tree_attn_bwd_dkdv_gluon_kernel(q_desc, q2_desc, k_desc, k2_desc, v_desc, do_desc, dk, dv, lse, delta,
                                    subtree_end, k_ptr, k_rows, k_full, k_order, scale, scale_log2, TQ, TK, q_offset,
                                    HQ: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, D1: gl.constexpr,
                                    D2: gl.constexpr, DV: gl.constexpr,
                                    BM: gl.constexpr, BN: gl.constexpr, BMS: gl.constexpr, STAGES: gl.constexpr,
                                    HAS_OFFSET: gl.constexpr, CONSUMERS: gl.constexpr, KEY_MAJOR: gl.constexpr,
                                    num_warps: gl.constexpr):
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
    if D2 > 0:  # the second column tiles of q and K
        q2_bufs = gl.allocate_shared_memory(q2_desc.dtype, [STAGES] + q2_desc.block_type.shape, q2_desc.layout)
        k2_smem = gl.allocate_shared_memory(k2_desc.dtype, k2_desc.block_type.shape, k2_desc.layout)
    else:  # unused (every use sits under D2 > 0)
        q2_bufs = q_bufs
        k2_smem = k_smem
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
            (_consumer, (q_bufs, q2_bufs, do_bufs, k_smem, k2_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready,
                         do_ready, empty, k_rows, subtree_end, dk, dv, lse, delta, scale, scale_log2, i_n, i_kvh,
                         start, n_full, n_visits, TQ, TK, q_offset, HKV, G, D, D1, D2, DV, BM, BN, BMS, STAGES,
                         HAS_OFFSET)),
            (_producer, (q_desc, q2_desc, do_desc, k_desc, k2_desc, v_desc, k_rows, q_bufs, q2_bufs, do_bufs, k_smem,
                         k2_smem, v_smem, kv_bar, q_ready, do_ready, empty, i_n, i_kvh, start, n_full, n_visits, G,
                         D, D1, D2, DV, BM, BN, BMS, STAGES)),
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
            (consumer_s_any, (q_bufs, q2_bufs, do_bufs, k_smem, k2_smem, p_smem, p32_smem, kv_bar, q_ready, do_ready,
                              empty, p_ready, p_free, k_rows, subtree_end, dv, lse, scale_log2, i_n, i_kvh, start,
                              n_full, n_visits, TQ, TK, q_offset, HKV, G, D1, D2, DV, BM, BN, BMS, STAGES,
                              HAS_OFFSET, KEY_MAJOR)),
            (consumer_d_any, (q_bufs, q2_bufs, do_bufs, v_smem, ds_smem, p32_smem, kv_bar, q_ready, do_ready, empty,
                              p_ready, p_free, k_rows, dk, delta, scale, i_n, i_kvh, start, n_full, n_visits, TQ, TK,
                              HKV, G, D, D1, D2, BM, BN, BMS, STAGES, KEY_MAJOR)),
            (_producer, (q_desc, q2_desc, do_desc, k_desc, k2_desc, v_desc, k_rows, q_bufs, q2_bufs, do_bufs, k_smem,
                         k2_smem, v_smem, kv_bar, q_ready, do_ready, empty, i_n, i_kvh, start, n_full, n_visits, G,
                         D, D1, D2, DV, BM, BN, BMS, STAGES)),
        ], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])


def dkdv_launch(launch: dict | None = None) -> dict:
    """The full launch dict (defaults filled in); ValueError if unsupported. Keys of a Triton launch that this
    kernel has no use for (num_stages) are ignored; block_ms must be 64 and num_warps 8 if given."""
    launch = {"block_m": 128, "block_n": 64, "stages": 2, "consumers": 1, **(launch or {})}
    launch["block_ms"] = launch.get("block_ms", 64)
    launch["key_major"] = bool(launch.get("key_major", False))
    if (launch["block_n"] != 64 or launch["block_ms"] != 64 or launch["block_m"] not in (64, 128)
            or launch["consumers"] not in (1, 2) or launch.get("num_warps", 8 // launch["consumers"])
            != 8 // launch["consumers"]):
        raise ValueError(f"Gluon dk/dv launch {launch}: needs block_n 64, block_ms 64, block_m 64 or 128, "
                         "consumers 1 or 2 (num_warps 8 or 4 per consumer partition)")
    if launch["key_major"] and launch["consumers"] != 2:
        raise ValueError(f"Gluon dk/dv launch {launch}: key_major needs consumers 2")
    if launch["stages"] < 2:  # a slot is released one step after its own: one buffer would deadlock
        raise ValueError(f"Gluon dk/dv launch {launch}: stages (the q / do ring depth) must be >= 2")
    if launch.get("heads", 1) != 1:
        raise ValueError("the Gluon dk/dv kernel does not pack query heads (launch heads must be 1)")
    return launch


def bwd_dkdv_gluon(q, k, v, do, lse, delta, subtree_end, index: BlockIndex, scale: float,
                   launch: dict | None = None):
    """As ``backward.bwd_dkdv``: (dk [Tk, HKV, D], dv [Tk, HKV, DV]) in k's and v's dtypes. ``launch``: block_m
    (128), block_n (64), block_ms (64), stages (2, the q / do ring depth), consumers (1: one 8-warp consumer
    with S / dP split by key columns; 2: a 4-warp S / p / dV partition and a 4-warp dP / ds / dK one), key_major
    (False; True needs consumers 2: the two partitions with keys on the wgmma's M side). The index
    must hold the (block_m, block_n) lists. bf16 / fp16 with HEAD_DIMS (forward_gluon.py). consumers defaults to
    1, to 2 when a head dim or a q/k column tile is 64 (MLA's 192 = 128 + 64)."""
    # default consumers 2 below 128 rows: the [4, 2] accumulator of consumers=1 gets its wgmma serialised
    tiles = [d for d in column_tiles(q.shape[2]) if d]
    launch = dkdv_launch({"consumers": 1 if min(*tiles, v.shape[2]) >= 128 else 2, **(launch or {})})
    if not supports(q, k, v) or k.dtype != q.dtype or v.dtype != q.dtype or do.dtype != q.dtype:
        raise ValueError(f"the Gluon dk/dv kernel takes bf16/fp16 (one dtype) with {HEAD_DIMS}, got "
                         f"{q.dtype}/{k.dtype}/{v.dtype}, D={q.shape[2]}, DV={v.shape[2]}")
    index = index.with_blocks(launch["block_m"], launch["block_n"])
    if q.shape[0] == 0:  # no query sees any key (as bwd_dkdv)
        return torch.zeros_like(k), torch.zeros_like(v)
    n_queries, n_q_heads, head_dim = q.shape
    n_keys, n_kv_heads, value_dim = v.shape
    bms, bn = launch["block_ms"], index.block_n
    d1, d2 = column_tiles(head_dim)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    grid = (index.num_key_blocks * n_kv_heads,)
    if grid[0]:
        tree_attn_bwd_dkdv_gluon_kernel[grid](
            *qk_descriptors(q, bms), *qk_descriptors(k, bn), gluon_descriptor(v, bn, value_dim),
            gluon_descriptor(do.contiguous(), bms, value_dim), dk, dv, lse, delta, subtree_end, index.k_ptr,
            index.k_rows, index.k_full, index.k_order, scale, scale * LOG2E, n_queries, n_keys, n_keys - n_queries,
            HQ=n_q_heads, HKV=n_kv_heads, D=head_dim, D1=d1, D2=d2, DV=value_dim, BM=index.block_m, BN=bn, BMS=bms,
            STAGES=launch["stages"], HAS_OFFSET=n_keys != n_queries, CONSUMERS=launch["consumers"],
            KEY_MAJOR=launch["key_major"],
            num_warps=8 // launch["consumers"], maxnreg=MAXNREG)
    return dk, dv
