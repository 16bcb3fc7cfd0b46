"""Planner benchmark: (rank, slot) assignment of generated batches through the real pipeline.

For each generator preset, `--trees` task trees (default 1,000) are generated and compiled with
`harts_compiler.compile` (prefix-compress, layout, replay-min, cut-pieces) under the
microbatch budget, so the planner's items are exactly what the `schedule` pass assigns: the trees
(a tree over the budget runs as pieces and fills its (rank, slot) alone), each costed by the
cost model (`schedule.schedule_items`, the code the pass runs).

The batch is generated and compiled in chunks of `--chunk-trees` trees (trees are independent,
so a tree's items do not depend on the chunk it is in; one compile of 1,000 `swe` trees would
need ~30 GB). Chunk k uses generator seed `seed * 10_000 + k`. `--cache DIR` keeps the items of a
(preset, trees, budget, seed) in an .npz so reruns skip the compile.

`tau2` is generated with per-task system prompts: with one shared prompt the whole batch is a
single tree, one item.

Per preset it prints items, slots, the planning wall time (the OR-Tools import is warmed up
first), the plan's objective, the lower bound, the gap, the greedy plan's gap, the status and
whether the goal (within 3% of the bound in under 1 s) is met.

    python bench/planner.py                       # 1,000 trees per preset, 8 ranks, 64k budget
    python bench/planner.py --presets grpo --trees 200 --budget 32768 --json out.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from harts_compiler import CompileOptions, TreeBatch, compile
from harts_compiler.generator import generate
from harts_compiler.passes.assign import OBJECTIVES, assign
from harts_compiler.passes.cost_model import LayerCounts, load_cost_model
from harts_compiler.passes.schedule import schedule_items

PRESET_OVERRIDES = {"swe": {}, "tau2": {"shared_system": False}, "grpo": {}}
PIPELINE = ["prefix-compress", "layout", "replay-min", "cut-pieces"]  # all but schedule


def planner_inputs(program, options: CompileOptions) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, cost) of a compiled program's trees, exactly as `passes/schedule.py` computes them."""
    return schedule_items(program, options.microbatch_tokens or 0, load_cost_model(options.cost_model),
                          LayerCounts.stated(options.linear_layers, options.full_layers))


def planner_items(preset: str, trees: int, options: CompileOptions, seed: int,
                  chunk_trees: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """Items of a generated batch of `trees` trees, compiled chunk by chunk."""
    tokens, costs = [], []
    for chunk, first in enumerate(range(0, trees, chunk_trees)):
        rollouts = generate(preset, seed * 10_000 + chunk, tasks=min(chunk_trees, trees - first),
                            **PRESET_OVERRIDES[preset])
        ids, lists = zip(*rollouts.trajectories)
        batch = TreeBatch.from_trajectories(list(lists), [f"c{chunk}-{i}" for i in ids])
        del rollouts, lists
        plan = compile(batch, options, passes=PIPELINE)
        chunk_tokens, chunk_cost = planner_inputs(plan.program, options)
        tokens.append(chunk_tokens)
        costs.append(chunk_cost)
    return np.concatenate(tokens), np.concatenate(costs)


def cached_items(preset, trees, options, seed, chunk_trees, cache: str | None):
    if cache is None:
        return planner_items(preset, trees, options, seed, chunk_trees)
    path = Path(cache) / (f"{preset}-t{trees}-b{options.microbatch_tokens}-s{seed}"
                          f"-c{chunk_trees}-{options.cost_model or 'repo'}.npz")
    if path.exists():
        saved = np.load(path)
        return saved["tokens"], saved["cost"]
    tokens, cost = planner_items(preset, trees, options, seed, chunk_trees)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, tokens=tokens, cost=cost)
    return tokens, cost


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=["swe", "tau2", "grpo"])
    parser.add_argument("--trees", type=int, default=1000)
    parser.add_argument("--chunk-trees", type=int, default=100, help="trees per compile")
    parser.add_argument("--dp-size", type=int, default=8)
    parser.add_argument("--budget", type=int, default=65536, help="microbatch token budget")
    parser.add_argument("--time-limit", type=float, default=0.8, help="solver limit (s)")
    parser.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=OBJECTIVES)
    parser.add_argument("--cost-model", default=None,
                        help='cost-model JSON ("default": built-in guesses; none: the repo fit)')
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", help="directory for the compiled items (.npz per preset)")
    parser.add_argument("--json", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    options = CompileOptions(microbatch_tokens=args.budget, dp_size=args.dp_size, verify=False,
                             cost_model=args.cost_model)

    assign(np.array([1, 1, 1]), np.array([3.0, 2.0, 2.0]), token_budget=None, dp_size=2,
           time_limit_s=0.05)  # warm the OR-Tools import, which is paid once per process
    rows = []
    print(f"dp_size {args.dp_size}, budget {args.budget} tokens, time limit {args.time_limit} s, "
          f"{args.trees} trees per preset, seed {args.seed}")
    print(f"{'preset':6} {'objective':16} {'items':>6} {'slots':>5} {'plan s':>7} "
          f"{'objective':>12} {'bound':>12} {'gap':>7} {'greedy gap':>10} {'status':16} "
          f"{'method':13} det  goal")
    for preset in args.presets:
        start = time.perf_counter()
        tokens, cost = cached_items(preset, args.trees, options, args.seed, args.chunk_trees, args.cache)
        compiled = time.perf_counter() - start
        for objective in args.objectives:
            plan = assign(tokens, cost, token_budget=args.budget, dp_size=args.dp_size,
                          objective=objective, time_limit_s=args.time_limit, seed=args.seed)
            greedy_gap = plan.greedy_objective / plan.lower_bound - 1
            goal = plan.gap <= 0.03 and plan.wall_time_s < 1.0
            rows.append({"preset": preset, "items": len(tokens),
                         "trees": args.trees, "tokens": int(tokens.sum()),
                         "compile_s": compiled, "greedy_gap": greedy_gap, "goal_met": goal,
                         **plan.summary()})
            print(f"{preset:6} {objective:16} {len(tokens):6d} {plan.num_slots:5d} "
                  f"{plan.wall_time_s:7.3f} {plan.objective:12.1f} {plan.lower_bound:12.1f} "
                  f"{plan.gap:7.3%} {greedy_gap:10.3%} "
                  f"{plan.status:16} {plan.method:13} {'yes' if plan.deterministic else 'no ':4} "
                  f"{'met' if goal else 'MISSED'}", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    return 0 if all(row["goal_met"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
