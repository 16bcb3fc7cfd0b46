"""Tree-aware short causal conv dispatch (docs/INTERFACES.md section 4, `causal_conv`).

Token i of a trajectory-wise depthwise causal conv1d (left zero padding) reads the W-1 tokens
before it on its own path; in the compact layout those are `conv_pred[i]` (oldest first, -1 before
position 0), so gathering them reproduces exactly the products of the trajectory-wise conv.

CUDA runs (when opted in) the Triton kernel of `codegen.kernels.causal_conv` with a launch index prepared once per
microbatch (shared by every GDN layer through `conv_cache`); CPU and fp64 run its plain torch
reference (never Triton's interpreter, which is for kernel tests).
"""
from __future__ import annotations

import torch

from harts_compiler.codegen.kernels.causal_conv import (prepare_conv_index, tree_causal_conv as _kernel,
                                                        tree_causal_conv_reference)


def tree_causal_conv(x: torch.Tensor, weight: torch.Tensor, conv_pred: torch.Tensor,
                     activation: str | None = "silu", *, conv_cache: dict | None = None,
                     use_triton: bool = True) -> torch.Tensor:
    """x [T, Ch], weight [Ch, W], conv_pred [T, W-1] -> y [T, Ch] (dtype of weight, like F.conv1d).
    `use_triton=False` keeps CUDA on the reference too (the model's opt-in, see TreeModel)."""
    if use_triton and x.is_cuda and weight.dtype != torch.float64:
        conv_index = None
        if conv_cache is not None:
            if "index" not in conv_cache:
                conv_cache["index"] = prepare_conv_index(conv_pred)
            conv_index = conv_cache["index"]
        return _kernel(x, weight, conv_pred, activation, index=conv_index)
    return tree_causal_conv_reference(x, weight, conv_pred, activation)
