"""Tree-aware short causal conv (docs/INTERFACES.md section 4, `causal_conv`) over a launch plan.

Token i of a trajectory-wise depthwise causal conv1d (left zero padding) reads the W-1 tokens before it on its
own path; in the compact layout those are `conv_pred[i]` (oldest first, -1 before position 0), so gathering
them reproduces exactly the products of the trajectory-wise conv. The plan's target says whether the Triton
kernel (with the plan's successor lists) or the plain-torch reference runs it.
"""
from __future__ import annotations

import torch

from harts_compiler.codegen import LaunchPlan
from harts_compiler.codegen.kernels.causal_conv import tree_causal_conv as conv_kernel
from harts_compiler.codegen.kernels.causal_conv import tree_causal_conv_parts_reference


def tree_causal_conv(parts, weight: torch.Tensor, plan: LaunchPlan, activation: str | None = "silu",
                     carry=None) -> tuple[torch.Tensor, ...]:
    """Column parts [T, Ch_i] of the conv input (e.g. q, k, v; strided rows read in place), weight [sum Ch_i, W] ->
    the parts' outputs, each contiguous (dtype of weight, like F.conv1d). `carry`: the layer's
    `ops.carry.LayerCarry` in a piece: the carried conv inputs are read after the own rows and the carried
    replay rows are appended to the outputs, [T + R, Ch_i] (what the rounds read after the own rows)."""
    parts, tail, appended = carry.conv_rows(parts) if carry is not None else (parts, None, None)
    if plan.target.conv_triton:
        return conv_kernel(list(parts), weight, plan.conv_pred, activation, index=plan.conv, tail=tail,
                           appended=appended)
    return tuple(tree_causal_conv_parts_reference(list(parts), weight, plan.conv_pred, activation, tail, appended))
