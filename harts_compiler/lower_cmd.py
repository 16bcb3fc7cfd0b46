"""`harts lower`: show the launch plan a model runs for each microbatch of a plan (codegen.lower's text dump)."""
from __future__ import annotations

import argparse
from pathlib import Path

from .cli_help import HelpFormatter
from .commands import model_config
from .errors import InputError

KERNELS = {"triton": ("cuda", "bfloat16"), "torch": ("cpu", "float64")}


def lower_main(argv: list[str]) -> int:
    import torch

    from . import CompileOptions, Plan, TreeBatch, compile
    from .codegen import format_launch_plan, lower
    from .runtime.backend import select_backend
    from .plan import is_saved_plan

    parser = argparse.ArgumentParser(prog="harts lower", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("input", help="a saved plan (.hir) or a JSONL batch (compiled for --model)")
    parser.add_argument("--model", default="tiny-qwen3-next", help="preset name or HF checkpoint directory "
                        "(only its config is read) (default: %(default)s)")
    parser.add_argument("--kernels", choices=sorted(KERNELS), default="triton",
                        help="lower for the Triton kernels (a bf16 model on CUDA) or the torch reference path "
                             "(default: %(default)s; no GPU is needed to look at either)")
    parser.add_argument("--microbatch", type=int, default=None, help="only this microbatch (default: all)")
    parser.add_argument("--microbatch-tokens", type=int, default=None, help="budget when compiling a JSONL batch")
    parser.add_argument("--brief", action="store_true", help="leave out the per-sequence lines")
    args = parser.parse_args(argv)
    config = model_config(args.model)
    path = Path(args.input)
    if is_saved_plan(path):
        plan = Plan.load_input(path)
        plan.options.check_model(config)
    else:
        plan = compile(TreeBatch.load(path), CompileOptions.for_model(config, microbatch_tokens=args.microbatch_tokens))
    device, dtype = KERNELS[args.kernels]
    target = select_backend(config, getattr(torch, dtype), torch.device(device))
    microbatches = plan.microbatches()
    if args.microbatch is not None:
        if not 0 <= args.microbatch < len(microbatches):
            raise InputError(f"--microbatch {args.microbatch}: the plan has {len(microbatches)} microbatches")
        microbatches = [microbatches[args.microbatch]]
    for mb in microbatches:
        try:
            launch = lower(mb.build_index(), target)
        except ValueError as error:
            raise InputError(f"microbatch {mb.index}: {error}") from None
        print(f"# microbatch {mb.index} (rank {mb.rank}, slot {mb.slot})")
        print(format_launch_plan(launch, sequences=not args.brief), end="")
    return 0
