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


def agentic_batch(seed: int = 0, vocab_size: int = 128) -> TreeBatch:
    """The demo's default: SWE-agent-like rollout trees from the generator (`harts gen --preset
    swe`), shrunk to run on a CPU in seconds, plus the hand-made corner cases of `example_batch`
    (a trajectory that is a strict prefix of another, a duplicate trajectory)."""
    from .generator import generate

    rollouts = generate("swe", seed=seed, tasks=2, rollouts=8, scale=0.02, turns=(4, 8),
                        vocab_size=vocab_size).trajectories
    corner = example_batch(seed, groups=1, rollouts=3, vocab_size=vocab_size)
    corner_lists = [corner.tokens[a:b] for a, b in zip(corner.offsets[:-1], corner.offsets[1:])]
    token_lists = [tokens for _, tokens in rollouts] + corner_lists
    ids = [name for name, _ in rollouts] + [f"corner/{i}" for i in corner.ids]
    return TreeBatch.from_trajectories(token_lists, ids)


def demo_main(argv: list[str]) -> int:
    """Compile the built-in batch, run it in tree mode and trajectory-wise on a tiny random
    Qwen3-Next (forward + backward), and print what was verified."""
    from . import CompileOptions, compile
    from .commands import format_summary
    from .errors import cannot_write
    from .verify import add_execution_arguments, setup_execution, verify_plan

    parser = argparse.ArgumentParser(prog="harts demo", description=demo_main.__doc__)
    add_execution_arguments(parser)  # --quiet among them: no progress bars
    parser.add_argument("--dp-size", type=int, default=1, help="data-parallel ranks to plan for (default: 1)")
    parser.add_argument("--dump-ir", metavar="DIR", help="write a .hir after every pass")
    args = parser.parse_args(argv)
    model, memory_limit = setup_execution(args)
    batch = agentic_batch(args.seed, vocab_size=model.config.vocab_size)
    options = CompileOptions.for_model(model, chunk_size=args.chunk_size, dp_size=args.dp_size,
                                       microbatch_tokens=args.microbatch_tokens)
    with cannot_write("--dump-ir", args.dump_ir):  # a file of that name, a folder that cannot be created
        plan = compile(batch, options, dump_ir=args.dump_ir)
    print(f"built-in agentic batch (seed {args.seed}): {len(batch)} trajectories\n")
    print(format_summary(plan))
    print(f"\nmodel: {args.model} ({sum(p.numel() for p in model.parameters()):,} parameters, random weights), "
          f"forward + backward in tree mode and trajectory-wise:", flush=True)
    report = verify_plan(model, batch, plan, seed=args.seed, activation_checkpointing=args.checkpointing,
                         microbatch_tokens=args.microbatch_tokens, memory_limit=memory_limit, quiet=args.quiet,
                         error_factor=args.error_factor)
    print(report.format())
    return 0 if report.passed else 1
