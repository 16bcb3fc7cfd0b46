"""Plain-torch tree-aware short causal conv (docs/INTERFACES.md section 4, `causal_conv`): the oracle.

Token i of a trajectory-wise depthwise causal conv1d (left zero padding) reads the W-1 tokens before
it on its own path; in the compact layout those are `conv_pred[i]` (oldest first, -1 before position 0).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def check_conv_inputs(x: torch.Tensor, weight: torch.Tensor, conv_pred: torch.Tensor, activation) -> None:
    if x.dim() != 2:
        raise ValueError(f"tree_causal_conv: `x` has shape {tuple(x.shape)}, expected [T, Ch]")
    if weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"tree_causal_conv: `weight` has shape {tuple(weight.shape)}, expected [{x.shape[1]}, W]")
    width = weight.shape[1]
    if conv_pred.shape != (x.shape[0], width - 1):
        raise ValueError(f"tree_causal_conv: `conv_pred` has shape {tuple(conv_pred.shape)}, expected "
                         f"{(x.shape[0], width - 1)} for conv width {width}")
    if activation not in (None, "silu"):
        raise ValueError(f"tree_causal_conv: unsupported `activation` {activation!r} (None or 'silu')")


def tree_causal_conv_reference(x: torch.Tensor, weight: torch.Tensor, conv_pred: torch.Tensor,
                               activation: str | None = "silu") -> torch.Tensor:
    """x [T, Ch], weight [Ch, W], conv_pred [T, W-1] -> y [T, Ch] (dtype of weight, like F.conv1d).

    y[i] = act(sum_j weight[:, j] * x[conv_pred[i, j]] (0 where -1) + weight[:, W-1] * x[i]).
    """
    check_conv_inputs(x, weight, conv_pred, activation)
    width = weight.shape[1]
    x = x.to(weight.dtype)
    padded = torch.cat([x.new_zeros((1, x.shape[1])), x], dim=0)  # row 0 stands for "before position 0"
    taps = padded[conv_pred.long() + 1]  # [T, W-1, Ch]
    # taps summed oldest first with element-wise adds only: a reduction kernel may order its sums
    # by tensor shape (seen on the GPU host's CPU), which would break tree == trajectory bitwise
    y = x.new_zeros(x.shape)
    for j in range(width - 1):
        y = y + taps[:, j] * weight[:, j]
    y = y + x * weight[:, width - 1]
    return F.silu(y) if activation == "silu" else y
