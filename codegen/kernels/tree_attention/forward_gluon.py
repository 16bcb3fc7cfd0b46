"""Gluon forward of tree attention for Hopper (sm_90): warp-specialised, FA3-style.

Same contract as ``forward.tree_attention_forward`` (visit lists, tree mask ``j <= i < subtree_end[j]`` with
``i = local + q_offset``, base-2 softmax with ``scale * log2(e)`` folded, finite running-max floor -1e30,
o [Tq, HQ, DV] in q's dtype, lse [HQ, Tq] fp32 base 2). Why Gluon: Triton 3.6 on sm_90 ends every matmul
group in a full warpgroup wait and gives no warp specialisation (docs/tree_attention_kernels.md, "Open").

One CTA per (query block of BM = 128 rows, query head), query blocks in ``q_order``, heads fastest.
Partitions (``gl.warp_specialize``):

- producer, 1 warp, 24 registers: TMA-loads the q tile once, then K and V tiles of the visit list into two
  rings of STAGES buffers each, K and V with separate ready/empty mbarriers so the consumer can start
  ``q k^T`` of a block as soon as its K lands, before its V;
- consumer (the default partition), 8 warps = 2 warpgroups of 64 score rows each (one [128, *] wgmma
  accumulator with warps [8, 1] gives every warpgroup its own m64 slice): online softmax in registers.

Intra-warpgroup overlap (FA3 section 3.2): iteration ``it`` issues ``S_it = q K_it^T`` and ``O += P_{it-1}
V_{it-1}`` as async wgmma, waits for S only (``warpgroup_mma_wait(1)``), runs the softmax of block ``it``
while the P V wgmma is still on the tensor cores, then waits for it and rescales O. P goes to the P V wgmma
from registers (RS form), so it never touches shared memory.

Registers (maxnreg 168 x 12 warps = 64,512): the producer warpgroup gets 24 a thread, the consumer
warpgroups the rest, (64,512 - 4 * 32 * 24) / 256 = 240 a thread: O 128x256 fp32 is 128 a thread, S and
the next S 32 each, P in bf16 16. Shared memory at D = DV = 256, BN = 64, STAGES = 2: q 64 KB + K 2 x 32
KB + V 2 x 32 KB = 192 KB (+ barriers).

Full key blocks (the first ``q_full`` of the list) skip the mask; the rest load ``subtree_end`` for their
64 keys and mask per element. That choice is a runtime branch per block here (one loop keeps the
pipeline across the full/masked boundary); rows and keys past the ends are masked there as well (TMA
reads rows past Tk as zeros, the mask gives them -inf).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .block_index import BlockIndex
from .forward import LOG2E, split_head_dim

GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
PRODUCER_REGS: gl.constexpr = gl.constexpr(24)  # setmaxnreg of the 1-warp TMA partition (the minimum)
CONSUMER_REGS: gl.constexpr = gl.constexpr(240)  # the worker consumer of CONSUMERS = 2 (the default gets the rest)
MAXNREG = 168          # per thread at launch: 12 warps x 32 x 168 <= 65,536; consumers end with 240


@gluon.jit
def _producer(q_desc, q2_desc, k_desc, k2_desc, v_desc, q_cols, q_smem, q2_smem, k_bufs, k2_bufs, v_bufs, q_bar,
              k_ready, k_empty, v_ready, v_empty, row_q, col_q, col_k, col_v, start, count,
              D1: gl.constexpr, D2: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
    # q once, then K_it, V_it in visit-list order. A slot is refilled once the consumer released it; a fresh
    # mbarrier counts as having completed phase "1", so the first STAGES waits on `empty` pass at once.
    # D2 > 0 (MLA's 192 = 128 + 64): q and K come as two column tiles each, on the same barriers
    q_bytes: gl.constexpr = q_desc.block_type.nbytes + (q2_desc.block_type.nbytes if D2 > 0 else 0)
    k_bytes: gl.constexpr = k_desc.block_type.nbytes + (k2_desc.block_type.nbytes if D2 > 0 else 0)
    mbarrier.expect(q_bar, q_bytes)
    tma.async_copy_global_to_shared(q_desc, [row_q, col_q], q_bar, q_smem)
    if D2 > 0:
        tma.async_copy_global_to_shared(q2_desc, [row_q, col_q + D1], q_bar, q2_smem)
    for it in range(count):
        slot = it % STAGES
        phase = (it // STAGES) & 1
        row_k = gl.load(q_cols + start + it) * BN
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        mbarrier.expect(k_ready.index(slot), k_bytes)
        tma.async_copy_global_to_shared(k_desc, [row_k, col_k], k_ready.index(slot), k_bufs.index(slot))
        if D2 > 0:
            tma.async_copy_global_to_shared(k2_desc, [row_k, col_k + D1], k_ready.index(slot), k2_bufs.index(slot))
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row_k, col_v], v_ready.index(slot), v_bufs.index(slot))


@gluon.jit
def _softmax(s, m_i, l_i, n_blk, masked, subtree_end, rows_g, TK, scale_log2,
             BN: gl.constexpr, s_layout: gl.constexpr):
    """(p fp32, new running max, new row sum, rescale factor of O) of raw scores s [BM, BN] of key block
    n_blk; masked: apply the tree mask (runtime branch, only the partial blocks pay for it)."""
    if masked:
        offs_n = n_blk * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        end = gl.load(subtree_end + offs_n, mask=offs_n < TK, other=0)
        visible = (offs_n[None, :] <= rows_g[:, None]) & (rows_g[:, None] < end[None, :])
        s = gl.where(visible, s, float("-inf"))
    # max in the scaled domain (scale > 0 commutes with max); exp2(s * c - m) is one FFMA + MUFU per element
    m_new = gl.maximum(m_i, gl.max(s, 1) * scale_log2)
    p = gl.exp2(s * scale_log2 - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def issue_scores(q_rows, q2_rows, k_buf, k2_buf, ROWS: gl.constexpr, BN: gl.constexpr, D2: gl.constexpr,
            s_layout: gl.constexpr):
    """Issue S = q K^T as async wgmma (two chained ones over the column tiles when D2 > 0); returns the token."""
    s_tok = warpgroup_mma(q_rows, k_buf.permute((1, 0)), gl.zeros([ROWS, BN], gl.float32, s_layout),
                          use_acc=False, is_async=True)
    if D2 > 0:
        s_tok = warpgroup_mma(q2_rows, k2_buf.permute((1, 0)), s_tok, is_async=True)
    return s_tok


@gluon.jit
def _consumer(q_smem, q2_smem, k_bufs, k2_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, q_cols,
              subtree_end, o, lse, scale_log2, i_m, i_h, start, n_full, count, TQ, TK, q_offset,
              HQ: gl.constexpr, DV: gl.constexpr, D2: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
              STAGES: gl.constexpr, HAS_OFFSET: gl.constexpr, ROW0: gl.constexpr, ROWS: gl.constexpr,
              WARPS: gl.constexpr):
    """Rows [ROW0, ROW0 + ROWS) of the query block, on WARPS warps (ROWS = 16 * WARPS)."""
    # wgmma layouts: warps [WARPS, 1] give every warpgroup its own m64 slice of the rows; the score tile is
    # one n64 instruction wide, the O accumulator one n256 (DV <= 256)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, DV, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = q_smem.dtype

    q_rows = q_smem.slice(ROW0, ROWS)  # this consumer's rows of the q tile (dim 0)
    q2_rows = q2_smem.slice(ROW0, ROWS)
    offs_m = i_m * BM + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))  # local query rows
    rows_g = offs_m
    if HAS_OFFSET:
        rows_g = offs_m + q_offset
    m_i = gl.full([ROWS], -1.0e30, gl.float32, gl.SliceLayout(1, s_layout))  # finite: see forward.py
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, DV], gl.float32, o_layout)

    # block 0: scores and softmax with nothing to overlap yet (O is zero, so no rescale)
    mbarrier.wait(q_bar, 0)
    # q as the register operand of S where it fits (48 registers a thread at MLA's 192 on one warpgroup): every
    # S wgmma then reads only K from shared memory
    Q_IN_REGS: gl.constexpr = WARPS == 4 and q_smem.shape[1] + D2 <= 192
    if Q_IN_REGS:
        q_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        q_rows = q_rows.load(q_op_layout)
        if D2 > 0:
            q2_rows = q2_rows.load(q_op_layout)
    mbarrier.wait(k_ready.index(0), 0)
    # use_acc=False ignores the zeros; they are made where used so they are not live across the loop
    s_tok = issue_scores(q_rows, q2_rows, k_bufs.index(0), k2_bufs.index(0), ROWS, BN, D2, s_layout)
    s = warpgroup_mma_wait(0, deps=(s_tok, q_rows, k_bufs.index(0)))[0]
    mbarrier.arrive(k_empty.index(0), count=1)
    p, m_i, l_i, alpha = _softmax(s, m_i, l_i, gl.load(q_cols + start), n_full == 0, subtree_end, rows_g,
                                  TK, scale_log2, BN, s_layout)

    for it in range(1, count):
        slot = it % STAGES
        prev = (it - 1) % STAGES
        n_blk = gl.load(q_cols + start + it)  # early: its latency hides behind the waits below
        # S_it = q K_it^T, issued first so the tensor cores have it queued behind nothing
        mbarrier.wait(k_ready.index(slot), (it // STAGES) & 1)
        s_tok = issue_scores(q_rows, q2_rows, k_bufs.index(slot), k2_bufs.index(slot), ROWS, BN, D2, s_layout)
        # O += P_{it-1} V_{it-1}, P from registers
        mbarrier.wait(v_ready.index(prev), ((it - 1) // STAGES) & 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        o_tok = warpgroup_mma(p_op, v_bufs.index(prev), acc, is_async=True)
        # wait for S only (wgmma groups retire in order); K_it's slot can be refilled
        s = warpgroup_mma_wait(1, deps=(s_tok, k_bufs.index(slot)))[0]
        mbarrier.arrive(k_empty.index(slot), count=1)
        # softmax of block it overlaps the P V wgmma of block it-1
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, n_blk, it >= n_full, subtree_end,
                                      rows_g, TK, scale_log2, BN, s_layout)
        acc = warpgroup_mma_wait(0, deps=(o_tok, p_op, v_bufs.index(prev)))[0]
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]

    # the last block's P V
    last = (count - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((count - 1) // STAGES) & 1)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    o_tok = warpgroup_mma(p_op, v_bufs.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(o_tok, p_op, v_bufs.index(last)))[0]
    mbarrier.arrive(v_empty.index(last), count=1)

    # epilogue: rows past TQ saw nothing (l = 0); keep them finite, they are not stored
    l_safe = gl.where(l_i > 0, l_i, 1.0)
    l_o = gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))
    out = (acc / l_o[:, None]).to(dtype)
    rows_o = i_m * BM + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    offs_dv = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
    ptrs = o + (rows_o.to(gl.int64) * (HQ * DV) + i_h * DV)[:, None] + offs_dv[None, :]
    gl.store(ptrs, out, mask=(rows_o < TQ)[:, None])
    gl.store(lse + i_h.to(gl.int64) * TQ + offs_m, m_i + gl.log2(l_safe), mask=offs_m < TQ)


@gluon.jit
def query_block_program(q_ptr, q_full, q_order, HQ: gl.constexpr, HKV: gl.constexpr):
    """(query head, query block, KV head, first visit, visit count, full visits) of this program: one per (query
    block, query head), blocks in ``q_order``, heads fastest (the forward's and the dq kernel's grid)."""
    pid = gl.program_id(0)
    i_h = pid % HQ
    i_m = gl.load(q_order + pid // HQ)
    start = gl.load(q_ptr + i_m)
    count = gl.load(q_ptr + i_m + 1) - start  # >= 1: a query block always sees its diagonal key block
    return i_h, i_m, i_h // (HQ // HKV), start, count, gl.load(q_full + i_m)


@gluon.jit
def ring_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """(ready, empty) mbarriers of a STAGES-slot ring: ready completed by a slot's TMA transaction bytes (one
    expect-arrive), empty by one arrive per consumer partition, made after its wgmma on the slot retired (the
    arrive is preceded by a partition bar.sync)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    return ready, empty


@gluon.jit
def tree_attn_fwd_gluon_kernel(q_desc, q2_desc, k_desc, k2_desc, v_desc, o, lse, subtree_end, q_ptr, q_cols, q_full,
                               q_order, scale_log2, TQ, TK, q_offset,
                               HQ: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, D1: gl.constexpr,
                               D2: gl.constexpr, DV: gl.constexpr,
                               BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                               HAS_OFFSET: gl.constexpr, CONSUMERS: gl.constexpr, num_warps: gl.constexpr):
    # CONSUMERS = 1: the default partition (num_warps = 8) computes all BM rows; 2: the default partition and a
    # worker of num_warps = 4 warps each take BM / 2 rows, each releasing K/V slots on its own (no partition-wide
    # bar.sync couples the two warpgroups; the warp schedulers interleave one's softmax with the other's wgmma)
    i_h, i_m, i_kvh, start, count, n_full = query_block_program(q_ptr, q_full, q_order, HQ, HKV)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    if D2 > 0:  # the second column tiles of q and K
        q2_smem = gl.allocate_shared_memory(q2_desc.dtype, q2_desc.block_type.shape, q2_desc.layout)
        k2_bufs = gl.allocate_shared_memory(k2_desc.dtype, [STAGES] + k2_desc.block_type.shape, k2_desc.layout)
    else:  # unused (every use sits under D2 > 0)
        q2_smem = q_smem
        k2_bufs = k_bufs
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    k_ready, k_empty = ring_barriers(STAGES, CONSUMERS)
    v_ready, v_empty = ring_barriers(STAGES, CONSUMERS)

    # (the partition lists are spelled out: a jit function cannot be held in a variable)
    if CONSUMERS == 1:
        gl.warp_specialize([
            (_consumer, (q_smem, q2_smem, k_bufs, k2_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, q_cols,
                         subtree_end, o, lse, scale_log2, i_m, i_h, start, n_full, count, TQ, TK, q_offset, HQ, DV, D2,
                         BM, BN, STAGES,
                         HAS_OFFSET, 0, BM, num_warps)),
            (_producer, (q_desc, q2_desc, k_desc, k2_desc, v_desc, q_cols, q_smem, q2_smem, k_bufs, k2_bufs, v_bufs,
                         q_bar, k_ready, k_empty, v_ready, v_empty, i_m * BM, i_h * D, i_kvh * D, i_kvh * DV, start,
                         count, D1, D2, BN, STAGES)),
        ], [1], [PRODUCER_REGS])
    else:
        gl.static_assert(CONSUMERS == 2, "one or two consumer partitions")
        gl.warp_specialize([
            (_consumer, (q_smem, q2_smem, k_bufs, k2_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, q_cols,
                         subtree_end, o, lse, scale_log2, i_m, i_h, start, n_full, count, TQ, TK, q_offset, HQ, DV, D2,
                         BM, BN, STAGES,
                         HAS_OFFSET, 0, BM // 2, num_warps)),
            (_consumer, (q_smem, q2_smem, k_bufs, k2_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, q_cols,
                         subtree_end, o, lse, scale_log2, i_m, i_h, start, n_full, count, TQ, TK, q_offset, HQ, DV, D2,
                         BM, BN, STAGES,
                         HAS_OFFSET, BM // 2, BM // 2, num_warps)),
            (_producer, (q_desc, q2_desc, k_desc, k2_desc, v_desc, q_cols, q_smem, q2_smem, k_bufs, k2_bufs, v_bufs,
                         q_bar, k_ready, k_empty, v_ready, v_empty, i_m * BM, i_h * D, i_kvh * D, i_kvh * DV, start,
                         count, D1, D2, BN, STAGES)),
        ], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])


def gluon_descriptor(t: torch.Tensor, rows: int, cols: int) -> TensorDescriptor:
    """Gluon TMA descriptor of a contiguous [tokens, heads, dim] tensor seen as [tokens, heads * dim], blocks
    rows x cols in the default NVMMA (128-byte swizzled) layout that wgmma reads; rows past the end read 0."""
    if t.data_ptr() % 16:
        t = t.clone()
    flat = t.reshape(t.shape[0], t.shape[1] * t.shape[2])
    layout = gl.NVMMASharedLayout.get_default_for([rows, cols], GL_DTYPES[t.dtype])
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, cols], layout)


HEAD_DIMS = "q/k head dim 64, 128, 192 or 256 and v head dim 64, 128 or 256"  # what `supports` admits, for errors


def column_tiles(head_dim: int) -> tuple[int, int]:
    """(D1, D2): the q/k column tiles, D2 = 0 for a power of two; MLA's 192 is 128 + 64 (Gluon's register
    tensors are powers of two, and 64 bf16 columns are one 128-byte swizzle row of a TMA tile)."""
    return split_head_dim(head_dim)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Shapes these kernels compile for: 16-bit, HEAD_DIMS."""
    d, dv = q.shape[2], v.shape[2]
    return q.dtype in GL_DTYPES and d in (64, 128, 192, 256) and dv in (64, 128, 256)


def qk_descriptors(t: torch.Tensor, rows: int) -> tuple[TensorDescriptor, TensorDescriptor]:
    """The descriptors of q's or k's two column tiles (the first twice when the head dim is one tile)."""
    d1, d2 = column_tiles(t.shape[2])
    first = gluon_descriptor(t, rows, d1)
    return first, (gluon_descriptor(t, rows, d2) if d2 else first)


def tree_attention_forward_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 subtree_end: torch.Tensor, index: BlockIndex, scale: float,
                                 launch: dict | None = None):
    """As ``forward.tree_attention_forward``: o [Tq, HQ, DV] (dtype of q), lse [HQ, Tq] fp32 base 2.
    ``launch``: block_m (128), block_n (64), num_stages (2, the K and V ring depth), consumers (1: one 8-warp
    consumer partition; 2: two 4-warp ones of block_m / 2 rows each); num_warps, if given, must equal
    block_m / (16 * consumers). "heads" packing is not supported here. The index must hold the (block_m, block_n)
    lists."""
    launch = {"block_m": 128, "block_n": 64, "num_stages": 2, "consumers": 1, **(launch or {})}
    warps = launch["block_m"] // (16 * launch["consumers"])  # a consumer's rows: 16 per warp (m64 per warpgroup)
    if launch["consumers"] not in (1, 2) or warps not in (4, 8) or launch.get("num_warps", warps) != warps:
        raise ValueError(f"Gluon forward launch {launch}: block_m / consumers must be 64 or 128 rows "
                         "(num_warps 4 or 8 per consumer partition)")
    if launch.get("heads", 1) != 1:
        raise ValueError("the Gluon forward does not pack query heads (launch heads must be 1)")
    if not supports(q, k, v):
        raise ValueError(f"the Gluon forward takes bf16/fp16 with {HEAD_DIMS}, got {q.dtype}, D={q.shape[2]}, "
                         f"DV={v.shape[2]}")
    n_queries, n_q_heads, head_dim = q.shape
    n_keys, n_kv_heads, value_dim = v.shape
    index = index.with_blocks(launch["block_m"], launch["block_n"])
    bm, bn = index.block_m, index.block_n
    d1, d2 = column_tiles(head_dim)
    o = q.new_empty(n_queries, n_q_heads, value_dim)
    lse = torch.empty(n_q_heads, n_queries, dtype=torch.float32, device=q.device)
    grid = (index.num_query_blocks * n_q_heads,)
    if grid[0]:
        tree_attn_fwd_gluon_kernel[grid](
            *qk_descriptors(q, bm), *qk_descriptors(k, bn), gluon_descriptor(v, bn, value_dim),
            o, lse, subtree_end, index.q_ptr, index.q_cols, index.q_full, index.q_order,
            scale * LOG2E, n_queries, n_keys, n_keys - n_queries,
            HQ=n_q_heads, HKV=n_kv_heads, D=head_dim, D1=d1, D2=d2, DV=value_dim, BM=bm, BN=bn,
            STAGES=launch["num_stages"], HAS_OFFSET=n_keys != n_queries, CONSUMERS=launch["consumers"],
            num_warps=warps, maxnreg=MAXNREG)
    return o, lse
