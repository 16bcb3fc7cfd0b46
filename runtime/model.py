"""TreeModel: a Qwen3-Next-family or Kimi Linear causal LM executed over a microbatch's compact tokens.

The module tree mirrors transformers' `...ForCausalLM` parameter names (`model.embed_tokens`,
`model.layers.{i}.linear_attn|self_attn|mlp...`, `model.norm`, `lm_head`), so `from_hf` can share
the Hugging Face parameters and checkpoints load by name (`weights.py`). One forward:

    embed compact tokens -> decoder layers (each optionally checkpointed) -> final norm
    -> chunked lm_head + log-softmax + gather into per-trajectory rows (docs/design.md section 5)

Everything a layer needs from the plan sits in one `ExecutionContext` built once per forward and passed
explicitly: the microbatch's launch plan (lowered on the host for this model's kernels and uploaded once,
`codegen.lower`), and the RoPE tables computed from it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from harts_compiler.codegen import LaunchPlan, LaunchTarget, MicrobatchIndex, PlanMismatchError, lower
from harts_compiler.codegen.kernels.chunk_gdn import GDNKernelConfig
from harts_compiler.codegen.kernels.logprobs import token_logprobs
from harts_compiler.codegen.pieces import PieceChain

from .attention import GatedAttention
from .backend import select_backend
from .config import ModelConfig
from .gated_deltanet import GatedDeltaNet
from .kimi_delta import KimiDeltaAttention
from .kimi_moe import KimiMoeBlock
from .layers import DenseMLP, RMSNorm, ZeroCentredRMSNorm, rope_tables
from .mla import MultiLatentAttention
from .moe import RouterStats, SparseMoeBlock, load_balancing_loss
from .ops.embedding import embed_tokens
from .ops.offload import HostParkedInput, run_layer
from .pieces import run_piece_chain


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
    router_stats: list | None = None  # per MoE layer, the routing sums the aux loss is made of (RouterStats)


@dataclasses.dataclass
class ExecutionContext:
    """Per-forward state shared by all layers (built once, read-only)."""

    plan: LaunchPlan  # on the model's device
    config: ModelConfig
    gdn_kernel: Callable | None = None  # a reference GDN kernel for the torch path (tests: the token-loop oracle)
    kda_kernel: Callable | None = None  # the same for KDA layers
    attention_kernel: Callable | None = None  # another full-attention kernel with tree_attention's signature
    carries: dict | None = None  # a piece of a split tree: layer -> its `ops.carry.LayerCarry`
    _rope: dict = dataclasses.field(default_factory=dict)

    def layer_carry(self, layer: int):
        """The carried tensors of `layer` in a piece forward (None for a whole microbatch)."""
        return None if self.carries is None else self.carries[layer]

    def rope(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype not in self._rope:
            c = self.config
            self._rope[dtype] = rope_tables(self.plan.positions, c.head_dim, c.partial_rotary_factor,
                                            c.rope_theta, dtype)
        return self._rope[dtype]


def _norm_class(config: ModelConfig):
    """Kimi scales by w (initialised to 1), the Qwen families by 1 + w (zero-centred)."""
    return RMSNorm if config.is_kimi else ZeroCentredRMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer_type = config.layer_types[layer]
        linear = self.layer_type == "linear_attention"
        self.is_moe = config.is_moe_layer(layer)
        if config.is_kimi:  # transformers names both mixers self_attn here
            self.mixer_name = "self_attn"
            self.self_attn = KimiDeltaAttention(config) if linear else MultiLatentAttention(config)
            moe = KimiMoeBlock
        else:
            self.mixer_name = "linear_attn" if linear else "self_attn"
            setattr(self, self.mixer_name, GatedDeltaNet(config) if linear else GatedAttention(config))
            moe = SparseMoeBlock
        getattr(self, self.mixer_name).layer_idx = layer  # a piece's carried tensors are kept per layer
        self.mlp = moe(config) if self.is_moe else DenseMLP(config.hidden_size, config.intermediate_size)
        norm = _norm_class(config)
        self.input_layernorm = norm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = norm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ExecutionContext) -> tuple[torch.Tensor, RouterStats | None]:
        h = self.input_layernorm(x)
        x = x + getattr(self, self.mixer_name)(h, ctx)
        h = self.post_attention_layernorm(x)
        stats = None
        if self.is_moe:
            h, stats = self.mlp(h, ctx.plan.multiplicity)
        else:
            h = self.mlp(h)
        return x + h, stats


class TextModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = _norm_class(config)(config.hidden_size, eps=config.rms_norm_eps)


class TreeModel(nn.Module):
    """Exact tree-mode execution of a Qwen3-Next / Qwen3.5 / Qwen3.5-MoE / Kimi Linear causal LM."""

    def __init__(self, config: ModelConfig, *, activation_checkpointing: bool = False,
                 triton_linear_attention: bool = True, gdn_config: GDNKernelConfig | None = None,
                 offload_piece_inputs: bool = False):
        super().__init__()
        self.config = config
        self.activation_checkpointing = activation_checkpointing
        # a tree in pieces: the checkpointed layer inputs of every piece but the last wait in host memory until
        # their backward (ops/offload.py); without checkpointing there are none to move
        self.offload_piece_inputs = offload_piece_inputs
        # Triton GDN and tree causal-conv kernels on CUDA for bf16/fp16 models (checked on the H200:
        # tests/test_chunk_gdn_gpu.py, test_causal_conv.py, test_runtime_gpu.py). fp32/fp64 models
        # and `triton_linear_attention=False` run the exact plain-torch path: the kernels' dots
        # would take fp32 operands through TF32 (measured ~8e-4 relative gradient differences).
        self.triton_linear_attention = triton_linear_attention
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

    def launch_target(self, *, reference_gdn: bool = False) -> LaunchTarget:
        """What a plan must be lowered for to run on this model as its parameters are now (dtype, device)."""
        weight = self.lm_head.weight
        return select_backend(self.config, weight.dtype, weight.device,
                              triton_linear_attention=self.triton_linear_attention, reference_gdn=reference_gdn,
                              gdn_config=self.gdn_config)

    def launch_plan(self, batch, *, reference_gdn: bool = False) -> LaunchPlan:
        """The device launch plan of `batch`: a LaunchPlan lowered for this model, a MicrobatchIndex, or a plan's
        microbatch (anything with `build_index()`, e.g. `harts_compiler.PlannedMicrobatch`). Lowering and its
        checks run on the host, before any compute; the upload is one copy."""
        target = self.launch_target(reference_gdn=reference_gdn)
        device = self.lm_head.weight.device
        try:
            if isinstance(batch, LaunchPlan):
                if batch.target != target:
                    raise PlanMismatchError(f"the LaunchPlan was lowered for {batch.target}, this model needs "
                                            f"{target}: lower it with model.launch_target()")
                plan = batch
            else:
                check = getattr(batch, "check_model", None)
                if check is not None:  # a plan's microbatch: its compile options against this model
                    check(self)
                index = batch.build_index() if hasattr(batch, "build_index") else batch
                if not isinstance(index, MicrobatchIndex):
                    raise InvalidBatchError(f"TreeModel expects a MicrobatchIndex, a LaunchPlan or a plan's "
                                            f"microbatch, got {type(batch).__name__}")
                plan = lower(index, target)
        except InvalidBatchError:
            raise
        except ValueError as error:  # PlanMismatchError and every bad-index error name the field
            raise InvalidBatchError(str(error)) from None
        return plan if plan.device == device else plan.to(device)

    def forward(self, batch, *, activation_checkpointing: bool | None = None,
                gdn_kernel: Callable | None = None, kda_kernel: Callable | None = None,
                attention_kernel: Callable | None = None, carries=None, offload_inputs: bool = False) -> TreeOutput:
        """Run one microbatch (see `launch_plan` for what `batch` may be; a microbatch whose tree runs as pieces,
        or its `codegen.pieces.PieceChain`, runs its pieces in order and returns whole rows). `gdn_kernel` /
        `kda_kernel`: a reference kernel (same signature as `chunk_gated_delta_rule_reference`) for the GDN / KDA
        layers; `attention_kernel`: another full-attention kernel, `(q, k, v, plan, *, scale) -> o` as
        `runtime.attention.tree_attention` (the benchmarks' trajectory-wise baselines). `carries`: layer ->
        LayerCarry when `batch` is one piece of a split tree (`runtime.pieces` passes them, and `offload_inputs` for
        the pieces whose backward waits; the output then holds that piece's partial rows)."""
        options = dict(activation_checkpointing=activation_checkpointing, gdn_kernel=gdn_kernel,
                       kda_kernel=kda_kernel, attention_kernel=attention_kernel)
        chain = batch if isinstance(batch, PieceChain) else None
        if chain is None and getattr(batch, "runs_as_pieces", False):
            batch.check_model(self)
            chain = batch.build_chain()
        if chain is not None:
            return run_piece_chain(self, chain, **options)
        plan = self.launch_plan(batch, reference_gdn=gdn_kernel is not None or kda_kernel is not None)
        if (plan.piece is None) != (carries is None):
            raise InvalidBatchError("this microbatch is one piece of a split tree: it reads carried tensors from "
                                    "the pieces before it; run the whole microbatch (or its PieceChain)"
                                    if carries is None else "carried tensors were given for a whole microbatch")
        logprobs, entropy, router_stats = self.run_plan(plan, carries=carries, offload_inputs=offload_inputs,
                                                        **options)
        return tree_output(plan.trajectory_ids, logprobs, entropy, plan.lengths, router_stats, self.config)

    def run_plan(self, plan: LaunchPlan, *, activation_checkpointing: bool | None = None,
                 gdn_kernel: Callable | None = None, kda_kernel: Callable | None = None,
                 attention_kernel: Callable | None = None, carries=None, offload_inputs: bool = False):
        """One uploaded launch plan through every layer: (logprobs rows, entropy rows, router statistics).
        `carries`: layer -> LayerCarry for a piece of a split tree (`runtime.pieces`); `offload_inputs`: move the
        checkpointed layer inputs to host memory once the forward is done (`ops/offload.py`)."""
        ctx = ExecutionContext(plan=plan, config=self.config, gdn_kernel=gdn_kernel, kda_kernel=kda_kernel,
                               attention_kernel=attention_kernel, carries=carries)
        use_checkpoint = self.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
        use_checkpoint = use_checkpoint and torch.is_grad_enabled()

        x = embed_tokens(self.model.embed_tokens.weight, plan, padding_idx=self.config.pad_token_id)
        router_stats: list[RouterStats] = []
        parked: list[HostParkedInput] = []
        for layer in self.model.layers:
            if use_checkpoint and offload_inputs:
                parked.append(HostParkedInput(x))
                x, stats = checkpoint(run_layer, layer, parked[-1], ctx, use_reentrant=False)
            elif use_checkpoint:
                # rounds and state hand-offs are inside the layer, so they are recomputed too
                x, stats = checkpoint(layer, x, ctx, use_reentrant=False)
            else:
                x, stats = layer(x, ctx)
            if stats is not None:
                router_stats.append(stats)
        x = self.model.norm(x)
        logprobs, entropy = token_logprobs(x, self.lm_head.weight, plan.targets, use_triton=plan.target.logprobs_triton)
        for inputs in parked:
            inputs.park()
        return logprobs, entropy, router_stats


def tree_output(trajectory_ids, logprobs, entropy, lengths, router_stats, config: ModelConfig) -> TreeOutput:
    """The TreeOutput of rows and a forward's router statistics (the aux loss over all of them)."""
    aux_loss = load_balancing_loss(router_stats, config.num_experts)
    expert_load = torch.stack([s.assigned for s in router_stats]).detach() if router_stats else None
    return TreeOutput(trajectory_ids=list(trajectory_ids), logprobs=logprobs, entropy=entropy,
                      lengths=lengths, aux_loss=aux_loss, expert_load=expert_load, router_stats=router_stats)
