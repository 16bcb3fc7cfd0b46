"""Kimi Linear checkpoint names as released (moonshot's layout) -> the runtime's (transformers' in-memory) names.

The same renames transformers' conversion mapping applies on load: the forget gate's `f_a_proj` / `f_b_proj` /
`dt_bias` / `A_log` move under `self_attn.forget_gate.`, the three short convs `q_conv1d` / `k_conv1d` /
`v_conv1d` are stacked into one `conv1d` over [q|k|v], `block_sparse_moe.` becomes `mlp.`, and the experts'
`w1` / `w3` / `w2` are the gate / up / down projections (fused by `weights._fuse_experts`). Names already in
transformers' layout pass through.
"""
from __future__ import annotations

import re

import torch

from .config import UnsupportedModelError

_FORGET = re.compile(r"\.self_attn\.(f_a_proj\.|f_b_proj\.|dt_bias$|A_log$)")
_CONV = re.compile(r"^(.*\.self_attn)\.([qkv])_conv1d\.weight$")
_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.weight$")
_EXPERT_PROJ = {"1": "gate_proj", "3": "up_proj", "2": "down_proj"}


def kimi_checkpoint_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, convs = {}, {}
    for name, tensor in tensors.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        name = _FORGET.sub(lambda m: ".self_attn.forget_gate." + m.group(1), name)
        name = _EXPERT.sub(lambda m: f".experts.{m.group(1)}.{_EXPERT_PROJ[m.group(2)]}.weight", name)
        conv = _CONV.match(name)
        if conv:
            convs.setdefault(conv.group(1), {})[conv.group(2)] = tensor
        else:
            out[name] = tensor
    for prefix, parts in convs.items():
        if sorted(parts) != ["k", "q", "v"]:
            raise UnsupportedModelError(f"from_pretrained: {prefix} lacks some of q_conv1d/k_conv1d/v_conv1d")
        out[prefix + ".conv1d.weight"] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    return out
