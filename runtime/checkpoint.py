"""Checkpoints of a sharded TreeModel and its optimizer with `torch.distributed.checkpoint` (DCP).

`save_checkpoint` writes every rank's shards into one DCP directory (each rank writes its own
pieces; no rank gathers the model). `load_checkpoint` reads it back into a model sharded the
same way or differently (another world size: DCP reshards on load). The state dicts come from
`torch.distributed.checkpoint.state_dict.get_state_dict`, so parameter names are the TreeModel's
own (FSDP2 adds no prefixes) and optimizer state is keyed by those names, not by positions.

From a checkpoint to a plain model: `load_tree_model(path, config)` reads the model part into an
unsharded TreeModel in one process (no process group needed). `export_pretrained(model, path)`
(a collective on every rank) writes the full weights as `model.safetensors` + `config.json` in
the names `TreeModel.from_pretrained` reads, which are transformers' own names (fused experts
`gate_up_proj` / `down_proj`, as transformers stores them).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)


def save_checkpoint(path, model, optimizer=None) -> None:
    """Save the (sharded) model and, if given, the optimizer state; call on every rank."""
    state = _state(model, optimizer)
    dcp.save(state, checkpoint_id=str(path))


def load_checkpoint(path, model, optimizer=None) -> None:
    """Load a `save_checkpoint` directory into `model` (and `optimizer`) in place; every rank.
    An optimizer must have state already (one step, or `torch.optim.Optimizer` lazily creates it:
    DCP needs its tensors to load into)."""
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    if optimizer is None:
        set_state_dict(model, optimizers=(), model_state_dict=state["model"], optim_state_dict={})
    else:
        set_state_dict(model, optimizers=optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


def load_tree_model(path, config, *, dtype: torch.dtype = torch.float32, **model_kwargs):
    """An unsharded TreeModel with the weights of a `save_checkpoint` directory (one process)."""
    from .model import TreeModel

    model = TreeModel.from_config(config, dtype=dtype, **model_kwargs)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(path), no_dist=not (dist.is_available() and dist.is_initialized()))
    model.load_state_dict(state["model"])
    return model


def full_state_dict(model, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) weights in host memory, on every rank (or only on rank 0, the
    others get {}: gathered one tensor at a time, so no device holds the whole model); a collective."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    return {name: t.cpu() for name, t in get_model_state_dict(model, options=options).items()}


def export_pretrained(model, path) -> None:
    """Full weights + config as a directory `TreeModel.from_pretrained` loads; a collective on every
    rank, rank 0 writes."""
    from safetensors.torch import save_file

    state = full_state_dict(model, rank0_only=True)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # stored once, as the embedding
    save_file({name: t.contiguous() for name, t in state.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(_config_json(model.config), indent=1))


def _config_json(config) -> dict:
    """The runtime config with a `model_type` that `ModelConfig.from_dict` maps back to its family."""
    from .config import FAMILIES

    model_type = next(t for t, family in FAMILIES.items() if family == config.family)
    return {**config.to_dict(), "model_type": model_type}


def _state(model, optimizer) -> dict:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}
