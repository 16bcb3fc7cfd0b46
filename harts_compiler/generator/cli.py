"""`harts gen` command line."""
from __future__ import annotations

import argparse

from harts_compiler.errors import InputError

from .presets import PRESETS
from .rollouts import generate, write_jsonl
from .stats import batch_stats


def gen_main(argv: list[str]) -> int:
    """`harts gen`: generate a batch, write it as JSONL, print its statistics."""
    parser = argparse.ArgumentParser(
        prog="harts gen", description="Generate a seeded agentic rollout batch as HARTS JSONL "
        "input (presets and their parameters: harts_compiler/generator.py).")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="swe")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tasks", type=int, help="tasks (groups) in the batch")
    parser.add_argument("--rollouts", type=int, help="rollouts per task (group size)")
    parser.add_argument("--scale", type=float, help="multiply every length (tiny batches: 0.01)")
    parser.add_argument("--max-context", type=int, help="context limit of a rollout (tokens)")
    parser.add_argument("--turns", type=int, nargs=2, metavar=("MIN", "MAX"))
    parser.add_argument("--fork-prob", type=float)
    parser.add_argument("--edit-prob", type=float)
    parser.add_argument("--vocab-size", type=int)
    parser.add_argument("--form", choices=["flat", "trees"], default="flat")
    parser.add_argument("-o", "--output", help="output JSONL path (default: statistics only)")
    args = parser.parse_args(argv)
    overrides = {name: getattr(args, name) for name in
                 ("tasks", "rollouts", "scale", "max_context", "fork_prob", "edit_prob",
                  "vocab_size") if getattr(args, name) is not None}
    if args.turns is not None:
        overrides["turns"] = tuple(args.turns)
    try:
        batch = generate(args.preset, args.seed, **overrides)
    except ValueError as error:  # bad preset parameters: the CLI's one InputError path (exit 2)
        raise InputError(str(error)) from None
    if args.output:
        write_jsonl(batch, args.output, args.form)
    print(f"preset {args.preset}, seed {args.seed}"
          + (f", written to {args.output} ({args.form})" if args.output else ""))
    for line in batch_stats(batch.trajectories).lines():
        print(line)
    return 0

