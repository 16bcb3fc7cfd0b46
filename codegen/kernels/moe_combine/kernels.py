"""Triton MoE output combination: one program per token, forward and backward, in place of torch's chain
(weight multiply, index_copy back to token order, slot sum, shared-expert gate multiply and add: each a pass over
a [T*k, H] or [T, H] bf16 tensor, and about twice as many backward).

Forward: y_t = sum_j w_tj hidden[pos_tj] (+ shared term) accumulated in fp32 in slot order, rounded once.
Unweighted, the same pass is the backward of the dispatch (x_t copied to its k sorted rows): dx_t = sum_j
g[pos_tj], a gather in slot order instead of torch's sort-based scatter-add.
Backward: d hidden[pos_tj] = w_tj dy_t (each sorted row has exactly one (token, slot), so every row is written
once: no atomics), d w_tj = dy_t . hidden[pos_tj], d shared_t = g_t dy_t and d logit_t = g_t (1 - g_t)
dy_t . shared_t with g_t = sigmoid(logit_t) (g = 1 for "add"). Every token runs the same arithmetic wherever
it sits in a microbatch, so tree and trajectory rows agree bitwise.
"""
from __future__ import annotations

import triton
import triton.language as tl

# shared modes (reference.SHARED_MODES order); constexpr globals, the only globals a compiled kernel may read
NONE, ADD, SIGMOID_GATE = (tl.constexpr(i) for i in range(3))


def launch(hidden_dim: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps): the whole row in one block up to 2,048 columns (8 a thread at 8 warps; the
    backward's k row dots then need no loop), else 1,024-column blocks (Kimi's 2,304 pads to 3,072, not 4,096)."""
    block_h = triton.next_power_of_2(hidden_dim)
    if block_h > 2048:
        block_h = 1024
    return block_h, 8 if block_h >= 2048 else 4


@triton.jit
def _combine_fwd_kernel(HIDDEN, POS, W, SHARED, LOGIT, Y, hidden_dim, TOP_K: tl.constexpr, MODE: tl.constexpr,
                        BLOCK_H: tl.constexpr, WEIGHTED: tl.constexpr = True):
    t = tl.program_id(0).to(tl.int64)
    if MODE == SIGMOID_GATE:
        gate = tl.sigmoid(tl.load(LOGIT + t).to(tl.float32))
    for h0 in range(0, hidden_dim, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        mask = offs < hidden_dim
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            row = tl.load(POS + t * TOP_K + j).to(tl.int64)
            h = tl.load(HIDDEN + row * hidden_dim + offs, mask=mask, other=0.0).to(tl.float32)
            if WEIGHTED:
                acc += tl.load(W + t * TOP_K + j).to(tl.float32) * h
            else:  # the dispatch's backward: a plain sum of the token's slot rows
                acc += h
        if MODE == ADD:
            acc += tl.load(SHARED + t * hidden_dim + offs, mask=mask, other=0.0).to(tl.float32)
        elif MODE == SIGMOID_GATE:
            acc += gate * tl.load(SHARED + t * hidden_dim + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + t * hidden_dim + offs, acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _combine_bwd_kernel(DY, HIDDEN, POS, W, SHARED, LOGIT, DHIDDEN, DW, DSHARED, DLOGIT, hidden_dim,
                        TOP_K: tl.constexpr, K_PAD: tl.constexpr, MODE: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, K_PAD)
    dw = tl.zeros([K_PAD], dtype=tl.float32)
    shared_dot = tl.zeros([BLOCK_H], dtype=tl.float32)
    if MODE == SIGMOID_GATE:
        gate = tl.sigmoid(tl.load(LOGIT + t).to(tl.float32))
    for h0 in range(0, hidden_dim, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        mask = offs < hidden_dim
        dy = tl.load(DY + t * hidden_dim + offs, mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(TOP_K):
            row = tl.load(POS + t * TOP_K + j).to(tl.int64)
            w = tl.load(W + t * TOP_K + j).to(tl.float32)
            h = tl.load(HIDDEN + row * hidden_dim + offs, mask=mask, other=0.0).to(tl.float32)
            dw = tl.where(offs_k == j, dw + tl.sum(dy * h), dw)
            tl.store(DHIDDEN + row * hidden_dim + offs, (w * dy).to(DHIDDEN.dtype.element_ty), mask=mask)
        if MODE == ADD:
            tl.store(DSHARED + t * hidden_dim + offs, dy.to(DSHARED.dtype.element_ty), mask=mask)
        elif MODE == SIGMOID_GATE:
            s = tl.load(SHARED + t * hidden_dim + offs, mask=mask, other=0.0).to(tl.float32)
            shared_dot += dy * s
            tl.store(DSHARED + t * hidden_dim + offs, (gate * dy).to(DSHARED.dtype.element_ty), mask=mask)
    tl.store(DW + t * TOP_K + offs_k, dw.to(DW.dtype.element_ty), mask=offs_k < TOP_K)
    if MODE == SIGMOID_GATE:
        tl.store(DLOGIT + t, (gate * (1.0 - gate) * tl.sum(shared_dot)).to(DLOGIT.dtype.element_ty))
