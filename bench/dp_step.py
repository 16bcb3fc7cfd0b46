"""Data-parallel training step over a planned batch: per-rank, per-slot times and balance.

    python bench/dp_step.py --device cpu --tiny                    # 2 gloo ranks on CPU (smoke)
    PYTHONUNBUFFERED=1 python bench/dp_step.py --world-size 2      # 2 GPUs, NCCL, bench model
    PYTHONUNBUFFERED=1 python bench/dp_step.py --world-size 8 --ep 8   # + experts split over 8 GPUs

Spawns `--world-size` processes (one GPU each, or gloo on CPU). Each builds the same model
(`common.build_model`, rank 0's weights broadcast to be sure), compiles the same generated batch
with dp_size = world size, and runs `--warmup` + `--repeat` steps of
`runtime.distributed.data_parallel_step` on an FSDP2-sharded model (on-policy PPO loss, random
per-trajectory advantages).

Printed per step kind (rank 0, median step): per slot and rank the compact tokens and compute
seconds; the lockstep time sum over slots of the slowest rank's compute; the averaging bound
(total compute / ranks); the imbalance = lockstep / bound - 1 (FSDP2's gradient reduce-scatter is
part of the backward); the end-of-step all-reduce time of the last rank to arrive (the others' include waiting); the
step wall time. JSON goes to $OUT/dp_step.json when OUT is set (and to --json).
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_model, describe_device, model_config, parameter_count, sized_batch, write_json  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the runtime's tiny-qwen3-next preset")
    parser.add_argument("--preset", default="swe", help="generator preset (swe, tau2, grpo)")
    parser.add_argument("--length-scale", type=float, default=0.1)
    parser.add_argument("--target-tokens", type=int, default=196_608)
    parser.add_argument("--microbatch-tokens", type=int, default=32_768)
    parser.add_argument("--sync", choices=["step", "slot"], default="step")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (runtime/expert_parallel.py)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.tiny:  # toy sizes: several small trees (one generated task is one tree)
        args.length_scale = min(args.length_scale, 0.005)
        args.target_tokens = min(args.target_tokens, 16384)
        args.microbatch_tokens = min(args.microbatch_tokens, 1024)
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, args, port: int, result_path: str) -> None:
    import harts_compiler
    from harts_compiler.runtime.distributed import data_parallel_step
    from harts_compiler.runtime.expert_parallel import expert_parallel_mesh, shard_expert_parallel
    from harts_compiler.runtime.fsdp import data_parallel_mesh, shard_model
    from harts_compiler.runtime.dp_inputs import TrajectoryInputs
    from harts_compiler.runtime.dp_objective import PPOObjective

    cuda = args.device == "cuda"
    device = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.world_size))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=args.world_size,
                            timeout=datetime.timedelta(minutes=5))
    try:
        config = model_config(args.tiny)
        dtype = torch.bfloat16 if cuda else torch.float32
        model = build_model(config, device, dtype, checkpointing=not args.tiny)
        with torch.no_grad():
            for p in model.parameters():
                dist.broadcast(p, src=0)
        parameters = parameter_count(model)  # before sharding: the whole model
        if args.ep > 1:  # experts over "ep" ranks (all-to-all), FSDP2 for the rest
            shard_expert_parallel(model, expert_parallel_mesh(args.world_size, args.ep, device.type))
        elif args.world_size > 1:  # FSDP2: each rank holds a shard; data_parallel_step refuses a replica
            shard_model(model, data_parallel_mesh(args.world_size, device.type))
        batch, tasks = sized_batch(args.preset, args.target_tokens, length_scale=args.length_scale,
                                   vocab_size=config.vocab_size)
        start = time.perf_counter()
        plan = harts_compiler.compile(batch, harts_compiler.CompileOptions(
            chunk_size=64, conv_width=config.linear_conv_kernel_dim, dp_size=args.world_size,
            microbatch_tokens=args.microbatch_tokens))
        compile_s = time.perf_counter() - start
        rng = np.random.default_rng(0)
        inputs = TrajectoryInputs.for_plan(
            plan, advantages={i: float(a) for i, a in
                              zip(plan.program.forest.traj_ids, rng.normal(size=len(batch)))})
        objective = PPOObjective(aux_loss_coef=config.router_aux_loss_coef)
        steps = []
        for _ in range(args.warmup + args.repeat):
            if cuda:
                torch.cuda.synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            result = data_parallel_step(model, plan, inputs, objective, sync=args.sync,
                                        gather_metrics=True)
            steps.append((time.perf_counter() - start, result))
        if rank == 0:
            timed = steps[args.warmup:]
            step_s, result = sorted(timed, key=lambda t: t[0])[len(timed) // 2]
            payload = dict(args=vars(args), device=describe_device(device),
                           parameters=parameters, tasks=tasks,
                           plan=dict(plan.stats, compile_s=compile_s),
                           step_s=[t for t, _ in timed], median_step_s=step_s,
                           loss=result.loss, ranks=[_rank_dict(m) for m in result.all_ranks])
            torch.save(payload, result_path)
    finally:
        dist.destroy_process_group()


def _rank_dict(metrics) -> dict:
    return dict(rank=metrics.rank, reduce_s=metrics.reduce_s, total_s=metrics.total_s,
                slots=[dict(vars(s), compute_s=s.compute_s) for s in metrics.slots])


def summarise(payload: dict) -> dict:
    ranks = payload["ranks"]
    n_slots = len(ranks[0]["slots"])
    slot_max = [max(r["slots"][s]["compute_s"] for r in ranks) for s in range(n_slots)]
    total = sum(s["compute_s"] for r in ranks for s in r["slots"])
    bound = total / len(ranks)
    lockstep = sum(slot_max)
    return dict(slots=n_slots, lockstep_compute_s=lockstep, averaging_bound_s=bound,
                imbalance=lockstep / bound - 1 if bound else 0.0,
                # the last rank to arrive waits least: its time is the collective's own cost
                reduce_s=min(r["reduce_s"] for r in ranks),
                reduce_with_wait_s=max(r["reduce_s"] for r in ranks),
                median_step_s=payload["median_step_s"])


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        raise SystemExit(f"--world-size {args.world_size} needs that many GPUs "
                         f"(found {torch.cuda.device_count()}); use --device cpu for gloo")
    result_path = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"dp_step_{os.getpid()}.pt")
    mp.start_processes(rank_main, args=(args, _free_port(), result_path), nprocs=args.world_size,
                       join=True, start_method="spawn")
    payload = torch.load(result_path, weights_only=False)
    os.remove(result_path)
    payload["summary"] = summarise(payload)
    plan = payload["plan"]
    print(f"model {payload['parameters'] / 1e6:.1f}M params on {payload['device']}; "
          f"{plan['trajectories']} trajectories, {plan['trajectory_tokens']} tokens, "
          f"compact {plan['compact_tokens']} ({plan['compression']}x), compile {plan['compile_s']:.2f}s")
    print("slot  " + "  ".join(f"rank{r['rank']}: tokens   compute_s" for r in payload["ranks"]))
    for s in range(payload["summary"]["slots"]):
        cells = [f"{r['slots'][s]['compact_tokens']:>13d} {r['slots'][s]['compute_s']:>11.3f}"
                 for r in payload["ranks"]]
        print(f"{s:>4}  " + "  ".join(cells))
    summary = payload["summary"]
    print(f"lockstep compute {summary['lockstep_compute_s']:.3f}s vs averaging bound "
          f"{summary['averaging_bound_s']:.3f}s (imbalance {summary['imbalance']:.1%}); "
          f"end-of-step sums {summary['reduce_s']:.3f}s ({summary['reduce_with_wait_s']:.3f}s with waiting; "
          f"FSDP2's gradient reduce-scatter runs inside the backward); "
          f"step median {summary['median_step_s']:.3f}s of {statistics.fmean(payload['step_s']):.3f}s mean")
    for path in write_json("dp_step.json", payload, args.json):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
