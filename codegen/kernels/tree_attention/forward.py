"""Triton forward of tree attention: flash-style online softmax over the block visit lists.

One program per (query block, query head); programs are numbered heavy query blocks first
(``q_order``), heads fastest. Each program runs two loops over its visit list: the full key
blocks with no mask, then the partially masked ones with the per-element tree mask
``j <= i < subtree_end[j]`` (which also masks rows/columns past the ends). Softmax runs in base 2
with ``scale * log2(e)`` folded into the scores; the saved ``lse`` is in that base-2 domain.

Key and value blocks come in through tensor descriptors (``token_descriptor``: one TMA copy per tile on
Hopper, rows past ``TK`` read as zeros); q is loaded once per program with pointers.

Queries may be the last ``TQ`` of the ``TK`` key rows (``HAS_OFFSET``): q, o and lse are indexed by
local query rows, the mask by global ones (local + ``q_offset``). ``HAS_OFFSET`` is a compile-time
flag, so the all-tokens case compiles to the same code as without the offset.

Head dims: q/k have ``D = D1 + D2`` (``D2 = 0``, or both powers of two: 192 = 128 + 64 for MLA), v and
o have ``DV``. A q/k head dim that is not a power of two is split into two tiles whose score dots
accumulate into one (``tl.arange`` needs powers of two; padding 192 to 256 would waste a quarter of
the score matmul). With ``D2 = 0`` the second tiles are never touched (their names hold dummies).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .block_index import BlockIndex
from .. import LOG2E
from ..interpreter_safe import interpreting


def split_head_dim(head_dim: int) -> tuple[int, int]:
    """(D1, D2) with D1 + D2 = head_dim, D1 the largest power of two <= head_dim, D2 zero or a power
    of two (ValueError otherwise): the two q/k tiles of the kernels."""
    first = 1 << (head_dim.bit_length() - 1) if head_dim > 0 else 0
    rest = head_dim - first
    if head_dim <= 0 or (rest & (rest - 1)):
        raise ValueError(f"head dim {head_dim} is not a power of two or a sum of two powers of two")
    return first, rest


@triton.jit
def load_key_block(k_desc, k2_desc, v_desc, subtree_end, i_n, i_kvh, TK, D: tl.constexpr, D1: tl.constexpr,
                   D2: tl.constexpr, DV: tl.constexpr, BN: tl.constexpr, MASKED: tl.constexpr):
    """Key block i_n of kv head i_kvh: (key rows, k [BN, D1], k tail [BN, D2] or dummy, v [BN, DV],
    subtree_end [BN]; the descriptors read rows past TK as zeros, whose end is 0 when MASKED, and
    unmasked blocks need no ends)."""
    offs_n = i_n * BN + tl.arange(0, BN)
    b_k = k_desc.load([i_n * BN, i_kvh * D])
    b_v = v_desc.load([i_n * BN, i_kvh * DV])
    if MASKED:
        b_end = tl.load(subtree_end + offs_n, mask=offs_n < TK, other=0)
    else:
        b_end = offs_n  # dummy
    b_k2 = 0.0  # dummy when D2 == 0
    if D2 > 0:
        b_k2 = k2_desc.load([i_n * BN, i_kvh * D + D1])
    return offs_n, b_k, b_k2, b_v, b_end


@triton.jit
def query_rows(q, rows, valid, D1: tl.constexpr, D2: tl.constexpr, MASKED: tl.constexpr):
    """q-like tile at element offsets `rows` [R]: ([R, D1], [R, D2] or dummy); masked by `valid`."""
    offs_d = tl.arange(0, D1)
    if MASKED:
        b_q = tl.load(q + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    else:
        b_q = tl.load(q + rows[:, None] + offs_d[None, :])
    b_q2 = 0.0
    if D2 > 0:
        offs_d2 = D1 + tl.arange(0, D2)
        if MASKED:
            b_q2 = tl.load(q + rows[:, None] + offs_d2[None, :], mask=valid[:, None], other=0.0)
        else:
            b_q2 = tl.load(q + rows[:, None] + offs_d2[None, :])
    return b_q, b_q2


@triton.jit
def scores(b_q, b_q2, b_k, b_k2, D2: tl.constexpr):
    """q k^T [R, BN] in fp32 over both q/k tiles."""
    b_s = tl.dot(b_q, tl.trans(b_k))
    if D2 > 0:
        b_s = tl.dot(b_q2, tl.trans(b_k2), b_s)
    return b_s


@triton.jit
def _attend_block(b_q, b_q2, acc, m_i, l_i, k, k2, v, subtree_end, i_n, rows_g, TK, i_kvh,
                  scale_log2, D: tl.constexpr, D1: tl.constexpr,
                  D2: tl.constexpr, DV: tl.constexpr, BN: tl.constexpr, MASKED: tl.constexpr):
    offs_n, b_k, b_k2, b_v, b_end = load_key_block(k, k2, v, subtree_end, i_n, i_kvh, TK, D, D1, D2, DV,
                                                   BN, MASKED)
    # [BM, BN] scores, base-2 scaled
    b_s = scores(b_q, b_q2, b_k, b_k2, D2) * scale_log2
    if MASKED:
        visible = (offs_n[None, :] <= rows_g[:, None]) & (rows_g[:, None] < b_end[None, :])
        b_s = tl.where(visible, b_s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(b_s, 1))
    b_p = tl.exp2(b_s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(b_p, 1)
    acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
    return acc, m_new, l_i


@triton.jit
def _attend_range(b_q, b_q2, acc, m_i, l_i, k, k2, v, subtree_end, q_cols, lo, hi, rows_g, TK,
                  i_kvh, scale_log2, D: tl.constexpr, D1: tl.constexpr,
                  D2: tl.constexpr, DV: tl.constexpr, BN: tl.constexpr, MASKED: tl.constexpr,
                  INTERPRET: tl.constexpr):
    # visit list entries [lo, hi); see interpreter_safe.py for the while loop
    if INTERPRET:
        idx = lo
        while idx < hi:
            acc, m_i, l_i = _attend_block(b_q, b_q2, acc, m_i, l_i, k, k2, v, subtree_end,
                                          tl.load(q_cols + idx), rows_g, TK, i_kvh, scale_log2,
                                          D, D1, D2, DV, BN, MASKED)
            idx += 1
    else:
        for idx in range(lo, hi):
            acc, m_i, l_i = _attend_block(b_q, b_q2, acc, m_i, l_i, k, k2, v, subtree_end,
                                          tl.load(q_cols + idx), rows_g, TK, i_kvh, scale_log2,
                                          D, D1, D2, DV, BN, MASKED)
    return acc, m_i, l_i


@triton.jit
def tree_attn_fwd_kernel(q, k, k2, v, o, lse, subtree_end, q_ptr, q_cols, q_full, q_order,
                         scale_log2, TQ, TK, q_offset,
                         HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, D1: tl.constexpr,
                         D2: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         PACK: tl.constexpr, HAS_OFFSET: tl.constexpr, INTERPRET: tl.constexpr):
    # PACK query heads of one KV head share a program: its BM score rows are BM // PACK query tokens of each
    # of them (head-major), so every loaded key block serves PACK heads (the mask is the same for all heads)
    pid = tl.program_id(0)
    i_hp = pid % (HQ // PACK)
    i_m = tl.load(q_order + pid // (HQ // PACK))
    i_kvh = (i_hp * PACK) // (HQ // HKV)
    offs_r = tl.arange(0, BM)
    if PACK == 1:
        offs_m = i_m * BM + offs_r  # local query rows
        heads = i_hp
    else:
        offs_m = i_m * (BM // PACK) + offs_r % (BM // PACK)  # BM // PACK query tokens per program
        heads = i_hp * PACK + offs_r // (BM // PACK)
    rows_g = offs_m  # global rows, for the mask
    if HAS_OFFSET:
        rows_g = offs_m + q_offset
    offs_dv = tl.arange(0, DV)
    m_valid = offs_m < TQ
    # [BM, D1] (+ [BM, D2])
    b_q, b_q2 = query_rows(q, offs_m.to(tl.int64) * (HQ * D) + heads * D, m_valid, D1, D2, True)
    acc = tl.zeros([BM, DV], dtype=tl.float32)
    # finite "minus infinity" for the running max: a row whose first visited block masks all of
    # its keys must give exp2(-inf - m) = 0, not exp2(-inf - (-inf)) = nan
    m_i = tl.full([BM], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    start = tl.load(q_ptr + i_m)
    stop = tl.load(q_ptr + i_m + 1)
    full_stop = start + tl.load(q_full + i_m)
    acc, m_i, l_i = _attend_range(b_q, b_q2, acc, m_i, l_i, k, k2, v, subtree_end, q_cols, start,
                                  full_stop, rows_g, TK, i_kvh, scale_log2, D, D1, D2, DV, BN,
                                  False, INTERPRET)
    acc, m_i, l_i = _attend_range(b_q, b_q2, acc, m_i, l_i, k, k2, v, subtree_end, q_cols, full_stop,
                                  stop, rows_g, TK, i_kvh, scale_log2, D, D1, D2, DV, BN,
                                  True, INTERPRET)
    # rows past TQ saw nothing (l_i = 0); keep them finite, they are not stored
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    b_o = acc / l_safe[:, None]
    rows_o = offs_m.to(tl.int64) * (HQ * DV) + heads * DV
    tl.store(o + rows_o[:, None] + offs_dv[None, :], b_o.to(o.dtype.element_ty),
             mask=m_valid[:, None])
    tl.store(lse + heads.to(tl.int64) * TQ + offs_m, m_i + tl.log2(l_safe), mask=m_valid)


def forward_packing(q: torch.Tensor, k: torch.Tensor, launch: dict) -> tuple[int, int]:
    """(query heads per program, query tokens per program) of a forward `launch`: its "heads" (default 1) when
    they divide the GQA group, else 1 head of block_m * heads tokens, so a program keeps its score rows."""
    pack, group = launch.get("heads", 1), q.shape[1] // k.shape[1]  # a power of two (KernelConfig checks)
    return (pack, launch["block_m"]) if group % pack == 0 else (1, launch["block_m"] * pack)


def token_descriptor(t: torch.Tensor, rows: int, cols: int) -> TensorDescriptor:
    """Tensor descriptor of a contiguous [tokens, heads, dim] tensor seen as [tokens, heads * dim], in blocks of
    rows x cols: on Hopper one bulk (TMA) copy into shared memory per block, without staging in registers or
    per-thread addresses; rows past the end read as zeros. (Descriptors need a 16-byte aligned base.)"""
    if t.data_ptr() % 16:
        t = t.clone()
    flat = t.view(t.shape[0], t.shape[1] * t.shape[2])
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, cols])


def head_descriptors(x: torch.Tensor, rows: int) -> tuple:
    """(first tile, second tile) descriptors of x's head dim split as split_head_dim does; the second is the
    first again where the head dim is one tile (the kernels then never read it)."""
    first, rest = split_head_dim(x.shape[2])
    return token_descriptor(x, rows, first), token_descriptor(x, rows, rest or first)


def head_dims(q: torch.Tensor, v: torch.Tensor) -> dict:
    """The head-dim constexprs of the kernels: D (q/k), its tiles D1 + D2, DV (v/o)."""
    first, rest = split_head_dim(q.shape[2])
    return dict(D=q.shape[2], D1=first, D2=rest, DV=v.shape[2])


def tree_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           subtree_end: torch.Tensor, index: BlockIndex, scale: float,
                           launch: dict):
    """Returns o [Tq, HQ, Dv] (dtype of q) and lse [HQ, Tq] fp32 (base 2, scaled scores); q [Tq]
    are the last Tq of the Tk = len(k) tokens. ``launch``: block_m (query tokens), block_n, num_warps, num_stages
    and optionally heads (query heads of one KV head per program, default 1: block_m * heads score rows)."""
    n_queries, n_q_heads, _ = q.shape
    n_keys = k.shape[0]
    pack, block_m = forward_packing(q, k, launch)
    index = index.with_blocks(block_m, launch["block_n"])
    o = q.new_empty(n_queries, n_q_heads, v.shape[2])
    lse = torch.empty(n_q_heads, n_queries, dtype=torch.float32, device=q.device)
    grid = (index.num_query_blocks * (n_q_heads // pack),)
    if grid[0]:
        tree_attn_fwd_kernel[grid](
            q, *head_descriptors(k, index.block_n), token_descriptor(v, index.block_n, v.shape[2]), o, lse,
            subtree_end, index.q_ptr, index.q_cols, index.q_full, index.q_order,
            scale * LOG2E, n_queries, n_keys, n_keys - n_queries, HQ=n_q_heads, HKV=k.shape[1],
            **head_dims(q, v), BM=index.block_m * pack, BN=index.block_n, PACK=pack,
            HAS_OFFSET=n_keys != n_queries, INTERPRET=interpreting(),
            num_warps=launch["num_warps"], num_stages=launch["num_stages"])
    return o, lse
