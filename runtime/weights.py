"""Building a TreeModel: from a transformers model (shared parameters), a checkpoint, or a config.

Our module tree uses transformers' parameter names, so every mapping here is by name:
- `from_hf`: the TreeModel's parameters *are* the Hugging Face model's `nn.Parameter` objects
  (built on the meta device, then rebound), so gradients land on the HF model and nothing is copied;
- `from_pretrained`: config.json + safetensors with names as on disk: Qwen3.5's
  `model.language_model.` prefix, per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` fused
  into `gate_up_proj` / `down_proj` on load, `mtp.*` and vision weights ignored;
- `from_config`: seeded random weights initialised like transformers' `_init_weights`.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from .config import ModelConfig, UnsupportedModelError, resolve_config

SUPPORTED_HF_CLASSES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                        "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                        "KimiLinearForCausalLM", "BailingHybridForCausalLM")
# weights that belong to parts the runtime does not execute (multi-token prediction, vision tower)
_IGNORED = re.compile(r"^(mtp\.|model\.visual\.|visual\.|model\.mtp\.)")
_EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _build_on_meta(cls, config: ModelConfig, **kwargs):
    with torch.device("meta"):
        return cls(config, **kwargs)


def _bind(model: nn.Module, name: str, value: nn.Parameter) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    setattr(owner, attr, value)


def _check_shape(name: str, got: torch.Size, want: torch.Size, source: str) -> None:
    if tuple(got) != tuple(want):
        raise UnsupportedModelError(f"{source}: parameter {name} has shape {tuple(got)}, expected {tuple(want)}")


def _canonical_name(name: str) -> str:
    """Checkpoint / HF name -> TreeModel name (Qwen3.5 keeps the text model under model.language_model)."""
    return "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") else name


def tree_model_from_hf(cls, hf_model, **kwargs):
    kind = type(hf_model).__name__
    if kind not in SUPPORTED_HF_CLASSES:
        raise UnsupportedModelError(f"TreeModel.from_hf: {kind} is not supported (supported: {SUPPORTED_HF_CLASSES})")
    config = ModelConfig.from_hf_config(getattr(hf_model.config, "text_config", None) or hf_model.config)
    model = _build_on_meta(cls, config, **kwargs)
    hf_params = {}
    for name, param in hf_model.named_parameters(remove_duplicate=False):
        if not _IGNORED.match(name):
            hf_params[_canonical_name(name)] = param
    ours = dict(model.named_parameters(remove_duplicate=False))
    missing = sorted(set(ours) - set(hf_params))
    unused = sorted(set(hf_params) - set(ours))
    if missing or unused:
        raise UnsupportedModelError(f"TreeModel.from_hf({kind}): parameter names differ; missing in the HF "
                                    f"model: {missing[:5]}, not used by the runtime: {unused[:5]}")
    for name, ours_param in ours.items():
        _check_shape(name, hf_params[name].shape, ours_param.shape, f"from_hf({kind})")
        _bind(model, name, hf_params[name])
    # buffers the runtime reads (Kimi's e_score_correction_bias) are shared too, so updates to the HF one show
    hf_buffers = {_canonical_name(n): b for n, b in hf_model.named_buffers()}
    for name, ours_buffer in model.named_buffers():
        if name not in hf_buffers:
            raise UnsupportedModelError(f"TreeModel.from_hf({kind}): buffer {name} is missing in the HF model")
        _check_shape(name, hf_buffers[name].shape, ours_buffer.shape, f"from_hf({kind})")
        _bind_buffer(model, name, hf_buffers[name])
    return model


def _bind_buffer(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    owner.register_buffer(attr, value)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index_file = path / "model.safetensors.index.json"
    if index_file.exists():
        files = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"from_pretrained: no *.safetensors files in {path}")
    tensors = {}
    for file in files:
        tensors.update(load_file(str(path / file)))
    return tensors


def _fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down weights -> transformers' fused gate_up_proj [E, 2I, H] / down_proj [E, H, I]."""
    per_expert: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for name, tensor in tensors.items():
        match = _EXPERT_KEY.match(name)
        if match:
            prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
            per_expert.setdefault(prefix, {}).setdefault(expert, {})[proj] = tensor
        else:
            out[name] = tensor
    for prefix, experts in per_expert.items():
        count = max(experts) + 1
        for e in range(count):
            if sorted(experts.get(e, {})) != ["down_proj", "gate_proj", "up_proj"]:
                raise UnsupportedModelError(f"from_pretrained: {prefix}.{e} lacks some of gate_proj/up_proj/down_proj")
        out[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]], dim=0) for e in range(count)])
        out[prefix + ".down_proj"] = torch.stack([experts[e]["down_proj"] for e in range(count)])
    return out


def tree_model_from_pretrained(cls, path, *, dtype: torch.dtype | None = None, device="cpu", **kwargs):
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"from_pretrained: {config_file} does not exist")
    config = ModelConfig.from_dict(json.loads(config_file.read_text()))
    raw = _read_safetensors(path)
    tensors = {_canonical_name(k): v for k, v in raw.items() if not _IGNORED.match(k)}
    if config.is_kimi:
        from .kimi_weights import kimi_checkpoint_names

        tensors = kimi_checkpoint_names(tensors, config)
    tensors = _fuse_experts(tensors)
    model = _build_on_meta(cls, config, **kwargs)
    # tied lm_head appears once, as the embedding; buffers the runtime reads load like parameters
    ours = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    buffers = set(dict(model.named_buffers()))
    missing = sorted(set(ours) - set(tensors))
    unused = sorted(set(tensors) - set(ours) - ({"lm_head.weight"} if config.tie_word_embeddings else set()))
    if missing or unused:
        raise UnsupportedModelError(f"from_pretrained({path}): checkpoint names differ; missing: {missing[:5]}, "
                                    f"unexpected: {unused[:5]}")
    for name, param in ours.items():
        tensor = tensors[name]
        _check_shape(name, tensor.shape, param.shape, f"from_pretrained({path})")
        if name in buffers:  # the routing bias stays in its stored precision (transformers keeps it fp32)
            _bind_buffer(model, name, tensor.to(device=device))
            continue
        tensor = tensor.to(device=device, dtype=dtype or tensor.dtype)
        _bind(model, name, nn.Parameter(tensor))
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


@torch.no_grad()
def tree_model_from_config(cls, config, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                           device="cpu", draw_on_device: bool = False, **kwargs):
    """Random model, initialised as transformers' `_init_weights` does, deterministic in `seed`.

    The numbers are drawn in float64 on the CPU (the same model on every machine), or with `draw_on_device`
    in float32 on `device` from its own generator: the same distributions, another stream of numbers, and
    seconds instead of minutes for a billion parameters (the GPU benchmarks)."""
    from .gated_deltanet import GatedDeltaNet
    from .kimi_delta import ForgetGate
    from .kimi_moe import GroupedRouter
    from .layers import GatedRMSNorm, RMSNorm, SigmoidGatedRMSNorm, ZeroCentredRMSNorm
    from .moe import Experts, Router

    config = resolve_config(config)
    where = torch.device(device) if draw_on_device else torch.device("cpu")
    with where:
        model = cls(config, **kwargs)
    gen = torch.Generator(where).manual_seed(seed)
    draw = dict(generator=gen, dtype=torch.float32 if draw_on_device else torch.float64, device=where)
    std = config.initializer_range

    def normal_(t):
        t.copy_(torch.randn(t.shape, **draw) * std)

    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d)):
            normal_(module.weight)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, ZeroCentredRMSNorm):
            module.weight.zero_()
        elif isinstance(module, (GatedRMSNorm, RMSNorm, SigmoidGatedRMSNorm)):
            module.weight.fill_(1.0)
        elif isinstance(module, Experts):
            normal_(module.gate_up_proj)
            normal_(module.down_proj)
        elif isinstance(module, (Router, GroupedRouter)):
            normal_(module.weight)
        if isinstance(module, GatedDeltaNet):
            module.dt_bias.fill_(1.0)
            module.A_log.copy_(torch.rand(module.A_log.shape, **draw).mul(16 - 0.01).add(0.01).log())
        if isinstance(module, ForgetGate):  # as fla / transformers: A in [1, 16], dt_bias = softplus^-1(dt)
            module.A_log.copy_(torch.rand(module.A_log.shape, **draw).mul(15).add(1).log())
            low, high = torch.log(torch.tensor(1e-3)), torch.log(torch.tensor(1e-1))
            dt = (torch.rand(module.dt_bias.shape, **draw) * (high - low) + low).exp()
            dt = dt.clamp_min(1e-4)
            module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
    return model.to(device=device, dtype=dtype)


@torch.no_grad()
def randomise_for_verification_(model, seed: int = 0):
    """Redraw `model`'s weights so that every path matters, for exactness checks (tests, `harts
    verify --model PRESET`, `harts demo`). transformers' init (std 0.02, decay rates A up to 16)
    makes most linear-attention heads forget their state within one token and most products tiny,
    so a wrong state hand-off or gather could hide under rounding. Here matrices are N(0, 0.15^2),
    1-D parameters (norms, dt_bias) get 0.1-noise, and decay rates A = exp(A_log) lie in
    [0.05, 0.55], so states carry across many chunks; Kimi's routing bias gets 0.1-noise, so it changes
    which experts are chosen. Deterministic in `seed`; returns `model`."""
    gen = torch.Generator().manual_seed(seed + 1)
    # a bounded forget gate (Ling 3.0) decays by lower_bound * sigmoid(A (f + dt_bias)): dt_bias near -3 keeps
    # that small, as the unbounded gates' [0.05, 0.55] rates do
    safe_gate = getattr(getattr(model, "config", None), "kda_safe_gate", False)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=gen, dtype=torch.float64))
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        if name.endswith("A_log"):
            p.copy_(torch.log(torch.rand(p.shape, generator=gen, dtype=torch.float64) * 0.5 + 0.05))
        elif safe_gate and name.endswith("forget_gate.dt_bias"):
            p.copy_(-3.0 + 0.1 * noise)
        elif p.dim() == 1:
            p.add_(0.1 * noise.to(p.dtype))
        else:
            p.copy_(0.15 * noise)
    return model
