"""A few GRPO steps on several ranks: FSDP2-sharded TreeModel, optional expert parallelism, AdamW.

Every rank builds the same model, shards it (`runtime.fsdp.shard_model`, or with `--ep N`
`runtime.expert_parallel.shard_expert_parallel`: routed experts split over N ranks, tokens sent to
them by all-to-all), compiles the same generated rollout batch with dp_size = world size, and runs
`--steps` steps of `runtime.distributed.data_parallel_step` (GRPO: PPO-clip with group-normalised
advantages from seeded rewards, token-mean over the batch, MoE aux loss) followed by `AdamW.step()`.
Each step is on-policy on the same batch (the old log-probs are the current ones; a trainer passes
its rollout engine's as `TrajectoryInputs.for_plan(..., old_logprobs=...)`).

Printed by rank 0: the plan (trajectories, compression, microbatches per rank), per step the loss
and trajectory tokens/s, and per rank the bytes it holds of parameters + gradients + optimizer
state, next to what one unsharded replica holds (the same tensors at their global sizes); on CUDA
also `torch.cuda.max_memory_allocated` per rank.

    torchrun --nproc-per-node 2 examples/grpo_fsdp2.py --tiny            # CPU, gloo, tiny Qwen3-Next
    torchrun --nproc-per-node 2 examples/grpo_fsdp2.py --tiny --ep 2     # + experts split over 2 ranks
    torchrun --nproc-per-node 1 examples/grpo_fsdp2.py                   # 1 GPU (no sharding)
    torchrun --nproc-per-node 2 examples/grpo_fsdp2.py                   # 2 GPUs, NCCL
    torchrun --nproc-per-node 8 examples/grpo_fsdp2.py --ep 8            # 8 GPUs, 16 experts: 2 per GPU
    torchrun --nproc-per-node 8 examples/grpo_fsdp2.py --checkpoint DIR  # a Qwen3-Next / Qwen3.5 checkpoint
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import harts_compiler as hc
from harts_compiler.generator import generate
from harts_compiler.runtime import TreeModel
from harts_compiler.runtime.distributed import data_parallel_step, slot_schedule
from harts_compiler.runtime.dp_inputs import TrajectoryInputs, group_advantages
from harts_compiler.runtime.dp_objective import PPOObjective
from harts_compiler.runtime.expert_parallel import expert_parallel_mesh, shard_expert_parallel
from harts_compiler.runtime.fsdp import data_parallel_mesh, mixed_precision, shard_model

# The GPU default: Qwen3-Next's layer pattern (3 GDN : 1 gated attention) at 0.34B parameters,
# 16 experts top-4 + a shared expert, so that --ep 2/4/8 divide the experts.
GPU_MODEL = dict(
    model_type="qwen3_next", vocab_size=32768, hidden_size=1024, num_hidden_layers=8, full_attention_interval=4,
    num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=16,
    num_experts_per_tok=4, moe_intermediate_size=512, shared_expert_intermediate_size=512, intermediate_size=2816,
    norm_topk_prob=True, rms_norm_eps=1e-6, router_aux_loss_coef=0.001,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25})
LEARNING_RATE = 1e-3
ENTROPY_COEF = 1e-2  # an entropy bonus: on-policy, the PPO term alone has the value -mean(advantage)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny Qwen3-Next on the CPU (gloo), fp32")
    parser.add_argument("--checkpoint", help="a from_pretrained directory (default: a random model)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (divides the world size)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=None, help="GRPO groups (default: 2 per rank)")
    parser.add_argument("--rollouts-per-task", type=int, default=4)
    parser.add_argument("--scale", type=float, default=None, help="generator length scale")
    parser.add_argument("--microbatch-tokens", type=int, default=None,
                        help="compact tokens per microbatch (default: the largest tree's)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def init_distributed(tiny: bool) -> torch.device:
    """torchrun's environment -> the process group; one GPU per rank, or gloo on the CPU."""
    cuda = torch.cuda.is_available() and not tiny
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", 1))))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=10))
    return device


def build_model(args, device: torch.device) -> TreeModel:
    """The same weights on every rank (seeded init, or the checkpoint)."""
    checkpointing = device.type == "cuda"  # recompute each layer in the backward: activations dominate
    if args.checkpoint:
        model = TreeModel.from_pretrained(args.checkpoint, dtype=torch.float32, activation_checkpointing=checkpointing)
    else:
        model = TreeModel.from_config("tiny-qwen3-next" if args.tiny else GPU_MODEL, seed=args.seed,
                                      dtype=torch.float32, activation_checkpointing=checkpointing)
    return model.to(device=device, dtype=torch.float32)  # fp32 master weights; bf16 compute via FSDP2


def shard(model, args, world_size: int, device: torch.device):
    """FSDP2 (+ expert parallelism); bf16 compute with fp32 reduction on GPUs."""
    options = dict(mp_policy=mixed_precision() if device.type == "cuda" else None)
    if args.ep > 1:
        return shard_expert_parallel(model, expert_parallel_mesh(world_size, args.ep, device.type), **options)
    if world_size > 1:
        return shard_model(model, data_parallel_mesh(world_size, device.type), **options)
    return model  # one rank: nothing to shard (data_parallel_step runs it as it is)


def rollout_plan(args, model, world_size: int):
    """A generated swe-like batch, compiled for `world_size` ranks; GRPO groups are the tasks."""
    tasks = args.tasks or 2 * world_size
    scale = args.scale or (0.005 if args.tiny else 0.05)
    rollouts = generate("swe", args.seed, tasks=tasks, rollouts=args.rollouts_per_task, scale=scale,
                        turns=(2, 5), vocab_size=model.config.vocab_size)
    ids, lists = zip(*rollouts.trajectories)
    batch = hc.TreeBatch.from_trajectories([np.asarray(t, np.int64) for t in lists], list(ids))
    budget = args.microbatch_tokens or int(rollouts.tree_summary()["compact_tokens"].max())
    plan = hc.compile(batch, hc.CompileOptions.for_model(model, microbatch_tokens=budget, dp_size=world_size))
    rewards = np.random.default_rng(args.seed).random(len(ids))
    advantages = group_advantages(dict(zip(ids, rewards.tolist())), ids, [i.split("-")[0] for i in ids])
    return plan, TrajectoryInputs.for_plan(plan, advantages=advantages)


def held_bytes(model, optimizer) -> tuple[int, int]:
    """(bytes this rank holds, bytes one unsharded replica would hold) of parameters, gradients and
    optimizer state: the same tensors at their local and at their global sizes."""
    tensors = []
    for param in model.parameters():
        tensors += [param] + ([param.grad] if param.grad is not None else [])
        tensors += [t for t in optimizer.state.get(param, {}).values() if torch.is_tensor(t)]
    local = sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)
    return local, sum(t.numel() * t.element_size() for t in tensors)


def main(argv=None) -> None:
    args = parse_args(argv)
    device = init_distributed(args.tiny)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        model = shard(build_model(args, device), args, world_size, device)
        plan, inputs = rollout_plan(args, model, world_size)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
        objective = PPOObjective(aux_loss_coef=model.config.router_aux_loss_coef, entropy_coef=ENTROPY_COEF)
        stats = plan.stats
        if rank == 0:
            slots = [sum(mb is not None for mb in slot_schedule(plan, r)) for r in range(world_size)]
            print(f"{world_size} rank(s) on {device.type}, ep={args.ep}; {stats['trajectories']} trajectories, "
                  f"{stats['trajectory_tokens']} trajectory tokens, compression {stats['compression']:.2f}x, "
                  f"{len(slot_schedule(plan, 0))} slots, microbatches per rank {slots}", flush=True)
        for step in range(args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            result = data_parallel_step(model, plan, inputs, objective, time_device=False)
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
            if rank == 0:
                print(f"step {step}: loss {result.loss:.8f}  {stats['trajectory_tokens'] / seconds:,.0f} trajectory "
                      f"tokens/s ({seconds:.3f} s)", flush=True)
        local, replicated = held_bytes(model, optimizer)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, (local, replicated, peak))
        if rank == 0:
            for r, (local, replicated, peak) in enumerate(per_rank):
                extra = f", max_memory_allocated {peak / 2**20:,.1f} MiB" if peak is not None else ""
                print(f"rank {r}: parameters + gradients + AdamW state {local / 2**20:,.2f} MiB sharded vs "
                      f"{replicated / 2**20:,.2f} MiB replicated ({local / replicated:.1%}){extra}")
        # no rank tears its process group down while a peer still has collectives in flight (gloo's worker
        # threads would be destroyed mid-operation: an abort at exit); not on the error path, where a peer may
        # never arrive
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # After a clean shutdown (both ranks past destroy_process_group), about one gloo run in twenty still aborted
    # in the interpreter's teardown ("terminate called without an active exception": a torch background thread
    # destroyed while joinable). Nothing is left to do, so skip that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
