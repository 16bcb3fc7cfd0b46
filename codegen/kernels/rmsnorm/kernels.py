"""Triton RMS norms: one pass over each row forward, one backward, in place of torch's chain of fp32 elementwise
kernels (each norm of a [T, D] bf16 tensor otherwise reads and writes fp32 copies of it about ten times).

Forward, per block of ROWS rows: x_hat = x * rsqrt(mean(x^2) + eps) in fp32, then the mode's scaling and
roundings exactly as `reference.rms_norm_reference` orders them; rstd [rows] fp32 is kept for the backward.
Backward: the mode's d(x_hat) (and d(gate)), then dx = rstd (dx_hat - x_hat mean(dx_hat x_hat)); the weight's
gradient as one fp32 partial sum per program over the row blocks it walks (programs stride over the row
blocks, so there are at most MAX_PROGRAMS partials), summed by the caller in a fixed order: no atomics.
Every row runs the same arithmetic wherever it sits in a microbatch, so tree and trajectory rows agree bitwise.
"""
from __future__ import annotations

import triton
import triton.language as tl

# modes (reference.MODES order); constexpr globals, the only globals a compiled kernel may read
OFFSET, SCALE, GATED_SILU, GATED_SIGMOID = (tl.constexpr(i) for i in range(4))
MAX_PROGRAMS = 1024  # bounds the backward's [programs, D] fp32 weight-gradient partials


def launch(n_rows: int, dim: int) -> tuple[int, int, int]:
    """(BLOCK_D, ROWS, num_warps): about 2k elements a program (the row padded to a power of two for tl.arange),
    8 to 16 a thread: at 8k elements (64 a thread at 4 warps) the gated backward spilled 3.9 KB (offline sm_90
    compile, bench/gdn_resources.py's tool)."""
    block_d = triton.next_power_of_2(dim)
    rows = max(1, 2048 // block_d)
    return block_d, rows, 8 if block_d >= 2048 else 4


@triton.jit
def _load_rows(X, offs_r, offs_d, n_rows, dim):
    mask = (offs_r[:, None] < n_rows) & (offs_d[None, :] < dim)
    return tl.load(X + offs_r[:, None].to(tl.int64) * dim + offs_d[None, :], mask=mask, other=0.0), mask


@triton.jit
def _load_gate(G, offs_r, offs_d, n_rows, dim, g_per, g_stride):
    """Gate rows in place: row r at (r // g_per) * g_stride + (r % g_per) * dim (a column slice of a wider
    projection, g_per rows of dim per projection row)."""
    mask = (offs_r[:, None] < n_rows) & (offs_d[None, :] < dim)
    outer = (offs_r // g_per).to(tl.int64) * g_stride + (offs_r % g_per).to(tl.int64) * dim
    return tl.load(G + outer[:, None] + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _rms_norm_fwd_kernel(X, W, G, Y, RSTD, n_rows, dim, eps, g_per, g_stride, MODE: tl.constexpr,
                         BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    offs_r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    x, mask = _load_rows(X, offs_r, offs_d, n_rows, dim)
    dt = x.dtype
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, 1) / dim + eps)
    x_hat = xf * rstd[:, None]
    w = tl.load(W + offs_d, mask=offs_d < dim, other=0.0).to(tl.float32)[None, :]
    if MODE == OFFSET:
        y = x_hat * (1.0 + w)
    elif MODE == SCALE:
        y = w * x_hat.to(dt).to(tl.float32)
    else:
        g = _load_gate(G, offs_r, offs_d, n_rows, dim, g_per, g_stride).to(tl.float32)
        sig = tl.sigmoid(g)
        if MODE == GATED_SILU:
            y = (w * x_hat.to(dt).to(tl.float32)).to(dt).to(tl.float32) * (g * sig)
        else:
            y = w * x_hat * sig
    tl.store(Y + offs_r[:, None].to(tl.int64) * dim + offs_d[None, :], y.to(dt), mask=mask)
    tl.store(RSTD + offs_r, rstd, mask=offs_r < n_rows)


@triton.jit
def _rms_norm_bwd_kernel(X, W, G, DY, RSTD, DX, DG, DW_PART, n_rows, dim, g_per, g_stride, MODE: tl.constexpr,
                         BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    w = tl.load(W + offs_d, mask=offs_d < dim, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for block in range(pid, tl.cdiv(n_rows, ROWS), tl.num_programs(0)):
        offs_r = block * ROWS + tl.arange(0, ROWS)
        x, mask = _load_rows(X, offs_r, offs_d, n_rows, dim)
        dt = x.dtype
        dy = _load_rows(DY, offs_r, offs_d, n_rows, dim)[0].to(tl.float32)
        rstd = tl.load(RSTD + offs_r, mask=offs_r < n_rows, other=0.0)
        x_hat = x.to(tl.float32) * rstd[:, None]
        if MODE == OFFSET:
            d_hat = dy * (1.0 + w)
            dw += tl.sum(dy * x_hat, 0)
        elif MODE == SCALE:
            d_hat = dy * w
            dw += tl.sum(dy * x_hat.to(dt).to(tl.float32), 0)
        else:
            g = _load_gate(G, offs_r, offs_d, n_rows, dim, g_per, g_stride).to(tl.float32)
            sig = tl.sigmoid(g)
            if MODE == GATED_SILU:
                r = x_hat.to(dt).to(tl.float32)
                h = (w * r).to(dt).to(tl.float32)
                dh = dy * (g * sig)
                dg = dy * h * (sig * (1.0 + g * (1.0 - sig)))
                d_hat = dh * w
                dw += tl.sum(dh * r, 0)
            else:
                d_hat = dy * w * sig
                dg = dy * w * x_hat * (sig * (1.0 - sig))
                dw += tl.sum(dy * x_hat * sig, 0)
            tl.store(DG + offs_r[:, None].to(tl.int64) * dim + offs_d[None, :], dg.to(dt), mask=mask)
        dx = rstd[:, None] * (d_hat - x_hat * (tl.sum(d_hat * x_hat, 1) / dim)[:, None])
        tl.store(DX + offs_r[:, None].to(tl.int64) * dim + offs_d[None, :], dx.to(dt), mask=mask)
    tl.store(DW_PART + pid * BLOCK_D + offs_d, dw)
