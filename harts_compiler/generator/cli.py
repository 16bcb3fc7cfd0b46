"""`harts gen` command line."""
from __future__ import annotations

import argparse

from harts_compiler.errors import InputError, cannot_write, check_output_file
from harts_compiler.cli_help import HelpFormatter
from harts_compiler.progress import add_quiet_argument

from .presets import PRESETS
from .rollouts import MAX_TRAJECTORY_TOKENS, generate, write_jsonl
from .stats import batch_stats


def gen_main(argv: list[str]) -> int:
    """`harts gen`: generate a batch, write it as JSONL, print its statistics."""
    parser = argparse.ArgumentParser(
        prog="harts gen", formatter_class=HelpFormatter,
        description="Generate a seeded agentic rollout batch as HARTS JSONL input. Every parameter left out "
        "takes the preset's value (the presets and their distributions: harts_compiler/generator/presets.py).")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="swe", help="workload shape: SWE agent, tau2 "
                        "tool use, GRPO groups")
    parser.add_argument("--seed", type=int, default=0, help="the same seed and parameters give the same batch")
    parser.add_argument("--tasks", type=int, help="tasks (groups) in the batch (preset's value)")
    parser.add_argument("--rollouts", type=int, help="rollouts per task, the group size (preset's value)")
    parser.add_argument("--scale", type=float, help="multiplies every length, max-context included (1.0; tiny "
                        "CPU batches: 0.002-0.01)")
    parser.add_argument("--max-context", type=int, help="tokens: a rollout takes no new turn once its context "
                        "passes this; its last turn may go beyond it (preset's value, times --scale)")
    parser.add_argument("--turns", type=int, nargs=2, metavar=("MIN", "MAX"), help="turns per rollout")
    parser.add_argument("--fork-prob", type=float, help="probability that a turn forks a sibling rollout")
    parser.add_argument("--edit-prob", type=float, help="probability that a fork rewrites the last turn")
    parser.add_argument("--vocab-size", type=int, help="token ids lie in [0, vocab-size) (151936, Qwen's; use "
                        "the model's: 128 for the tiny test models)")
    parser.add_argument("--form", choices=["flat", "trees"], default="flat",
                        help="one trajectory per line, or one explicit tree per line")
    parser.add_argument("-o", "--output", help="output JSONL path (default: statistics only)")
    add_quiet_argument(parser)
    args = parser.parse_args(argv)
    if args.output:
        check_output_file(args.output)
    overrides = {name: getattr(args, name) for name in
                 ("tasks", "rollouts", "scale", "max_context", "fork_prob", "edit_prob",
                  "vocab_size") if getattr(args, name) is not None}
    if args.turns is not None:
        overrides["turns"] = tuple(args.turns)
    try:
        batch = generate(args.preset, args.seed, quiet=args.quiet, **overrides)
    except ValueError as error:  # bad preset parameters: the CLI's one InputError path (exit 2)
        raise InputError(str(error)) from None
    trajectory_tokens = batch.trajectory_tokens()
    if trajectory_tokens > MAX_TRAJECTORY_TOKENS:  # the statistics below hold every trajectory's tokens
        raise InputError(f"scale/tasks/rollouts: the batch has {trajectory_tokens:,} trajectory tokens, over the "
                         f"{MAX_TRAJECTORY_TOKENS:,} gen handles (lower --scale, --tasks or --rollouts)")
    if args.output:
        with cannot_write("-o", args.output):
            write_jsonl(batch, args.output, args.form, quiet=args.quiet)
    print(f"preset {args.preset}, seed {args.seed}"
          + (f", written to {args.output} ({args.form})" if args.output else ""))
    for line in batch_stats(batch.trajectories).lines():
        print(line)
    return 0

