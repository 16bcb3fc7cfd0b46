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
from harts_compiler.codegen.kernels.causal_conv import tree_causal_conv_reference


def tree_causal_conv(x: torch.Tensor, weight: torch.Tensor, plan: LaunchPlan,
                     activation: str | None = "silu", carry=None) -> torch.Tensor:
    """x [T, Ch], weight [Ch, W] -> y [T, Ch] (dtype of weight, like F.conv1d). `carry`: the layer's
    `ops.carry.LayerCarry` in a piece (carried conv inputs after the own rows; their outputs are dropped)."""
    T = x.shape[0]
    if carry is not None:
        x = carry.conv_inputs(x)
    if plan.target.conv_triton:
        y = conv_kernel(x, weight, plan.conv_pred, activation, index=plan.conv)
    else:
        y = tree_causal_conv_reference(x, weight, plan.conv_pred, activation)
    return y if carry is None else y[:T]
