"""Kimi Linear checkpoint names as released (moonshot's layout) -> the runtime's (transformers' in-memory) names.

The same renames transformers' conversion mapping applies on load: the forget gate's `f_a_proj` / `f_b_proj` /
`dt_bias` / `A_log` move under `self_attn.forget_gate.`, the three short convs `q_conv1d` / `k_conv1d` /
`v_conv1d` are stacked into one `conv1d` over [q|k|v], `block_sparse_moe.` becomes `mlp.`, and the experts'
`w1` / `w3` / `w2` are the gate / up / down projections (fused by `weights._fuse_experts`). Names already in
transformers' layout pass through. Ling 3.0 (as transformers' bailing_hybrid mapping): `model.word_embeddings.`
-> `model.embed_tokens.`, `.attention.` -> `.self_attn.` with `dense` -> `o_proj`, `f_proj` / `dt_bias` / `A_log`
under `forget_gate.`, the router's `expert_bias` -> `e_score_correction_bias`; the multi-token-prediction layers
stored after the decoder (`model.layers.{i}` for i >= num_hidden_layers) are not run and are dropped.
"""
from __future__ import annotations

import re

import torch

from .config import UnsupportedModelError

_FORGET = re.compile(r"\.self_attn\.(f_a_proj\.|f_b_proj\.|f_proj\.|dt_bias$|A_log$)")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_CONV = re.compile(r"^(.*\.self_attn)\.([qkv])_conv1d\.weight$")
_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.weight$")
_EXPERT_PROJ = {"1": "gate_proj", "3": "up_proj", "2": "down_proj"}


def kimi_checkpoint_names(tensors: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    out, convs = {}, {}
    for name, tensor in tensors.items():
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) >= config.num_hidden_layers:
            continue  # multi-token-prediction layers
        if name.startswith("model.word_embeddings."):
            name = "model.embed_tokens." + name[len("model.word_embeddings."):]
        name = name.replace(".attention.", ".self_attn.").replace(".self_attn.dense.", ".self_attn.o_proj.")
        name = name.replace(".mlp.gate.expert_bias", ".mlp.gate.e_score_correction_bias")
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
