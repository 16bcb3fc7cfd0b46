"""Bytes per rank of the benchmark model (bench/common.py, 2.25B parameters) sharded with FSDP2, and with
expert parallelism, next to one unsharded replica: parameters, gradients and AdamW state.

No GPU and no weights: every rank builds the model on the meta device and shards it with the project's
own functions (`runtime.fsdp.shard_model`, `runtime.expert_parallel.shard_expert_parallel`) over a gloo
CPU mesh; the sizes are read from the layout FSDP2 built (each parameter's local shard and the padded
storage behind it), not from a formula. The recipe counted is `runtime.fsdp.mixed_precision()` on fp32
weights, as examples/grpo_fsdp2.py trains on GPUs:
  fp32 params   the sharded master parameters, as stored (FSDP2 pads dim 0 to a multiple of the ranks);
  bf16 gathered the compute copies FSDP2 all-gathers: the root's (kept gathered, reshard_after_forward
                False) plus the two largest decoder layers' (the running one and the prefetched one);
                with expert parallelism a layer gathers only its rank's experts. Transient, held at the peak;
  fp32 grads    the sharded gradients (reduce_dtype fp32: views of the padded reduce-scatter output);
  AdamW         exp_avg and exp_avg_sq, fp32, at the unpadded local shapes (the 0-dim step counters,
                4 bytes per tensor, are left out);
  replica       one unsharded copy: fp32 params + fp32 grads + AdamW's two moments, 16 bytes a parameter.
Not counted: activations (the tree step's activation peak is what `harts compile --model` and
bench/e2e.py report), a layer's unsharded gradients before its reduce-scatter, communication buffers.

    python bench/fsdp_memory.py --world-sizes 1,2,4,8 --ep 1,2,4
"""
from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import model_config  # noqa: E402

from harts_compiler.runtime import TreeModel  # noqa: E402
from harts_compiler.runtime.expert_parallel import expert_parallel_mesh, shard_expert_parallel  # noqa: E402
from harts_compiler.runtime.fsdp import data_parallel_mesh, mixed_precision, shard_model, sharded_modules  # noqa: E402

FP32, BF16 = 4, 2  # bytes per element
GATHERED_LAYERS = 2  # the layer that runs and the one FSDP2 prefetches


def group_sizes(module) -> tuple[int, int]:
    """(padded local elements, gathered elements) of the parameters `fully_shard(module)` manages."""
    group = module._get_fsdp_state()._fsdp_param_group
    if group is None:
        return 0, 0
    padded = sum(p.padded_sharded_param_size.numel() for p in group.fsdp_params)
    return padded, padded * group.mesh_info.shard_mesh_size


def layout_bytes(model) -> dict[str, int]:
    """This rank's bytes of a sharded model (module docstring), and the replica's."""
    local = sum(p.to_local().numel() for p in model.parameters())
    full = sum(p.numel() for p in model.parameters())
    padded = sum(group_sizes(m)[0] for m in sharded_modules(model))
    root_gathered = group_sizes(model)[1]
    layer_gathered = sorted(sum(group_sizes(m)[1] for m in sharded_modules(layer))
                            for layer in model.model.layers)
    gathered = root_gathered + sum(layer_gathered[-GATHERED_LAYERS:])
    return dict(local_elements=local, padded_elements=padded, full_elements=full,
                params=padded * FP32, gathered=gathered * BF16, grads=padded * FP32, adamw=2 * local * FP32,
                replica=full * (FP32 + FP32 + 2 * FP32))


def shard_meta_model(config, world_size: int, ep: int):
    """The model on the meta device, sharded as examples/grpo_fsdp2.py shards it on GPUs."""
    with torch.device("meta"):
        model = TreeModel(config, activation_checkpointing=False)
    options = dict(mp_policy=mixed_precision())
    if ep > 1:
        return shard_expert_parallel(model, expert_parallel_mesh(world_size, ep, "cpu"), **options)
    return shard_model(model, data_parallel_mesh(world_size, "cpu"), **options)


def layouts(config, world_size: int, ep: int) -> dict[str, int]:
    """This rank's `layout_bytes` under (world_size, ep); a collective of the default group."""
    row = layout_bytes(shard_meta_model(config, world_size, ep))
    dist.barrier()
    return row


def valid_eps(config, world_size: int, eps: list[int]) -> list[int]:
    """The expert-parallel sizes that divide both the world size and the expert count (1: plain FSDP2)."""
    return [ep for ep in eps if ep == 1 or (world_size % ep == 0 and config.num_experts % ep == 0)]


def _worker(rank: int, world_size: int, port: int, config, eps: list[int], results) -> None:
    torch.set_num_threads(1)  # meta tensors: no compute, only the processes' count matters
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        for ep in eps:
            results.put((ep, rank, layouts(config, world_size, ep)))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(config, world_size: int, eps: list[int]) -> dict[int, list[dict[str, int]]]:
    """{ep: [layout_bytes of rank 0, 1, ...]} from `world_size` spawned gloo processes."""
    eps = valid_eps(config, world_size, eps)
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(world_size, _free_port(), config, eps, results), nprocs=world_size)
    rows: dict[int, list] = {ep: [None] * world_size for ep in eps}
    while not results.empty():
        ep, rank, row = results.get()
        rows[ep][rank] = row
    return rows


def gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def table(rows_by_world: dict[int, dict[int, list[dict[str, int]]]]) -> str:
    """One line per (ranks, ep): the largest rank's bytes (GiB) and how much the ranks differ."""
    columns = ("params", "gathered", "grads", "adamw")
    head = (f"{'ranks':>5} {'ep':>3} {'fp32 params':>11} {'bf16 gathered':>13} {'fp32 grads':>10} "
            f"{'AdamW':>7} {'total':>7} {'replica':>8} {'replica/total':>13} {'rank spread':>11}")
    lines = [head]
    for world_size, by_ep in rows_by_world.items():
        for ep, ranks in by_ep.items():
            totals = [sum(r[c] for c in columns) for r in ranks]
            top = ranks[totals.index(max(totals))]
            spread = max(totals) - min(totals)
            lines.append(f"{world_size:>5} {ep:>3} {gib(top['params']):>11} {gib(top['gathered']):>13} "
                         f"{gib(top['grads']):>10} {gib(top['adamw']):>7} {gib(max(totals)):>7} "
                         f"{gib(top['replica']):>8} {top['replica'] / max(totals):>12.2f}x "
                         f"{spread / 2**20:>8.2f} MiB")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", default="1,2,4,8", help="comma-separated numbers of ranks")
    parser.add_argument("--ep", default="1,2,4", help="comma-separated expert-parallel sizes (1: FSDP2 only)")
    parser.add_argument("--tiny", action="store_true", help="the tiny CPU model instead of the 2.25B one")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    config = model_config(tiny=args.tiny)
    eps = [int(e) for e in args.ep.split(",")]
    rows = {n: measure(config, n, eps) for n in (int(w) for w in args.world_sizes.split(","))}
    full = next(iter(next(iter(rows.values())).values()))[0]["full_elements"]
    print(f"{full / 1e9:.3f}B parameters, {config.num_experts} experts; bytes per rank (GiB), the largest rank")
    print(table(rows))


if __name__ == "__main__":
    main()
