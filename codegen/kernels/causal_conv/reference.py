"""Plain-torch tree-aware short causal conv (docs/INTERFACES.md section 4, `causal_conv`): the oracle.

Token i of a trajectory-wise depthwise causal conv1d (left zero padding) reads the W-1 tokens before
it on its own path; in the compact layout those are `conv_pred[i]` (oldest first, -1 before position 0).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def check_conv_inputs(parts, weight: torch.Tensor, conv_pred: torch.Tensor, activation, tail=None,
                      appended=None) -> None:
    """`parts`: the input's column parts [T, Ch_i]; `tail` [C, Ch] carried rows; `appended`: per part [R, Ch_i] or
    None."""
    if isinstance(parts, torch.Tensor):
        parts = [parts]
    if not parts or any(x.dim() != 2 or x.shape[0] != parts[0].shape[0] for x in parts):
        raise ValueError(f"tree_causal_conv: `x` has shapes {[tuple(x.shape) for x in parts]}, expected [T, Ch] "
                         "parts of one T")
    channels = sum(x.shape[1] for x in parts)
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise ValueError(f"tree_causal_conv: `weight` has shape {tuple(weight.shape)}, expected [{channels}, W]")
    width = weight.shape[1]
    carried = 0 if tail is None else tail.shape[0]
    if tail is not None and (tail.dim() != 2 or tail.shape[1] != channels):
        raise ValueError(f"tree_causal_conv: `tail` has shape {tuple(tail.shape)}, expected [C, {channels}]")
    if conv_pred.shape != (parts[0].shape[0] + carried, width - 1):
        raise ValueError(f"tree_causal_conv: `conv_pred` has shape {tuple(conv_pred.shape)}, expected "
                         f"{(parts[0].shape[0] + carried, width - 1)} for conv width {width}")
    for x, extra in zip(parts, appended or [None] * len(parts)):
        if extra is not None and (extra.dim() != 2 or extra.shape[1] != x.shape[1]):
            raise ValueError(f"tree_causal_conv: appended rows of shape {tuple(extra.shape)} for a part of "
                             f"{x.shape[1]} columns")
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


def tree_causal_conv_parts_reference(parts, weight: torch.Tensor, conv_pred: torch.Tensor, activation, tail=None,
                                     appended=None) -> list[torch.Tensor]:
    """The kernel's contract with column parts (function.tree_causal_conv): the reference over the parts side by
    side with the carried rows after them, the carried rows' outputs dropped, the appended rows added."""
    rows = parts[0].shape[0]
    x = torch.cat([torch.cat(list(parts), dim=1)] + ([tail.to(parts[0].dtype)] if tail is not None else []))
    y = tree_causal_conv_reference(x, weight, conv_pred, activation)[:rows]
    outs = list(torch.split(y, [p.shape[1] for p in parts], dim=1))
    appended = appended or [None] * len(parts)
    return [out if extra is None else torch.cat([out, extra.to(out.dtype)]) for out, extra in zip(outs, appended)]
