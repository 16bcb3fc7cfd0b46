"""`rms_norm`: the Triton kernels for 16-bit CUDA tensors, the plain-torch reference everywhere else."""
from __future__ import annotations

import torch
import triton

from .kernels import MAX_PROGRAMS, _rms_norm_bwd_kernel, _rms_norm_fwd_kernel, launch
from .reference import GATED, MODES, rms_norm_reference


def triton_supports(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None = None) -> bool:
    """16-bit x, weight (and gate) of one dtype, on CUDA. fp32 and fp64 runs keep the reference, whose arithmetic
    transformers' checkpoints are checked against on the CPU; the interpreter (which rounds 16-bit stores by
    truncation, `interpreter_safe`) runs the kernels only when a test calls `RMSNormFunction` itself."""
    same = weight.dtype == x.dtype and (gate is None or gate.dtype == x.dtype)
    return x.is_cuda and same and x.dtype in (torch.bfloat16, torch.float16)


def _gate_rows(gate: torch.Tensor, dim: int) -> tuple[torch.Tensor, int, int]:
    """(tensor, rows of `dim` per outer row, outer row stride): the kernels read the gate's rows in place where its
    rows are contiguous within each index of dim 0 (GDN's z, a column slice of the projection), else a copy."""
    try:
        outer = gate.view(gate.shape[0], -1)
    except RuntimeError:
        outer = gate.reshape(gate.shape[0], -1).contiguous()
    if outer.stride(1) != 1 and outer.shape[1] > 1:
        outer = outer.contiguous()
    return outer, outer.shape[1] // dim, outer.stride(0)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, gate, eps: float, mode: str):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        g2, g_per, g_stride = _gate_rows(gate, shape[-1]) if gate is not None else (x2, 1, shape[-1])
        n_rows, dim = x2.shape
        y = torch.empty_like(x2)
        rstd = torch.empty(n_rows, device=x.device, dtype=torch.float32)
        block_d, rows, warps = launch(n_rows, dim)
        if n_rows:
            _rms_norm_fwd_kernel[(triton.cdiv(n_rows, rows),)](
                x2, weight, g2, y, rstd, n_rows, dim, eps, g_per, g_stride, MODE=MODES.index(mode), BLOCK_D=block_d,
                ROWS=rows, num_warps=warps)
        ctx.save_for_backward(x2, weight, g2 if gate is not None else None, rstd)
        ctx.mode, ctx.shape, ctx.gate = mode, shape, (g_per, g_stride, gate.shape if gate is not None else None)
        return y.reshape(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, g2, rstd = ctx.saved_tensors
        n_rows, dim = x2.shape
        dy2 = dy.reshape(n_rows, dim).contiguous()
        dx = torch.empty_like(x2)
        dg = torch.empty_like(x2) if g2 is not None else dx  # contiguous [rows, dim] whatever the gate's layout
        block_d, rows, warps = launch(n_rows, dim)
        programs = max(1, min(MAX_PROGRAMS, triton.cdiv(n_rows, rows)))
        dw_part = torch.empty(programs, block_d, device=x2.device, dtype=torch.float32)
        if n_rows:
            _rms_norm_bwd_kernel[(programs,)](
                x2, weight, g2 if g2 is not None else x2, dy2, rstd, dx, dg, dw_part, n_rows, dim, *ctx.gate[:2],
                MODE=MODES.index(ctx.mode), BLOCK_D=block_d, ROWS=rows, num_warps=warps)
        else:
            dw_part.zero_()
        dw = dw_part[:, :dim].sum(0).to(weight.dtype)  # a fixed order over the programs' partials
        dgate = dg.reshape(ctx.gate[2]) if g2 is not None else None
        return dx.reshape(ctx.shape), dw, dgate, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, mode: str,
             gate: torch.Tensor | None = None) -> torch.Tensor:
    """The RMS norm of `mode` (`reference.MODES`) over the last dim of x: the Triton kernels where
    `triton_supports` admits the inputs, `rms_norm_reference` otherwise."""
    if mode in MODES and (gate is not None) == (mode in GATED) and triton_supports(x, weight, gate):
        return RMSNormFunction.apply(x, weight, gate, eps, mode)
    return rms_norm_reference(x, weight, eps, mode, gate)  # which also raises on a bad mode or gate
