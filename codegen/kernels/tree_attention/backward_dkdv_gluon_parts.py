"""Pieces of the Gluon dk/dv kernel (``backward_dkdv_gluon.py``): its step order, its accumulator layouts and
stores, and the two consumer partitions of ``consumers=2`` in both orientations: query-major (S / p / dV^T and
dP / ds / dK^T) and key-major (S^T / p^T / dV and dP^T / ds^T / dK), p handed over in fp32 through shared memory
either way; the contract and the partitionings are described there.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)

from .forward_gluon import issue_scores


@gluon.jit
def step_of(it, k_rows, start, n_full, n_visits, i_kvh, G: gl.constexpr, BM: gl.constexpr, BMS: gl.constexpr):
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
def step_rows(it, k_rows, start, n_full, n_visits, i_kvh, rows, TQ, per_row, G: gl.constexpr, BM: gl.constexpr,
              BMS: gl.constexpr, STAGES: gl.constexpr):
    """A consumer's view of flat step `it`: (query head, masked, ring slot, its mbarrier phase, local query rows
    `rows` of the sub-tile, their validity, per_row[head, rows] (lse or delta; 0 past Tq))."""
    i_h, row0, masked = step_of(it, k_rows, start, n_full, n_visits, i_kvh, G, BM, BMS)
    offs_m = row0 + rows
    m_valid = offs_m < TQ
    values = gl.load(per_row + i_h.to(gl.int64) * TQ + offs_m, mask=m_valid, other=0.0)
    return i_h, masked, it % STAGES, (it // STAGES) & 1, offs_m, m_valid, values


@gluon.jit
def mask_probs(p, keys, ends, rows, valid, q_offset, HAS_OFFSET: gl.constexpr):
    """p of a partial step with the tree mask applied: `keys` / `ends` (key columns and their subtree ends) and
    `rows` / `valid` (local query rows and row < Tq) come expanded to p's key and row axes, so one mask serves
    the query-major [rows, keys] and the key-major [keys, rows] tiles."""
    if HAS_OFFSET:
        rows = rows + q_offset
    return gl.where((keys <= rows) & (rows < ends) & valid, p, 0.0)


@gluon.constexpr_function
def acc_layout(rows, bn):
    """wgmma accumulator layout of a transposed gradient [rows, bn] on 8 warps: split by rows (each warpgroup
    rows / 2, two m64 tiles at 256) when rows >= 128, else (rows = 64: one m64 tile) by key columns."""
    if rows >= 128:
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, bn, 16])
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, bn // 2, 16])


@gluon.constexpr_function
def warpgroup_layout(cols):
    """wgmma accumulator layout of a [64, cols] tile on one warpgroup (one m64 n-cols wgmma): the 4-warp consumer
    partitions' score, dP and gradient tiles in either orientation."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cols, 16])


@gluon.jit
def store_transposed(out, acc, i_n, i_kvh, TK, HKV: gl.constexpr, DIM: gl.constexpr, COL0: gl.constexpr,
                      ROWS: gl.constexpr, BN: gl.constexpr, layout: gl.constexpr):
    # acc [ROWS, BN] is out[keys, i_kvh, COL0:COL0 + ROWS]^T (out's head dim DIM): stored through transposed
    # pointers, keys past TK dropped
    offs_n = i_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    offs_d = COL0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    ptrs = out + (offs_n.to(gl.int64) * (HKV * DIM) + i_kvh * DIM)[None, :] + offs_d[:, None]
    gl.store(ptrs, acc.to(out.dtype.element_ty), mask=(offs_n < TK)[None, :])


@gluon.jit
def consumer_s(q_bufs, q2_bufs, do_bufs, k_smem, k2_smem, p_smem, p32_smem, kv_bar, q_ready, do_ready, empty,
                p_ready, p_free, k_rows, subtree_end, dv, lse, scale_log2, i_n, i_kvh, start, n_full, n_visits, TQ,
                TK, q_offset, HKV: gl.constexpr, G: gl.constexpr, D2: gl.constexpr, DV: gl.constexpr,
                BM: gl.constexpr, BN: gl.constexpr, BMS: gl.constexpr, STAGES: gl.constexpr,
                HAS_OFFSET: gl.constexpr):
    """CONSUMERS = 2, 4 warps: S = q K^T (one m64 n64 wgmma), p, dV^T += do^T p; hands p (fp32) to _consumer_d."""
    s_layout: gl.constexpr = warpgroup_layout(BN)
    dv_layout: gl.constexpr = s_layout  # dV^T [DV, BN]: DV / 64 m64 tiles of the same n-BN layout
    rows = gl.arange(0, BMS, layout=gl.SliceLayout(1, s_layout))
    dvt = gl.zeros([DV, BN], gl.float32, dv_layout)
    mbarrier.wait(kv_bar, 0)
    for it in range(G * n_visits * (BM // BMS)):
        i_h, masked, slot, phase, offs_m, m_valid, lse_i = step_rows(it, k_rows, start, n_full, n_visits, i_kvh,
                                                                     rows, TQ, lse, G, BM, BMS, STAGES)
        q_s = q_bufs.index(slot)
        do_s = do_bufs.index(slot)
        mbarrier.wait(q_ready.index(slot), phase)
        s_tok = issue_scores(q_s, q2_bufs.index(slot), k_smem, k2_smem, BMS, BN, D2, s_layout)
        s = warpgroup_mma_wait(0, deps=(s_tok, q_s, k_smem))[0]
        p = gl.exp2(s * scale_log2 - lse_i[:, None])
        if masked:  # key columns and ends loaded here: n64 tiles give a thread 16 columns, 32 registers to keep
            offs_n = i_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
            end = gl.load(subtree_end + offs_n, mask=offs_n < TK, other=0)
            p = mask_probs(p, offs_n[None, :], end[None, :], offs_m[:, None], m_valid[:, None], q_offset,
                           HAS_OFFSET)
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
    store_transposed(dv, dvt, i_n, i_kvh, TK, HKV, DV, 0, DV, BN, dv_layout)


@gluon.jit
def consumer_d(q_bufs, q2_bufs, do_bufs, v_smem, ds_smem, p32_smem, kv_bar, q_ready, do_ready, empty, p_ready,
                p_free, k_rows, dk, delta, scale, i_n, i_kvh, start, n_full, n_visits, TQ, TK, HKV: gl.constexpr,
                G: gl.constexpr, D: gl.constexpr, D1: gl.constexpr, D2: gl.constexpr, BM: gl.constexpr,
                BN: gl.constexpr, BMS: gl.constexpr, STAGES: gl.constexpr):
    """CONSUMERS = 2, 4 warps: dP = do V^T (one m64 n64 wgmma), ds from _consumer_s's fp32 p (the Triton
    kernel's precision), dK^T += q^T ds."""
    s_layout: gl.constexpr = warpgroup_layout(BN)
    dk_layout: gl.constexpr = s_layout  # dK^T [D1, BN]: D1 / 64 m64 tiles of the same n-BN layout
    rows = gl.arange(0, BMS, layout=gl.SliceLayout(1, s_layout))
    dkt = warpgroup_mma_init(gl.zeros([D1, BN], gl.float32, dk_layout))
    if D2 > 0:  # dK^T's last D2 rows (q2^T ds)
        dkt2 = warpgroup_mma_init(gl.zeros([D2, BN], gl.float32, dk_layout))
    mbarrier.wait(kv_bar, 0)
    v_t = v_smem.permute((1, 0))
    for it in range(G * n_visits * (BM // BMS)):
        i_h, masked, slot, phase, offs_m, m_valid, delta_i = step_rows(it, k_rows, start, n_full, n_visits, i_kvh,
                                                                       rows, TQ, delta, G, BM, BMS, STAGES)
        prev = (it + STAGES - 1) % STAGES
        q_s = q_bufs.index(slot)
        do_s = do_bufs.index(slot)
        mbarrier.wait(do_ready.index(slot), phase)
        dp_tok = warpgroup_mma(do_s, v_t, gl.zeros([BMS, BN], gl.float32, s_layout), use_acc=False,
                               is_async=True)
        if D2 > 0:
            done = warpgroup_mma_wait(0, deps=(dkt, dp_tok, dkt2, ds_smem, q_bufs.index(prev), q2_bufs.index(prev),
                                               do_bufs.index(prev), v_smem))
            dkt2 = done[2]
        else:
            done = warpgroup_mma_wait(0, deps=(dkt, dp_tok, ds_smem, q_bufs.index(prev), do_bufs.index(prev),
                                               v_smem))
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
        if D2 > 0:
            dkt2 = warpgroup_mma(q2_bufs.index(slot).permute((1, 0)), ds_smem, dkt2, is_async=True)
    if D2 > 0:
        done = warpgroup_mma_wait(0, deps=(dkt, dkt2, ds_smem, q_bufs, q2_bufs))
        store_transposed(dk, done[1] * scale, i_n, i_kvh, TK, HKV, D, D1, D2, BN, dk_layout)
    else:
        done = warpgroup_mma_wait(0, deps=(dkt, ds_smem, q_bufs))
    store_transposed(dk, done[0] * scale, i_n, i_kvh, TK, HKV, D, 0, D1, BN, dk_layout)


@gluon.jit
def store_rows(out, acc, i_n, i_kvh, TK, HKV: gl.constexpr, DIM: gl.constexpr, COL0: gl.constexpr,
               COLS: gl.constexpr, BN: gl.constexpr, layout: gl.constexpr):
    # acc [BN, COLS] is out[keys, i_kvh, COL0:COL0 + COLS] (out's head dim DIM); keys past TK dropped
    offs_n = i_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
    offs_d = COL0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    ptrs = out + (offs_n.to(gl.int64) * (HKV * DIM) + i_kvh * DIM)[:, None] + offs_d[None, :]
    gl.store(ptrs, acc.to(out.dtype.element_ty), mask=(offs_n < TK)[:, None])


@gluon.jit
def consumer_s_keys(q_bufs, q2_bufs, do_bufs, k_smem, k2_smem, p32_smem, kv_bar, q_ready, do_ready, empty,
                    p_ready, p_free, k_rows, subtree_end, dv, lse, scale_log2, i_n, i_kvh, start, n_full, n_visits,
                    TQ, TK, q_offset, HKV: gl.constexpr, G: gl.constexpr, D1: gl.constexpr, D2: gl.constexpr,
                    DV: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BMS: gl.constexpr, STAGES: gl.constexpr,
                    HAS_OFFSET: gl.constexpr):
    """CONSUMERS = 2, key-major, 4 warps: S^T = K q^T (m64 n-BMS wgmma), p^T, dV += p^T do (p^T from registers);
    hands p^T (fp32) to consumer_d_keys."""
    s_layout: gl.constexpr = warpgroup_layout(BMS)
    dv_layout: gl.constexpr = warpgroup_layout(DV)
    p_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_layout, k_width=2)
    dtype: gl.constexpr = q_bufs.dtype
    cols = gl.arange(0, BMS, layout=gl.SliceLayout(0, s_layout))
    offs_n = i_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, s_layout))
    dvacc = gl.zeros([BN, DV], gl.float32, dv_layout)
    mbarrier.wait(kv_bar, 0)
    for it in range(G * n_visits * (BM // BMS)):
        i_h, masked, slot, phase, offs_m, m_valid, lse_i = step_rows(it, k_rows, start, n_full, n_visits, i_kvh,
                                                                     cols, TQ, lse, G, BM, BMS, STAGES)
        q_s = q_bufs.index(slot)
        do_s = do_bufs.index(slot)
        mbarrier.wait(q_ready.index(slot), phase)
        s_tok = issue_scores(k_smem, k2_smem, q_s, q2_bufs.index(slot), BN, BMS, D2, s_layout)
        st = warpgroup_mma_wait(0, deps=(s_tok, q_s, q2_bufs.index(slot), k_smem, k2_smem))[0]
        pt = gl.exp2(st * scale_log2 - lse_i[None, :])
        if masked:
            end = gl.load(subtree_end + offs_n, mask=offs_n < TK, other=0)
            pt = mask_probs(pt, offs_n[:, None], end[:, None], offs_m[None, :], m_valid[None, :], q_offset,
                            HAS_OFFSET)
        mbarrier.wait(p_free, (it & 1) ^ 1)  # consumer_d_keys has read the previous p^T
        p32_smem.store(pt)
        fence_async_shared()
        gl.thread_barrier()  # all 4 warps' p^T stored before the arrive
        mbarrier.arrive(p_ready, count=1)
        p_op = gl.convert_layout(pt.to(dtype), p_op_layout)
        mbarrier.wait(do_ready.index(slot), phase)
        dv_tok = warpgroup_mma(p_op, do_s, dvacc, is_async=True)
        dvacc = warpgroup_mma_wait(0, deps=(dv_tok, p_op, do_s))[0]
        gl.thread_barrier()
        mbarrier.arrive(empty.index(slot), count=1)  # this partition is done with the slot
    store_rows(dv, dvacc, i_n, i_kvh, TK, HKV, DV, 0, DV, BN, dv_layout)


@gluon.jit
def consumer_d_keys(q_bufs, q2_bufs, do_bufs, v_smem, p32_smem, kv_bar, q_ready, do_ready, empty, p_ready, p_free,
                    k_rows, dk, delta, scale, i_n, i_kvh, start, n_full, n_visits, TQ, TK, HKV: gl.constexpr,
                    G: gl.constexpr, D: gl.constexpr, D1: gl.constexpr, D2: gl.constexpr, BM: gl.constexpr,
                    BN: gl.constexpr, BMS: gl.constexpr, STAGES: gl.constexpr):
    """CONSUMERS = 2, key-major, 4 warps: dP^T = V do^T, ds^T from consumer_s_keys's fp32 p^T (the Triton kernel's
    precision), dK += ds^T q (ds^T from registers)."""
    s_layout: gl.constexpr = warpgroup_layout(BMS)
    dk_layout: gl.constexpr = warpgroup_layout(D1)
    dk2_layout: gl.constexpr = warpgroup_layout(D2 if D2 > 0 else D1)
    ds_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk_layout, k_width=2)
    dtype: gl.constexpr = q_bufs.dtype
    cols = gl.arange(0, BMS, layout=gl.SliceLayout(0, s_layout))
    dkacc = gl.zeros([BN, D1], gl.float32, dk_layout)
    dk2acc = gl.zeros([BN, D2 if D2 > 0 else D1], gl.float32, dk2_layout)
    mbarrier.wait(kv_bar, 0)
    for it in range(G * n_visits * (BM // BMS)):
        i_h, masked, slot, phase, offs_m, m_valid, delta_i = step_rows(it, k_rows, start, n_full, n_visits, i_kvh,
                                                                       cols, TQ, delta, G, BM, BMS, STAGES)
        do_s = do_bufs.index(slot)
        mbarrier.wait(do_ready.index(slot), phase)
        dp_tok = warpgroup_mma(v_smem, do_s.permute((1, 0)), gl.zeros([BN, BMS], gl.float32, s_layout),
                               use_acc=False, is_async=True)
        dpt = warpgroup_mma_wait(0, deps=(dp_tok, do_s, v_smem))[0]
        mbarrier.wait(p_ready, it & 1)
        pt = p32_smem.load(s_layout)
        gl.thread_barrier()  # all 4 warps read p^T before it may be overwritten
        mbarrier.arrive(p_free, count=1)
        dst = (pt * (dpt - delta_i[None, :])).to(dtype)
        ds_op = gl.convert_layout(dst, ds_op_layout)
        mbarrier.wait(q_ready.index(slot), phase)
        # both dK wgmma retire within the step: left in flight into the next one, ptxas serialises every wgmma
        # for lack of registers (C7512). The second takes the same ds^T registers: an m64 wgmma's A-operand layout
        # does not depend on its N.
        dk_tok = warpgroup_mma(ds_op, q_bufs.index(slot), dkacc, is_async=True)
        if D2 > 0:
            dk2_tok = warpgroup_mma(ds_op, q2_bufs.index(slot), dk2acc, is_async=True)
            done = warpgroup_mma_wait(0, deps=(dk_tok, dk2_tok, ds_op, q_bufs.index(slot),
                                               q2_bufs.index(slot)))
            dk2acc = done[1]
        else:
            done = warpgroup_mma_wait(0, deps=(dk_tok, ds_op, q_bufs.index(slot)))
        dkacc = done[0]
        gl.thread_barrier()
        mbarrier.arrive(empty.index(slot), count=1)  # this partition is done with the slot
    if D2 > 0:
        store_rows(dk, dk2acc * scale, i_n, i_kvh, TK, HKV, D, D1, D2, BN, dk2_layout)
    store_rows(dk, dkacc * scale, i_n, i_kvh, TK, HKV, D, 0, D1, BN, dk_layout)


@gluon.jit
def consumer_s_any(q_bufs, q2_bufs, do_bufs, k_smem, k2_smem, p_smem, p32_smem, kv_bar, q_ready, do_ready, empty,
                   p_ready, p_free, k_rows, subtree_end, dv, lse, scale_log2, i_n, i_kvh, start, n_full, n_visits, TQ,
                   TK, q_offset, HKV: gl.constexpr, G: gl.constexpr, D1: gl.constexpr, D2: gl.constexpr,
                   DV: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BMS: gl.constexpr, STAGES: gl.constexpr,
                   HAS_OFFSET: gl.constexpr, KEY_MAJOR: gl.constexpr):
    """The S / p / dV partition of consumers=2 in the launch's orientation."""
    if KEY_MAJOR:
        consumer_s_keys(q_bufs, q2_bufs, do_bufs, k_smem, k2_smem, p32_smem, kv_bar, q_ready, do_ready, empty,
                        p_ready, p_free, k_rows, subtree_end, dv, lse, scale_log2, i_n, i_kvh, start, n_full,
                        n_visits, TQ, TK, q_offset, HKV, G, D1, D2, DV, BM, BN, BMS, STAGES, HAS_OFFSET)
    else:
        consumer_s(q_bufs, q2_bufs, do_bufs, k_smem, k2_smem, p_smem, p32_smem, kv_bar, q_ready, do_ready, empty,
                   p_ready, p_free, k_rows, subtree_end, dv, lse, scale_log2, i_n, i_kvh, start, n_full, n_visits, TQ,
                   TK, q_offset, HKV, G, D2, DV, BM, BN, BMS, STAGES, HAS_OFFSET)


@gluon.jit
def consumer_d_any(q_bufs, q2_bufs, do_bufs, v_smem, ds_smem, p32_smem, kv_bar, q_ready, do_ready, empty, p_ready,
                   p_free, k_rows, dk, delta, scale, i_n, i_kvh, start, n_full, n_visits, TQ, TK, HKV: gl.constexpr,
                   G: gl.constexpr, D: gl.constexpr, D1: gl.constexpr, D2: gl.constexpr, BM: gl.constexpr,
                   BN: gl.constexpr, BMS: gl.constexpr, STAGES: gl.constexpr, KEY_MAJOR: gl.constexpr):
    """The dP / ds / dK partition of consumers=2 in the launch's orientation."""
    if KEY_MAJOR:
        consumer_d_keys(q_bufs, q2_bufs, do_bufs, v_smem, p32_smem, kv_bar, q_ready, do_ready, empty, p_ready,
                        p_free, k_rows, dk, delta, scale, i_n, i_kvh, start, n_full, n_visits, TQ, TK, HKV, G, D, D1,
                        D2, BM, BN, BMS, STAGES)
    else:
        consumer_d(q_bufs, q2_bufs, do_bufs, v_smem, ds_smem, p32_smem, kv_bar, q_ready, do_ready, empty, p_ready,
                   p_free, k_rows, dk, delta, scale, i_n, i_kvh, start, n_full, n_visits, TQ, TK, HKV, G, D, D1, D2,
                   BM, BN, BMS, STAGES)
