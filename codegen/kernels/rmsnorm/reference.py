"""Plain-torch RMS norms of the supported models, one function per rounding recipe (the oracle of the kernels).

Every norm computes x_hat = x * rsqrt(mean(x^2) + eps) in `compute_dtype` (fp32 for 16-bit inputs, fp64 for
fp64), as transformers does, and differs in where it scales and rounds; `MODES` names them:

- "offset"        Qwen3-Next / Qwen3.5 RMSNorm:      (x_hat * (1 + w)) -> dtype
- "scale"         Kimi RMSNorm:                      w * (x_hat -> dtype)
- "gated_silu"    Qwen3-Next gated RMSNorm:          ((w * (x_hat -> dtype)) * silu(gate)) -> dtype
- "gated_sigmoid" Kimi gated RMSNorm:                (w * x_hat * sigmoid(gate)) -> dtype

(`a -> dtype` rounds to the input dtype; a product of two tensors of the input dtype is rounded to it, as torch
does.) These are the runtime's norms on every path the Triton kernels do not take.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

MODES = ("offset", "scale", "gated_silu", "gated_sigmoid")
GATED = ("gated_silu", "gated_sigmoid")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for low-precision dtypes, float64 for float64 (never narrower than the input)."""
    return torch.promote_types(dtype, torch.float32)


def rms_normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, computed (and returned) in `compute_dtype`: the core of every norm here."""
    h = x.to(compute_dtype(x.dtype))
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, mode: str,
                       gate: torch.Tensor | None = None) -> torch.Tensor:
    """The norm of `mode` over the last dim of x (weight [D]; gate like x for the gated modes)."""
    if mode not in MODES:
        raise ValueError(f"rms norm mode {mode!r}: one of {MODES}")
    if (gate is not None) != (mode in GATED):
        raise ValueError(f"rms norm mode {mode!r} {'needs' if mode in GATED else 'takes no'} gate")
    dtype = x.dtype
    h = rms_normalised(x, eps)
    if mode == "offset":
        return (h * (1.0 + weight.to(h.dtype))).type_as(x)
    if mode == "scale":
        return weight * h.to(dtype)
    if mode == "gated_silu":
        h = weight * h.to(dtype)
        return (h * F.silu(gate.to(compute_dtype(dtype)))).to(dtype)
    wide = compute_dtype(dtype)
    return (weight.to(wide) * h * torch.sigmoid(gate.to(wide))).to(dtype)
