"""Sharding a TreeModel with FSDP2 (`torch.distributed.fsdp.fully_shard`) on a DeviceMesh.

The FSDP2 convention: one `fully_shard` per decoder layer (its parameters are all-gathered just
before the layer runs and freed after it), then one on the root for what is left (embedding,
final norm, lm_head). Every parameter becomes a DTensor sharded on dim 0 over the mesh's
data-parallel dimension; `full_tensor()` gathers one back.

Gradients are *summed* over ranks, not averaged: the tree step divides every loss by batch-global
normalisers already, so the batch gradient is the plain sum of the ranks' gradients
(`set_gradient_divide_factor(1.0)`; FSDP2's default would divide by the world size).

`ignored_params` leaves parameters out of the sharding (each rank keeps and updates its own copy).

Expert parallelism (`runtime.expert_parallel.shard_expert_parallel`) passes `expert_mesh`: each MoE
block's experts (DTensors sharded over "ep" already) get their own `fully_shard` over that mesh first,
so the decoder layer's `fully_shard` leaves them out and their gradients are summed over the ranks that
hold the same experts only.
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard


def data_parallel_mesh(world_size: int, device_type: str) -> DeviceMesh:
    """A 1-D mesh named "dp" over every rank of the default process group."""
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))


def mixed_precision(param_dtype: torch.dtype | None = torch.bfloat16,
                    reduce_dtype: torch.dtype | None = torch.float32) -> MixedPrecisionPolicy:
    """bf16 compute copies of the parameters, fp32 gradient reduction (the usual LLM recipe)."""
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def shard_model(model, mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy | None = None,
                cpu_offload: bool = False, reshard_after_forward: bool = True,
                ignored_params: set | None = None, expert_mesh: DeviceMesh | None = None):
    """Apply `fully_shard` to every decoder layer of `model` and then to `model` itself, in place.

    `reshard_after_forward=False` keeps each layer's gathered parameters from its forward to its
    backward (one all-gather per layer and slot instead of two, at the memory of an unsharded
    model). `cpu_offload` keeps the sharded parameters, gradients and optimizer state in host
    memory (FSDP2's `CPUOffloadPolicy`). `expert_mesh`: the mesh the expert-parallel experts are
    sharded over (module docstring). Returns the model (now also an `FSDPModule`)."""
    if isinstance(model, FSDPModule):
        raise ValueError("shard_model: the model is sharded already")
    if mesh.ndim != 1:
        raise ValueError(f"shard_model: expects a 1-D data-parallel mesh, got {mesh.ndim} dimensions")
    options = dict(mesh=mesh, mp_policy=mp_policy or MixedPrecisionPolicy(),
                   offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
    ignored = set(ignored_params or ())
    if expert_mesh is not None:
        from .expert_parallel import expert_modules
        for experts in expert_modules(model):  # before the layers: a layer leaves out what a child holds
            fully_shard(experts, reshard_after_forward=reshard_after_forward, **dict(options, mesh=expert_mesh))
    for layer in model.model.layers:
        layer_ignored = {p for p in layer.parameters() if p in ignored}
        fully_shard(layer, reshard_after_forward=reshard_after_forward, ignored_params=layer_ignored or None,
                    **options)
    # the root's parameters are needed again right after its forward (lm_head in the loss): keep them
    fully_shard(model, reshard_after_forward=False, ignored_params=ignored or None, **options)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # a sum over ranks: the losses are batch-normalised
            # a factor of 1 needs no scaling, so plain SUM collectives do: gloo has no PREMUL_SUM (fp32 grads)
            module.set_force_sum_reduction_for_comms(True)
    return model


def sharded_modules(model) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def full_gradients(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as a full tensor on every rank (zeros where none); a collective."""
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        out[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return {name: g.detach().clone() for name, g in out.items()}


def parameter_bytes(model) -> int:
    """Bytes of parameters this rank holds (its shards, for a sharded model)."""
    total = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.element_size()
    return total
