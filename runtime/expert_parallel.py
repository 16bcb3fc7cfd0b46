"""Expert parallelism (EP) for the MoE layers: the routed experts sharded over the "ep" dimension of a
DeviceMesh, tokens sent to their experts' ranks with all-to-all and their outputs sent back.

Mesh. `expert_parallel_mesh(world, ep, device)` is a 2-D mesh ("dp", "ep") of shape (world / ep, ep):
the ranks of one "ep" row (consecutive ranks) hold different experts; the ranks of one "dp" column
hold the same experts. Every rank still runs its own microbatches of the plan (compile with
dp_size = world): EP changes where expert compute runs, not which data a rank owns.

Parameters. Each MoE block's `experts` becomes an `ExpertParallelExperts` with the same parameter
names (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]), now DTensors sharded on dim 0 over "ep":
a rank holds E / ep consecutive experts. `shard_expert_parallel` then applies FSDP2 twice:
`fully_shard(experts, mesh["dp"])` shards those local experts further over the replicas (their
gradients are summed over "dp" only: each rank's autograd already gives its experts the gradient of
every token that reached them from its "ep" row), and `runtime.fsdp.shard_model` shards everything
else over all ranks (the flattened mesh), summing over all of them. DTensor keeps the global shapes,
so `full_tensor()`, DCP checkpoints (`runtime.checkpoint`) and `export_pretrained` see the whole model
under its usual names and a checkpoint loads back into a plain TreeModel or another layout.

Forward of one block on every rank (all ranks of an "ep" row must call it together; the data-parallel
step's padding forwards of empty slots make sure they do):
  1. routing is local (router, top-k, statistics: `RouterStats` are computed by the block from its own
     tokens' multiplicities exactly as without EP, so the aux loss and expert load do not change);
  2. the (token, slot) assignments sorted by expert are already grouped by destination rank; one
     all-to-all of the per-expert counts tells each rank how many rows it receives from each source;
  3. all-to-all of the rows (autograd: its backward is the reverse all-to-all), regroup the received
     rows by local expert (stable: source rank, then source order), the local experts' SwiGLU,
     undo the regrouping, all-to-all back;
  4. routing weights and the sum over each token's k slots on the token's own rank, as without EP.
Step 2 reads the counts back to the host (the split sizes of the all-to-all): one small device read per
MoE layer and forward, which EP with variable token counts cannot avoid.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ..codegen.kernels.moe_combine import moe_combine, moe_dispatch
from .moe import Experts, expert_ffn, sort_by_expert

MESH_DIMS = ("dp", "ep")


def expert_parallel_mesh(world_size: int, ep: int, device_type: str) -> DeviceMesh:
    """A 2-D mesh ("dp", "ep") of shape (world_size / ep, ep) over every rank of the default group."""
    if ep < 1 or world_size % ep:
        raise ValueError(f"ep={ep} must be a positive divisor of the world size {world_size}")
    return init_device_mesh(device_type, (world_size // ep, ep), mesh_dim_names=MESH_DIMS)


class ExpertParallelExperts(nn.Module):
    """`moe.Experts` with its experts sharded over an "ep" mesh dimension (module docstring)."""

    def __init__(self, experts: Experts, ep_mesh: DeviceMesh):
        super().__init__()
        ep = ep_mesh.size()
        if experts.num_experts % ep:
            raise ValueError(f"expert parallelism: num_experts={experts.num_experts} is not divisible by ep={ep}")
        self.num_experts = experts.num_experts
        self.local_experts = experts.num_experts // ep
        self.ep_mesh = ep_mesh
        # distribute_tensor scatters from the first rank of each "ep" row: one set of weights per row
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name).detach()
            setattr(self, name, nn.Parameter(distribute_tensor(full, ep_mesh, [Shard(0)])))

    def forward(self, x: torch.Tensor, top_index: torch.Tensor, top_weight: torch.Tensor,
                shared: torch.Tensor | None = None, shared_logit: torch.Tensor | None = None) -> torch.Tensor:
        group = self.ep_mesh.get_group()
        ep, local = self.ep_mesh.size(), self.local_experts
        routing = sort_by_expert(top_index, self.num_experts)
        # counts[s * local + j]: rows this rank sends to rank s's expert j (expert s * local + j)
        received = torch.empty_like(routing.counts)
        dist.all_to_all_single(received, routing.counts, group=group)
        received = received.view(ep, local)  # [source rank, local expert]
        send_splits = routing.counts.view(ep, local).sum(1).tolist()
        recv_splits = received.sum(1).tolist()

        rows = _exchange(moe_dispatch(x, routing.token_of, routing.position), recv_splits, send_splits, group)
        # received rows: by source, then by local expert within a source; regroup by local expert
        local_expert = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(received.reshape(-1))
        regroup = torch.argsort(local_expert, stable=True)
        hidden = expert_ffn(rows[regroup], _local(self.gate_up_proj), _local(self.down_proj), received.sum(0))
        hidden = torch.index_copy(torch.empty_like(hidden), 0, regroup, hidden)
        hidden = _exchange(hidden, send_splits, recv_splits, group)
        return moe_combine(hidden, routing.position, top_weight, shared, shared_logit)


def _exchange(rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """all_to_all_single with autograd (the backward sends the gradients back the reverse way)."""
    return wait_tensor(all_to_all_single_autograd(rows.contiguous(), output_splits, input_splits, group))


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a (gathered) expert parameter; differentiable."""
    return param.to_local() if isinstance(param, DTensor) else param


def expert_modules(model) -> list[nn.Module]:
    """The `experts` of every MoE block of a TreeModel (Qwen SparseMoeBlock and Kimi KimiMoeBlock alike)."""
    return [layer.mlp.experts for layer in model.model.layers if getattr(layer, "is_moe", False)]


def apply_expert_parallel(model, ep_mesh: DeviceMesh):
    """Replace every MoE block's experts with `ExpertParallelExperts` over `ep_mesh`, in place; every rank
    must hold the same weights. Returns the model."""
    moe_layers = [layer for layer in model.model.layers if getattr(layer, "is_moe", False)]
    if not moe_layers:
        raise ValueError("expert parallelism: the model has no MoE layers")
    for layer in moe_layers:
        if not isinstance(layer.mlp.experts, ExpertParallelExperts):
            layer.mlp.experts = ExpertParallelExperts(layer.mlp.experts, ep_mesh)
    return model


def shard_expert_parallel(model, mesh: DeviceMesh, **shard_options):
    """Expert parallelism over mesh["ep"], FSDP2 for the experts over mesh["dp"] and for everything else
    over all ranks; in place, returns the model (an FSDPModule). `shard_options` go to `fsdp.shard_model`
    (mp_policy, cpu_offload, reshard_after_forward) and to the experts' `fully_shard` alike."""
    from . import fsdp

    if tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
        raise ValueError(f"shard_expert_parallel: expects a mesh with dimensions {MESH_DIMS} "
                         f"(expert_parallel_mesh), got {mesh.mesh_dim_names}")
    apply_expert_parallel(model, mesh["ep"])
    return fsdp.shard_model(model, mesh._flatten("dp_ep"), expert_mesh=mesh["dp"], **shard_options)
