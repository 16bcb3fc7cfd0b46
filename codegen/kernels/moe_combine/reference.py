"""Plain-torch MoE output combination (the oracle of the kernels, and the path every non-16-bit-CUDA run takes).

y_t = sum_j w_tj hidden[position_tj] + shared term, with the shared term one of `SHARED_MODES`:

- "none"           no shared expert (the routed sum alone)
- "add"            Kimi's shared experts:             + shared_t
- "sigmoid_gate"   Qwen3-Next's gated shared expert:  + sigmoid(logit_t) shared_t

hidden [T*k, H] holds the expert outputs sorted by expert, position [T, k] the sorted row of each (token, slot),
weight [T, k] the routing weights. Everything is computed in `compute_dtype` (fp32 for 16-bit inputs) and rounded
to the input dtype once at the end; transformers rounds each weighted expert output and each partial sum to
bf16, which is further from the float64 result.
"""
from __future__ import annotations

import torch

from ..rmsnorm.reference import compute_dtype

SHARED_MODES = ("none", "add", "sigmoid_gate")


def shared_mode(shared: torch.Tensor | None, shared_logit: torch.Tensor | None) -> str:
    """The `SHARED_MODES` entry of these arguments (a gate logit needs a shared output)."""
    if shared is None:
        if shared_logit is not None:
            raise ValueError("moe combine: shared_logit given without shared")
        return "none"
    return "add" if shared_logit is None else "sigmoid_gate"


def moe_combine_reference(hidden: torch.Tensor, position: torch.Tensor, weight: torch.Tensor,
                          shared: torch.Tensor | None = None, shared_logit: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H]: the routing-weighted sum of each token's k expert outputs plus the shared term (module docstring)."""
    mode = shared_mode(shared, shared_logit)
    wide = compute_dtype(hidden.dtype)
    # the k slots summed in slot order, in the wide dtype
    y = (hidden[position].to(wide) * weight.to(wide)[..., None]).sum(1)
    if mode == "add":
        y = y + shared.to(wide)
    elif mode == "sigmoid_gate":
        y = y + torch.sigmoid(shared_logit.to(wide)) * shared.to(wide)
    return y.to(hidden.dtype)
