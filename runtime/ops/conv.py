"""Tree-aware short causal conv (docs/INTERFACES.md section 4, `causal_conv`).

Token i of a trajectory-wise depthwise causal conv1d (left zero padding) reads the W-1 tokens
before it on its own path; in the compact layout those are `conv_pred[i]` (oldest first, -1 before
position 0). Gathering them reproduces exactly the products of the trajectory-wise conv.

The kernel package `harts_compiler.codegen.kernels.causal_conv` provides `tree_causal_conv` on the
GPU; until (and wherever) it is not available, the plain torch gather below is used.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # the Triton kernel (issue of the kernel engineers); same signature as below
    from harts_compiler.codegen.kernels.causal_conv import tree_causal_conv as _kernel_tree_causal_conv
except ImportError:  # not written yet: plain torch everywhere
    _kernel_tree_causal_conv = None


def tree_causal_conv_torch(x: torch.Tensor, weight: torch.Tensor, conv_pred: torch.Tensor,
                           activation: str | None = "silu") -> torch.Tensor:
    """x [T, Ch], weight [Ch, W], conv_pred [T, W-1] -> y [T, Ch] (dtype of weight, like F.conv1d).

    y[i] = act(sum_j weight[:, j] * x[conv_pred[i, j]] (0 where -1) + weight[:, W-1] * x[i]).
    """
    width = weight.shape[1]
    if conv_pred.shape != (x.shape[0], width - 1):
        raise ValueError(f"tree_causal_conv: conv_pred has shape {tuple(conv_pred.shape)}, expected "
                         f"{(x.shape[0], width - 1)} for conv width {width}")
    x = x.to(weight.dtype)
    # Row 0 of the padded input is the zero that stands for "before position 0".
    padded = torch.cat([x.new_zeros((1, x.shape[1])), x], dim=0)
    taps = padded[conv_pred + 1]  # [T, W-1, Ch]
    y = (taps * weight[:, : width - 1].t()[None]).sum(dim=1) + x * weight[:, width - 1]
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"tree_causal_conv: unsupported activation {activation!r}")
    return y


def tree_causal_conv(x: torch.Tensor, weight: torch.Tensor, conv_pred: torch.Tensor,
                     activation: str | None = "silu") -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA when it exists, the torch gather otherwise."""
    if _kernel_tree_causal_conv is not None and x.is_cuda:
        return _kernel_tree_causal_conv(x, weight, conv_pred, activation=activation)
    return tree_causal_conv_torch(x, weight, conv_pred, activation)
