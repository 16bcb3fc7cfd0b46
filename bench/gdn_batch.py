"""Gated DeltaNet alone on generated agentic batches.

Tree mode runs the planner's microbatches of a `harts gen` batch as the runtime does: each microbatch's GDN
plan (`plan_tree_gdn`: several rounds, replay rows, state hand-offs, exports and injected gradients), built on
the host and uploaded outside the timed step, run by `gated_delta_rule` (CUDA) or its plain-torch reference
(`plan_gated_delta_rule_reference`, elsewhere); trajectory-wise runs the
same trajectories each as its own sequence, both fwd+bwd of the GDN rule only (random q/k/v/g/beta per
microbatch, shapes of BENCH_MODEL's GDN layers: 16 key heads, 32 value heads, K = V = 128, bf16). The
ratio against the ideal (trajectory tokens / compact tokens of the same batch) isolates the linear
attention's share of the end-to-end gap.

    PYTHONUNBUFFERED=1 python bench/gdn_batch.py                  # H200: swe and tau2
    python bench/gdn_batch.py --device cpu --tiny                  # smoke test (plain-torch reference)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (LENGTH_SCALE, TINY_GENERATOR, format_table, forward_units, kernel_ms,  # noqa: E402
                    plan_microbatches, prefix_forest, sized_batch, trajectory_microbatches)
from gdn_cases import CONFIG_VARIANTS, tree_batch, tree_cases  # noqa: E402

from harts_compiler.codegen.kernels.chunk_gdn import gated_delta_rule, plan_gated_delta_rule_reference  # noqa: E402
from harts_compiler.codegen.lower import gdn_plan  # noqa: E402
from harts_compiler.codegen.kernels.upload import to_device  # noqa: E402


def gdn_inputs(tokens: int, heads: tuple[int, int], dims: tuple[int, int], device, dtype, seed: int):
    """Leaves q, k [T, HK, K], v [T, HV, V], g (fp32), beta [T, HV] with Qwen3-Next-like gate magnitudes."""
    gen = torch.Generator(device).manual_seed(seed)
    (hk, hv), (kd, vd) = heads, dims
    q = torch.randn(tokens, hk, kd, device=device, generator=gen).to(dtype)
    k = torch.randn(tokens, hk, kd, device=device, generator=gen).to(dtype)
    v = torch.randn(tokens, hv, vd, device=device, generator=gen).to(dtype)
    g = -(torch.rand(tokens, hv, device=device, generator=gen) * 2.8).exp() * 0.05
    beta = torch.rand(tokens, hv, device=device, generator=gen).to(dtype)
    return [t.requires_grad_(True) for t in (q, k, v, g, beta)]


def gdn_step(index, args, seed: int, config=None):
    """One fwd+bwd of the GDN rule over `index`'s rounds (the plan lowered and uploaded outside, as the runtime
    does once per microbatch for all layers): the Triton kernels on CUDA, the torch reference elsewhere. A later
    piece of a split tree starts sequences from states an earlier piece carried over: random fp32 states here,
    differentiated as the runtime does, and the replay rows it reads from earlier pieces follow its own rows."""
    plan = to_device(gdn_plan(index, config), args.device)
    run = gated_delta_rule if args.device.type == "cuda" else plan_gated_delta_rule_reference
    leaves = gdn_inputs(plan.num_tokens, args.heads, args.dims, args.device, args.dtype, seed=seed)
    do = torch.randn(plan.num_tokens, args.heads[1], args.dims[1], device=args.device, dtype=args.dtype)
    carried = None
    if plan.num_initial:
        (_, hv), (kd, vd) = args.heads, args.dims
        carried = (0.1 * torch.randn(plan.num_initial, hv, kd, vd, device=args.device)).requires_grad_(True)
        leaves.append(carried)

    def step():
        o, _ = run(*leaves[:5], scale=args.dims[0] ** -0.5, plan=plan, initial_states=carried, use_qk_l2norm=True)
        torch.autograd.grad(o, leaves, do)
    return step


def microbatches_ms(indices, args, config=None) -> float:
    """Sum over microbatches of the median fwd+bwd ms."""
    return sum(kernel_ms(gdn_step(index, args, i, config), args.device) for i, index in enumerate(indices))


# other configurations, for --compare: gdn_cases.CONFIG_VARIANTS by short name
COMPARE = {name: config for name, (_, config) in CONFIG_VARIANTS.items()}


def chunk_count(indices, chunk_size: int = 64) -> int:
    """Chunks the chunk-parallel GDN kernels run over `indices`' rounds (each sequence rounds up)."""
    return sum(int(((r.cu_seqlens[1:] - r.cu_seqlens[:-1] + chunk_size - 1) // chunk_size).sum())
               for index in indices for r in index.rounds)


def scan_steps(indices) -> int:
    """Chunk steps on the scans' critical path, summed over microbatches: a launch lasts as long as its longest
    sequence, the launches of one lane (its own stream: a block of trees, `chunk_gdn.lanes`) run one after the
    other, and the lanes side by side, so a microbatch takes its slowest lane."""
    total = 0
    for index in indices:
        plan = gdn_plan(index)
        lanes = np.zeros(plan.num_lanes, np.int64)
        for launch in plan.launches:
            lanes[launch.lane] += launch.longest_chunks
        total += int(lanes.max(initial=0))
    return total


def run_preset(preset: str, args) -> dict:
    overrides = dict(TINY_GENERATOR[preset]) if args.tiny else {"scale": LENGTH_SCALE[preset]}
    scale = overrides.pop("scale")
    batch, tasks = sized_batch(preset, args.target_tokens, length_scale=scale, vocab_size=1000, seed=args.seed,
                               **overrides)
    return measure_batch(preset, batch, args.microbatch_tokens, args, tasks=tasks)


def run_trees(name: str, trees, args) -> dict:
    """bench/gdn.py's tree case `name` as the compiler plans it (one microbatch: the budget holds every
    trajectory), where gdn.py runs its hand-made two-round plan (two_level.py: every branch a new sequence)."""
    batch = tree_batch(trees, seed=args.seed)
    return measure_batch(name, batch, int(batch.lengths.sum()), args, tasks=len(trees))


def measure_batch(name: str, batch, budget: int, args, **extra) -> dict:
    shape = dict(chunk_size=64, conv_width=4)
    plan, tree_indices, *_ = plan_microbatches(batch, budget, args.device, **shape)
    tree_indices = forward_units(tree_indices)  # a tree in pieces: each piece, with its carried states
    traj_indices = trajectory_microbatches(batch, budget, **shape)
    distinct = prefix_forest(batch).num_tokens
    row = dict(preset=name, **extra, trajectory_tokens=plan.stats["trajectory_tokens"], compact=distinct,
               rounds=plan.stats["rounds"], ideal=plan.stats["trajectory_tokens"] / distinct)
    # the chunk-parallel kernels cost per chunk: each sequence of a round ends in a partial chunk and a branch
    # replays up to 63 rows, so the chunk ratio, not the token ratio, bounds tree mode's GDN speedup
    row["chunk_ratio"] = chunk_count(traj_indices) / chunk_count(tree_indices)
    # the two sequential scans, where latency-bound, cost per chunk step of their critical path instead
    row["scan_ratio"] = scan_steps(traj_indices) / scan_steps(tree_indices)
    row["sequences"] = [[r.num_sequences for r in index.rounds] for index in tree_indices]
    if args.chunks_only:
        print(f"[{name}] {row}", flush=True)
        return row
    row.update(traj_ms=microbatches_ms(traj_indices, args), tree_ms=microbatches_ms(tree_indices, args))
    row["of_ideal"] = row["traj_ms"] / row["tree_ms"] / row["ideal"]
    for variant in args.compare:  # tree mode under another launch configuration (COMPARE)
        row[f"{variant}_ms"] = microbatches_ms(tree_indices, args, config=COMPARE[variant])
        row[f"{variant}_of_ideal"] = row["traj_ms"] / row[f"{variant}_ms"] / row["ideal"]
    print(f"[{name}] {row}", flush=True)
    if args.profile and args.device.type == "cuda":  # where a tree microbatch's time goes, kernel by kernel
        from gdn_profile import compare
        largest = [max(indices, key=lambda ix: ix.num_tokens) for indices in (traj_indices, tree_indices)]
        print(f"[{name}] GPU ms per kernel, largest microbatch of each mode "
              f"({largest[0].num_tokens} / {largest[1].num_tokens} tokens, {len(largest[1].rounds)} rounds; "
              f"sequences per round {row['sequences'][tree_indices.index(largest[1])]})")
        compare({"traj": gdn_step(largest[0], args, 0), "tree": gdn_step(largest[1], args, 0)}, top=12)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="toy batches and heads (CPU smoke test)")
    p.add_argument("--presets", nargs="*", default=["swe", "tau2"], choices=sorted(LENGTH_SCALE))
    p.add_argument("--trees", nargs="*", default=[], metavar="WORD",
                   help="also bench/gdn.py's tree cases whose names contain a word (agentic, P16384, ...), planned "
                        "by the compiler as one microbatch")
    p.add_argument("--heads", type=int, nargs=2, default=None, metavar=("HK", "HV"),
                   help="GDN key / value heads (default 16 / 32 as BENCH_MODEL; bench/gdn.py runs 16 / 16)")
    p.add_argument("--target-tokens", type=int, default=None, help="trajectory tokens per batch (default 96k)")
    p.add_argument("--microbatch-tokens", type=int, default=16384)
    p.add_argument("--profile", action="store_true", help="per-kernel GPU ms of the largest microbatches (CUDA)")
    p.add_argument("--compare", nargs="*", default=[], choices=sorted(COMPARE),
                   help="also time tree mode with these configurations (COMPARE)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunks-only", action="store_true", help="only the token and chunk ratios (no timing, any device)")
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    args.target_tokens = args.target_tokens or (300 if args.tiny else 96 * 1024)
    heads, args.dims = ((1, 2), (16, 16)) if args.tiny else ((16, 32), (128, 128))
    args.heads = tuple(args.heads) if args.heads else heads
    args.dtype = torch.float32 if args.device.type == "cpu" else torch.bfloat16
    rows = [run_preset(preset, args) for preset in args.presets]
    rows += [run_trees(name, trees, args) for name, trees in tree_cases(args.trees) if args.trees]
    columns = [("preset", "preset"), ("trajectory_tokens", "traj tok"), ("compact", "distinct"),
               ("rounds", "rounds"), ("ideal", "ideal"), ("chunk_ratio", "chunk ratio"), ("scan_ratio", "scan ratio")]
    if args.chunks_only:
        print(format_table(rows, columns))
        return
    columns += [("traj_ms", "traj ms"), ("tree_ms", "tree ms"), ("of_ideal", "of ideal")]
    for name in args.compare:
        columns += [(f"{name}_ms", f"{name} ms"), (f"{name}_of_ideal", "of ideal")]
    print(format_table(rows, columns))


if __name__ == "__main__":
    main()
