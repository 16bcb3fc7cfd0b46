"""TreeModel: a Qwen3-Next-family causal LM executed over a microbatch's compact tokens.

The module tree mirrors transformers' `...ForCausalLM` parameter names (`model.embed_tokens`,
`model.layers.{i}.linear_attn|self_attn|mlp...`, `model.norm`, `lm_head`), so `from_hf` can share
the Hugging Face parameters and checkpoints load by name (`weights.py`). One forward:

    embed compact tokens -> decoder layers (each optionally checkpointed) -> final norm
    -> chunked lm_head + log-softmax + gather into per-trajectory rows (DESIGN.md section 5)

Everything a layer needs from the plan (index tensors, round gathers, RoPE tables) sits in one
`ExecutionContext` built once per forward and passed explicitly.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from harts_compiler.codegen.index import MicrobatchIndex
from harts_compiler.codegen.kernels.chunk_gdn import GDNKernelConfig
from harts_compiler.codegen.kernels.chunk_gdn.function import triton_supports

from .attention import GatedAttention
from .config import ModelConfig
from .gated_deltanet import GatedDeltaNet
from .layers import DenseMLP, ZeroCentredRMSNorm, rope_tables
from .moe import RouterStats, SparseMoeBlock, load_balancing_loss
from .ops.linear_attention import LinearRoundsPlan, plan_linear_rounds
from .ops.logprobs import check_target_index, token_logprobs


class InvalidBatchError(ValueError):
    """A microbatch index that this model cannot run (reported before any compute)."""


@dataclasses.dataclass
class TreeOutput:
    trajectory_ids: list[str]  # row order
    logprobs: torch.Tensor  # [rows, max_len]: [r, p] = log P(token_p | tokens_<p), 0 at p=0 and in padding
    entropy: torch.Tensor  # [rows, max_len]: entropy of the distribution predicting token_p
    lengths: torch.Tensor  # [rows]
    aux_loss: torch.Tensor | None  # MoE load-balancing loss, trajectory-wise semantics; None without MoE
    expert_load: torch.Tensor | None = None  # [moe_layers, E] top-k assignments counted once per trajectory


@dataclasses.dataclass
class ExecutionContext:
    """Per-forward state shared by all layers (built once, read-only)."""

    index: MicrobatchIndex
    linear_plan: LinearRoundsPlan
    config: ModelConfig
    gdn_kernel: Callable | None = None  # override of chunk_gated_delta_rule (tests: recurrent oracle)
    triton_linear_attention: bool = False  # Triton GDN + causal-conv kernels for this forward (see TreeModel)
    # tree attention, per microbatch: CUDA block index per head dim, "windows" of the torch path
    attention_blocks: dict = dataclasses.field(default_factory=dict)
    conv_cache: dict = dataclasses.field(default_factory=dict)  # CUDA causal-conv launch index
    _rope: dict = dataclasses.field(default_factory=dict)

    def rope(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype not in self._rope:
            c = self.config
            self._rope[dtype] = rope_tables(self.index.positions, c.head_dim, c.partial_rotary_factor,
                                            c.rope_theta, dtype)
        return self._rope[dtype]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer_type = config.layer_types[layer]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        self.is_moe = config.is_moe_layer(layer)
        self.mlp = SparseMoeBlock(config) if self.is_moe else DenseMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = ZeroCentredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ExecutionContext) -> tuple[torch.Tensor, RouterStats | None]:
        h = self.input_layernorm(x)
        mixer = self.linear_attn if self.layer_type == "linear_attention" else self.self_attn
        x = x + mixer(h, ctx)
        h = self.post_attention_layernorm(x)
        stats = None
        if self.is_moe:
            h, stats = self.mlp(h, ctx.index.multiplicity)
        else:
            h = self.mlp(h)
        return x + h, stats


class TextModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = ZeroCentredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


def checked_segment_chunks(value):
    """`TreeModel.gdn_segment_chunks`: None (off) or an int >= 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"gdn_segment_chunks must be an int >= 1 or None, got {value!r}")
    return value


class TreeModel(nn.Module):
    """Exact tree-mode execution of a Qwen3-Next / Qwen3.5 / Qwen3.5-MoE causal LM."""

    def __init__(self, config: ModelConfig, *, activation_checkpointing: bool = False,
                 triton_linear_attention: bool = True, gdn_segment_chunks: int | None = None,
                 gdn_config: GDNKernelConfig | None = None):
        super().__init__()
        self.config = config
        self.activation_checkpointing = activation_checkpointing
        # Triton GDN and tree causal-conv kernels on CUDA for bf16/fp16 models (checked on the H200:
        # tests/test_chunk_gdn_gpu.py, test_causal_conv.py, test_runtime_gpu.py). fp32/fp64 models
        # and `triton_linear_attention=False` run the exact plain-torch path: the kernels' dots
        # would take fp32 operands through TF32 (measured ~8e-4 relative gradient differences).
        self.triton_linear_attention = triton_linear_attention
        # opt-in: in rounds of few sequences, cut sequences longer than this many chunks into segments whose
        # state maps compose (codegen/kernels/chunk_gdn/segmented.py): shorter sequential scans for a long
        # shared prefix, at ~3x its token work; equal to the uncut rounds to rounding, not bit for bit
        self.gdn_segment_chunks = checked_segment_chunks(gdn_segment_chunks)
        # launch configuration of the Triton GDN kernels (None: the defaults, tuned on the H200)
        if gdn_config is not None and not isinstance(gdn_config, GDNKernelConfig):
            raise TypeError(f"TreeModel: gdn_config must be a GDNKernelConfig or None, got {type(gdn_config).__name__}")
        self.gdn_config = gdn_config
        self.model = TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # constructors live in weights.py (they need the loading machinery); re-exported here
    @classmethod
    def from_hf(cls, hf_model, **kwargs) -> "TreeModel":
        from .weights import tree_model_from_hf
        return tree_model_from_hf(cls, hf_model, **kwargs)

    @classmethod
    def from_pretrained(cls, path, **kwargs) -> "TreeModel":
        from .weights import tree_model_from_pretrained
        return tree_model_from_pretrained(cls, path, **kwargs)

    @classmethod
    def from_config(cls, config, *, seed: int = 0, dtype: torch.dtype = torch.float32, **kwargs) -> "TreeModel":
        from .weights import tree_model_from_config
        return tree_model_from_config(cls, config, seed=seed, dtype=dtype, **kwargs)

    @property
    def conv_width(self) -> int:
        return self.config.linear_conv_kernel_dim

    def check_index(self, index: MicrobatchIndex) -> None:
        """Every reason this model cannot run `index`, raised before any compute."""
        if not isinstance(index, MicrobatchIndex):
            raise InvalidBatchError(f"TreeModel expects a MicrobatchIndex, got {type(index).__name__}")
        if index.conv_width != self.conv_width:
            raise InvalidBatchError(
                f"MicrobatchIndex.conv_width={index.conv_width} but the model's linear_conv_kernel_dim is "
                f"{self.conv_width}: compile the plan with conv_width={self.conv_width}")
        if index.chunk_size <= 0:
            raise InvalidBatchError(f"MicrobatchIndex.chunk_size={index.chunk_size} must be positive")
        if index.num_tokens:
            low, high = torch.stack([index.token_ids.min(), index.token_ids.max()]).tolist()  # one host transfer
            if low < 0 or high >= self.config.vocab_size:
                bad = low if low < 0 else high
                raise InvalidBatchError(f"MicrobatchIndex.token_ids: token id {bad} is outside the model's "
                                        f"vocabulary [0, {self.config.vocab_size})")
        index.check()
        try:  # targets (vocabulary range included) checked here, before compute, not by token_logprobs after it
            check_target_index(index, index.num_tokens, self.config.vocab_size)
        except ValueError as error:
            raise InvalidBatchError(f"MicrobatchIndex: {error}") from None

    def forward(self, index, *, activation_checkpointing: bool | None = None,
                gdn_kernel: Callable | None = None) -> TreeOutput:
        """Run one microbatch: a MicrobatchIndex, or a Plan microbatch (anything with
        `build_index(device)`, e.g. `harts_compiler.PlannedMicrobatch`)."""
        device = self.lm_head.weight.device
        if not isinstance(index, MicrobatchIndex) and hasattr(index, "build_index"):
            index = index.build_index(device)
        self.check_index(index)
        if index.device != device:
            index = index.to(device)
        dtype, cfg = self.lm_head.weight.dtype, self.config
        # conv kernel: 16-bit on CUDA; GDN kernels: only the shapes validated there (triton_supports)
        use_triton = (self.triton_linear_attention and device.type == "cuda"
                      and dtype in (torch.bfloat16, torch.float16))
        gdn_triton = (use_triton and gdn_kernel is None
                      and triton_supports(dtype, cfg.linear_key_head_dim, cfg.linear_value_head_dim))
        linear_plan = plan_linear_rounds(index, use_triton=gdn_triton, gdn_config=self.gdn_config,
                                         segment_chunks=None if gdn_kernel is not None else self.gdn_segment_chunks)
        ctx = ExecutionContext(index=index, linear_plan=linear_plan,
                               config=self.config, gdn_kernel=gdn_kernel, triton_linear_attention=use_triton)
        use_checkpoint = self.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
        use_checkpoint = use_checkpoint and torch.is_grad_enabled()

        x = self.model.embed_tokens(index.token_ids)
        router_stats: list[RouterStats] = []
        for layer in self.model.layers:
            if use_checkpoint:
                # rounds and state hand-offs are inside the layer, so they are recomputed too
                x, stats = checkpoint(layer, x, ctx, use_reentrant=False)
            else:
                x, stats = layer(x, ctx)
            if stats is not None:
                router_stats.append(stats)
        x = self.model.norm(x)
        logprobs, entropy = token_logprobs(x, self.lm_head.weight, index, check_values=False)  # check_index did

        aux_loss = load_balancing_loss(router_stats, self.config.num_experts)
        expert_load = torch.stack([s.assigned for s in router_stats]).detach() if router_stats else None
        return TreeOutput(trajectory_ids=list(index.trajectory_ids), logprobs=logprobs, entropy=entropy,
                          lengths=index.lengths, aux_loss=aux_loss, expert_load=expert_load)
