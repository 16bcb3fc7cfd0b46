"""Kimi Linear's and Ling 3.0's configs (transformers' `KimiLinearConfig` / `BailingHybridConfig`, or a
checkpoint's config.json) as ModelConfig fields.

Both spellings are read: transformers' attribute names (`num_local_experts`, `n_group`, `n_shared_experts`,
`num_experts_per_tok`, `norm_topk_prob`, `linear_num_heads`, ...) and the on-disk names its `to_dict()` and
the released checkpoints use (`num_experts`, `num_expert_group`, `num_shared_experts`, `num_experts_per_token`,
`moe_renormalize`, a `linear_attn_config` block with 1-based `kda_layers` / `full_attn_layers`,
`first_k_dense_replace`). KDA layers have as many key as value heads, one head size for q, k and v.
Ling 3.0 (`bailing_hybrid`) has the same layers with full-rank KDA gates, an optionally bounded forget gate
(`kda_safe_gate`, `kda_lower_bound`), MLA with interleaved RoPE and a per-head output gate; its KDA heads are
`num_attention_heads` of `head_dim` (as on disk; transformers' config object keeps that as `linear_head_dim`),
MLA on every `layer_group_size`-th layer.
"""
from __future__ import annotations

from typing import Any, Mapping

_MISSING = object()


class _Reader:
    def __init__(self, cfg: Mapping[str, Any], error):
        self.cfg, self.error = cfg, error

    def get(self, *names, default=_MISSING):
        for name in names:
            if self.cfg.get(name) is not None:
                return self.cfg[name]
        if default is _MISSING:
            raise self.error(f"config.{names[0]} is missing")
        return default


def _layer_types(read: _Reader, n_layers: int, error, family: str) -> tuple[str, ...]:
    linear = dict(read.get("linear_attn_config", default={}) or {})
    types = read.get("layer_types", default=None)
    if types is None and "kda_layers" in linear and "full_attn_layers" in linear:
        types = [None] * n_layers
        for layer in linear["full_attn_layers"]:
            types[int(layer) - 1] = "full_attention"  # 1-based on disk
        for layer in linear["kda_layers"]:
            types[int(layer) - 1] = "linear_attention"
    if types is None and family == "ling":  # the last layer of every group is MLA
        group = int(read.get("layer_group_size", default=6))
        types = ["full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(n_layers)]
    if types is None:  # transformers' default: MLA on every 4th layer after the first
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n_layers)]
    if len(types) != n_layers or any(t not in ("linear_attention", "full_attention") for t in types):
        raise error(f"config.layer_types must give linear_attention/full_attention for each of the {n_layers} "
                    f"layers, got {list(types)}")
    return tuple(types)


def kimi_config_fields(cfg: Mapping[str, Any], family: str = "kimi") -> dict:
    """ModelConfig keyword arguments of a Kimi Linear ("kimi") or Ling 3.0 ("ling") config dict (errors name
    the field)."""
    from .config import UnsupportedModelError as error

    read = _Reader(cfg, error)
    linear = dict(read.get("linear_attn_config", default={}) or {})
    n_layers = int(read.get("num_hidden_layers"))
    hidden_act = read.get("hidden_act", default="silu")
    if hidden_act != "silu":
        raise error(f"config.hidden_act={hidden_act!r}: only 'silu' is supported")
    if read.get("attention_dropout", default=0.0):
        raise error("config.attention_dropout must be 0 (dropout breaks exactness)")
    scoring = read.get("moe_router_activation_func", default="sigmoid")
    if scoring != "sigmoid":
        raise error(f"config.moe_router_activation_func={scoring!r}: only 'sigmoid' routing scores are supported")
    if read.get("use_grouped_topk", default=True) is False and int(read.get("num_expert_group", "n_group",
                                                                           default=1)) != 1:
        raise error("config.use_grouped_topk=false with num_expert_group > 1 is not supported")
    if "mlp_layer_types" in cfg and cfg["mlp_layer_types"] is not None:
        mlp_types = tuple(cfg["mlp_layer_types"])
    else:
        first_dense = int(read.get("first_k_dense_replace", default=1 if family == "kimi" else 2))
        mlp_types = tuple("dense" if i < first_dense else "sparse" for i in range(n_layers))
    if len(mlp_types) != n_layers or any(t not in ("dense", "sparse") for t in mlp_types):
        raise error(f"config.mlp_layer_types must give dense/sparse for each of the {n_layers} layers, "
                    f"got {list(mlp_types)}")
    heads = int(read.get("num_attention_heads"))
    ling = family == "ling"
    linear_heads = int(linear.get("num_heads") or read.get("linear_num_heads", default=heads if ling else 32))
    linear_dim = int(linear.get("head_dim") or read.get("linear_head_dim", *(("head_dim",) if ling else ()),
                                                         default=128))
    rope_dim = int(read.get("qk_rope_head_dim", default=64))
    rope = dict(read.get("rope_parameters", "rope_scaling", default={}) or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise error(f"config.rope_parameters.rope_type={rope.get('rope_type', rope.get('type'))!r}: only "
                    "'default' RoPE is supported")
    q_lora = read.get("q_lora_rank", default=None)
    return dict(
        family=family, vocab_size=int(read.get("vocab_size")), hidden_size=int(read.get("hidden_size")),
        num_hidden_layers=n_layers, layer_types=_layer_types(read, n_layers, error, family),
        num_attention_heads=heads, num_key_value_heads=int(read.get("num_key_value_heads", default=heads)),
        head_dim=rope_dim, attention_bias=bool(read.get("attention_bias", default=False)),
        rope_theta=float(rope.get("rope_theta", read.get("rope_theta", default=6e6 if ling else 10000.0))),
        partial_rotary_factor=1.0,
        linear_num_key_heads=linear_heads, linear_num_value_heads=linear_heads, linear_key_head_dim=linear_dim,
        linear_value_head_dim=linear_dim,
        linear_conv_kernel_dim=int(linear.get("short_conv_kernel_size") or read.get(
            "linear_conv_kernel_dim", "short_conv_kernel_size", default=4)),
        intermediate_size=int(read.get("intermediate_size", default=0)),
        num_experts=int(read.get("num_experts", "num_local_experts", default=0)),
        num_experts_per_tok=int(read.get("num_experts_per_token", "num_experts_per_tok", default=0)),
        moe_intermediate_size=int(read.get("moe_intermediate_size", default=0)),
        shared_expert_intermediate_size=0,
        norm_topk_prob=bool(read.get("moe_renormalize", "norm_topk_prob", default=True)),
        decoder_sparse_step=1, mlp_only_layers=(), router_aux_loss_coef=0.0,
        rms_norm_eps=float(read.get("rms_norm_eps", default=1e-5)),
        tie_word_embeddings=bool(read.get("tie_word_embeddings", default=False)),
        initializer_range=float(read.get("initializer_range", default=0.02)),
        linear_rule="kda", q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(read.get("kv_lora_rank", default=512)),
        qk_nope_head_dim=int(read.get("qk_nope_head_dim", default=128)), qk_rope_head_dim=rope_dim,
        v_head_dim=int(read.get("v_head_dim", default=128)),
        mla_use_nope=bool(read.get("mla_use_nope", default=not ling)),
        num_expert_group=int(read.get("num_expert_group", "n_group", default=1)),
        topk_group=int(read.get("topk_group", default=1)),
        routed_scaling_factor=float(read.get("routed_scaling_factor", default=1.0)),
        num_shared_experts=int(read.get("num_shared_experts", "n_shared_experts", default=0)),
        mlp_layer_types=mlp_types,
        kda_full_rank_gates=ling, kda_safe_gate=ling and bool(read.get("kda_safe_gate", default=True)),
        kda_lower_bound=float(read.get("kda_lower_bound", default=-5.0)), mla_output_gate=ling,
        rope_interleave=ling, pad_token_id=read.get("pad_token_id", default=None),
    )


def validate_kimi(config, check) -> None:
    """Kimi-specific invariants; `check(ok, field, why)` raises naming config.<field>."""
    check(config.num_key_value_heads == config.num_attention_heads, "num_key_value_heads",
          "MLA expands its latent to one key/value head per query head: must equal num_attention_heads")
    check(config.kv_lora_rank > 0, "kv_lora_rank", "must be positive")
    check(config.qk_nope_head_dim >= 0 and config.qk_rope_head_dim > 0 and config.qk_rope_head_dim % 2 == 0,
          "qk_rope_head_dim", "must be positive and even")
    check(config.v_head_dim > 0, "v_head_dim", "must be positive")
    check(config.pad_token_id is None or 0 <= config.pad_token_id < config.vocab_size, "pad_token_id",
          f"must be null or a token id in [0, vocab_size={config.vocab_size}) (its embedding row gets no gradient)")
    check(config.q_lora_rank is None or config.q_lora_rank > 0, "q_lora_rank", "must be positive or null")
    if any(t == "sparse" for t in config.mlp_layer_types):
        check(config.num_experts > 0 and config.num_experts % config.num_expert_group == 0, "num_expert_group",
              f"must divide num_experts={config.num_experts}")
        check(0 < config.topk_group <= config.num_expert_group, "topk_group",
              f"must be in [1, num_expert_group={config.num_expert_group}]")
        per_group = config.num_experts // config.num_expert_group
        check(per_group >= 2 or config.num_expert_group == 1, "num_expert_group",
              "groups of one expert cannot be scored by their top-2 (transformers' group score)")
        check(config.num_experts_per_tok <= config.topk_group * per_group, "num_experts_per_tok",
              f"must be <= topk_group * experts per group = {config.topk_group * per_group}")
        check(config.num_shared_experts >= 0, "num_shared_experts", "must be >= 0")
