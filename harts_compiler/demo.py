"""`harts demo`: compile a built-in seeded example batch; print its statistics and IR summary."""
from __future__ import annotations

import argparse

import numpy as np

from .batch import TreeBatch


def example_batch(seed: int = 0, groups: int = 3, rollouts: int = 4,
                  vocab_size: int = 1000) -> TreeBatch:
    """A small agentic batch: two system prompts shared across groups, a task per group, and
    multi-turn rollouts that fork from earlier rollouts of their group (plus one trajectory that
    is a strict prefix of another and one duplicate), with branch points on and off 64-token
    chunk boundaries."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, vocab_size, 150).tolist(), rng.integers(0, vocab_size, 90).tolist()]
    token_lists, ids = [], []
    for g in range(groups):
        task = systems[g % 2] + rng.integers(0, vocab_size, int(rng.integers(20, 90))).tolist()
        group: list[list[int]] = []
        for r in range(rollouts):
            if group and rng.random() < 0.6:
                parent = group[int(rng.integers(len(group)))]
                tokens = parent[:int(rng.integers(len(task), len(parent) + 1))]
            else:
                tokens = list(task)
            for _ in range(int(rng.integers(1, 4))):  # turns: response + tool output
                tokens += rng.integers(0, vocab_size, int(rng.integers(10, 120))).tolist()
            group.append(tokens)
            token_lists.append(tokens)
            ids.append(f"task{g}/rollout{r}")
        token_lists.append(group[0][:len(task) + 5])  # a strict prefix of rollout 0
        ids.append(f"task{g}/prefix")
    token_lists.append(list(token_lists[0]))  # a duplicate trajectory
    ids.append("task0/rollout0-again")
    return TreeBatch.from_trajectories(token_lists, ids)


def demo_main(argv: list[str]) -> int:
    from . import CompileOptions, compile
    from .commands import describe_program, format_summary

    parser = argparse.ArgumentParser(prog="harts demo", description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--dp-size", type=int, default=2)
    parser.add_argument("--microbatch-tokens", type=int, default=None)
    parser.add_argument("--dump-ir", metavar="DIR")
    args = parser.parse_args(argv)
    batch = example_batch(args.seed)
    options = CompileOptions.checked(chunk_size=args.chunk_size, dp_size=args.dp_size,
                                     microbatch_tokens=args.microbatch_tokens)
    plan = compile(batch, options, dump_ir=args.dump_ir)
    print(f"example batch (seed {args.seed}): {len(batch)} trajectories\n")
    print(format_summary(plan))
    print("\nIR after the last pass:")
    print(describe_program(plan.program))
    return 0
