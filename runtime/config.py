"""Model configuration of the Qwen3-Next / Qwen3.5 / Qwen3.5-MoE family, read from the edges.

One frozen dataclass (`ModelConfig`) holds every hyper-parameter the runtime reads; it is built
from a transformers config object, a config.json dict (including Qwen3.5's nested `text_config`)
or a named preset. Everything the runtime cannot reproduce exactly is rejected here, before any
weight is touched, with an error naming the offending field.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

# model_type -> family. "next" = Qwen3-Next (grouped in_proj_qkvz/ba, optional MoE per layer);
# "qwen3_5" = dense Qwen3.5 (flat projections, dense MLP everywhere);
# "qwen3_5_moe" = Qwen3.5-MoE (flat projections, MoE on every layer, top-k always renormalised).
FAMILIES = {
    "qwen3_next": "next",
    "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe", "qwen3_5_moe_text": "qwen3_5_moe",
    "kimi_linear": "kimi",  # Kimi Linear: KDA + MLA + grouped-routing MoE (kimi_config.py reads it)
    "bailing_hybrid": "ling",  # Ling 3.0 (BailingHybrid): KDA + gated MLA with RoPE + the same MoE
}


class UnsupportedModelError(ValueError):
    """The model or its config asks for something the runtime cannot compute exactly."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str  # "next" | "qwen3_5" | "qwen3_5_moe" | "kimi" | "ling"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention" per layer
    # full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    rope_theta: float
    partial_rotary_factor: float
    # gated deltanet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MLP / MoE
    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    router_aux_loss_coef: float
    # misc
    rms_norm_eps: float
    tie_word_embeddings: bool
    initializer_range: float
    # Kimi Linear (defaults: the Qwen families' behaviour). linear_rule: "gdn" (scalar decay per head) or
    # "kda" (a decay per key channel)
    linear_rule: str = "gdn"
    # MLA full attention (kv_lora_rank > 0): q/k head dim = nope + rope, v head dim apart
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mla_use_nope: bool = True  # no RoPE in MLA (Kimi Linear; what transformers' KimiLinearAttention computes)
    # sigmoid-scored grouped top-k MoE with a score-correction bias
    num_expert_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0
    mlp_layer_types: tuple[str, ...] = ()  # "dense" | "sparse" per layer (Kimi)
    # Ling 3.0's variants of the same layers
    kda_full_rank_gates: bool = False  # forget gate f_proj and output gate g_proj full rank (Kimi: low rank)
    kda_safe_gate: bool = False  # g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)) instead of -A softplus
    kda_lower_bound: float = -5.0
    mla_output_gate: bool = False  # MLA output scaled per head by sigmoid(g_proj(x))
    rope_interleave: bool = False  # MLA RoPE on interleaved pairs (DeepSeek layout) instead of rotate-half
    # embedding row without gradient (transformers' padding_idx); read for the Kimi-style families
    pad_token_id: int | None = None

    @property
    def flat_linear_projections(self) -> bool:
        """Qwen3.5 splits the GDN input projection into in_proj_qkv/z/b/a."""
        return self.family != "next"

    @property
    def is_kimi(self) -> bool:
        """Kimi-style layers (KDA + MLA + grouped-routing MoE): Kimi Linear and Ling 3.0."""
        return self.family in ("kimi", "ling")

    @property
    def attention_head_dims(self) -> tuple[int, int]:
        """(q/k head dim, v head dim) of the full-attention layers."""
        if self.is_kimi:
            return self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
        return self.head_dim, self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        if self.is_kimi:
            return self.mlp_layer_types[layer] == "sparse"
        if self.family == "qwen3_5":
            return False
        if self.family == "qwen3_5_moe":
            return True
        return (self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0
                and layer not in self.mlp_only_layers)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @property
    def normalise_topk(self) -> bool:
        return True if self.family == "qwen3_5_moe" else self.norm_topk_prob

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "ModelConfig":
        """From a config.json dict (or `transformers_config.to_dict()`)."""
        cfg = dict(raw)
        if isinstance(cfg.get("text_config"), Mapping):  # Qwen3.5 (multimodal wrapper)
            outer_type = cfg.get("model_type")
            cfg = {**cfg["text_config"]}
            cfg.setdefault("model_type", outer_type)
            if "tie_word_embeddings" in raw and "tie_word_embeddings" not in raw["text_config"]:
                cfg["tie_word_embeddings"] = raw["tie_word_embeddings"]
        model_type = cfg.get("model_type")
        if model_type not in FAMILIES:
            raise UnsupportedModelError(
                f"config.model_type={model_type!r} is not supported (supported: {sorted(FAMILIES)})")
        family = FAMILIES[model_type]
        if family in ("kimi", "ling"):
            from .kimi_config import kimi_config_fields

            config = cls(**kimi_config_fields(cfg, family))
            config.validate()
            return config

        def need(name):
            if name not in cfg or cfg[name] is None:
                raise UnsupportedModelError(f"config.{name} is missing")
            return cfg[name]

        n_layers = int(need("num_hidden_layers"))
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            interval = int(cfg.get("full_attention_interval", 4))
            layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
        layer_types = tuple(layer_types)
        if len(layer_types) != n_layers:
            raise UnsupportedModelError(
                f"config.layer_types has {len(layer_types)} entries, num_hidden_layers={n_layers}")
        bad = sorted({t for t in layer_types if t not in ("linear_attention", "full_attention")})
        if bad:
            raise UnsupportedModelError(f"config.layer_types: unsupported layer type(s) {bad}")

        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise UnsupportedModelError(f"config.rope_parameters.rope_type={rope_type!r}: only 'default' RoPE "
                                        "is supported")
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
        hidden_act = cfg.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise UnsupportedModelError(f"config.hidden_act={hidden_act!r}: only 'silu' is supported")
        if cfg.get("attention_dropout", 0.0):
            raise UnsupportedModelError("config.attention_dropout must be 0 (dropout breaks exactness)")

        num_experts = int(cfg.get("num_experts", 0) or 0)
        if family == "qwen3_5":
            num_experts = 0
        config = cls(
            family=family,
            vocab_size=int(need("vocab_size")), hidden_size=int(need("hidden_size")),
            num_hidden_layers=n_layers, layer_types=layer_types,
            num_attention_heads=int(need("num_attention_heads")),
            num_key_value_heads=int(need("num_key_value_heads")),
            head_dim=int(cfg.get("head_dim") or need("hidden_size") // need("num_attention_heads")),
            attention_bias=bool(cfg.get("attention_bias", False)),
            rope_theta=rope_theta, partial_rotary_factor=partial,
            linear_num_key_heads=int(need("linear_num_key_heads")),
            linear_num_value_heads=int(need("linear_num_value_heads")),
            linear_key_head_dim=int(need("linear_key_head_dim")),
            linear_value_head_dim=int(need("linear_value_head_dim")),
            linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            num_experts=num_experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0) or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or 0),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0) or 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(int(i) for i in (cfg.get("mlp_only_layers") or ())),
            router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            initializer_range=float(cfg.get("initializer_range", 0.02)),
        )
        config.validate()
        return config

    @classmethod
    def from_hf_config(cls, hf_config) -> "ModelConfig":
        raw = hf_config.to_dict()
        # transformers keeps the resolved layer_types on the object; to_dict() may drop defaults
        raw["layer_types"] = list(getattr(hf_config, "layer_types", raw.get("layer_types")) or [])
        if not raw["layer_types"]:
            raw.pop("layer_types")
        return cls.from_dict(raw)

    def validate(self) -> None:
        def check(ok, field, why):
            if not ok:
                raise UnsupportedModelError(f"config.{field}: {why}")
        check(self.num_attention_heads % max(self.num_key_value_heads, 1) == 0 and self.num_key_value_heads > 0,
              "num_key_value_heads", "must divide num_attention_heads")
        check(self.linear_num_key_heads > 0 and self.linear_num_value_heads % self.linear_num_key_heads == 0,
              "linear_num_value_heads", "must be a multiple of linear_num_key_heads")
        check(self.linear_conv_kernel_dim >= 1, "linear_conv_kernel_dim", "must be >= 1")
        if self.is_kimi:
            from .kimi_config import validate_kimi

            validate_kimi(self, check)
        rotary = int(self.head_dim * self.partial_rotary_factor)
        check(rotary % 2 == 0 and 0 < rotary <= self.head_dim, "partial_rotary_factor",
              f"rotary dim {rotary} must be even and in (0, head_dim]")
        if any(self.is_moe_layer(i) for i in range(self.num_hidden_layers)):
            check(0 < self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                  f"must be in [1, num_experts={self.num_experts}]")
            check(self.moe_intermediate_size > 0, "moe_intermediate_size", "must be positive")
        if not all(self.is_moe_layer(i) for i in range(self.num_hidden_layers)):
            check(self.intermediate_size > 0, "intermediate_size", "dense MLP layers need it")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Tiny random configs for tests, `harts demo` and `harts verify --model PRESET`.
_TINY_COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, full_attention_interval=2, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
PRESETS: dict[str, dict] = {
    "tiny-qwen3-next": dict(_TINY_COMMON, model_type="qwen3_next", num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "tiny-qwen3.5": dict(_TINY_COMMON, model_type="qwen3_5_text"),
    "tiny-qwen3.5-moe": dict(_TINY_COMMON, model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, shared_expert_intermediate_size=32),
    # Kimi Linear at toy size: KDA and MLA layers alternating, a dense first MLP, grouped routing with a bias
    "tiny-kimi-linear": dict(
        model_type="kimi_linear", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
        num_expert_group=4, topk_group=2, routed_scaling_factor=2.5, num_shared_experts=1, moe_intermediate_size=32,
        rms_norm_eps=1e-5),
    # Ling 3.0 (BailingHybrid) at toy size: full-rank KDA gates, gated MLA with interleaved RoPE
    "tiny-ling-3": dict(
        model_type="bailing_hybrid", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_group_size=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, head_dim=16,
        short_conv_kernel_size=4, num_experts=8, num_experts_per_tok=2, num_expert_group=4, topk_group=2,
        routed_scaling_factor=2.5, num_shared_experts=1, moe_intermediate_size=32, rms_norm_eps=1e-6),
}


def resolve_config(cfg) -> ModelConfig:
    """A ModelConfig from a ModelConfig, a preset name, a config dict or a transformers config."""
    if isinstance(cfg, ModelConfig):
        return cfg
    if isinstance(cfg, str):
        if cfg not in PRESETS:
            raise UnsupportedModelError(f"unknown model preset {cfg!r} (presets: {sorted(PRESETS)})")
        return ModelConfig.from_dict(PRESETS[cfg])
    if isinstance(cfg, Mapping):
        return ModelConfig.from_dict(cfg)
    if hasattr(cfg, "to_dict"):
        return ModelConfig.from_hf_config(cfg)
    raise UnsupportedModelError(f"cannot read a model config from {type(cfg).__name__}")
