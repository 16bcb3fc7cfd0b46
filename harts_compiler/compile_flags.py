"""The `CompileOptions` flags of the commands that compile a JSONL batch (`harts compile`, `harts show`): one
table, so every command spells, explains and defaults them alike (the defaults are CompileOptions' own)."""
from __future__ import annotations

import argparse

# flag -> (CompileOptions field, type, metavar, help)
COMPILE_FLAGS = {
    "--chunk-size": ("chunk_size", int, "C", "tokens per linear-attention chunk (the GDN kernels' 64)"),
    "--conv-width": ("conv_width", int, "W", "short-convolution width of the linear-attention layers"),
    "--microbatch-tokens": ("microbatch_tokens", int, "TOKENS", "compact-token budget of one microbatch (what one "
                            "forward+backward fits on a GPU); without it each rank's trees form one microbatch"),
    "--dp-size": ("dp_size", int, "RANKS", "data-parallel ranks to spread the trees over"),
    "--vocab-size": ("vocab_size", int, "V", "refuse token ids >= this (the model's vocabulary)"),
    "--objective": ("objective", str, "NAME", "schedule objective: sum_of_slot_max (ranks run slots in lockstep) "
                    "or max_rank_total"),
    "--schedule-time-limit": ("schedule_time_limit_s", float, "SECONDS",
                              "CP-SAT planner time limit (the greedy plan is the fallback)"),
    "--cost-model": ("cost_model", str, "JSON",
                     "fitted cost model (default: the repository's H200 fit; a process on an H100 reads the H100 fit)"),
    "--linear-layers": ("linear_layers", int, "N", "the model's linear-attention layers (cost model)"),
    "--full-layers": ("full_layers", int, "N", "the model's full-attention layers (cost model)"),
}


def add_compile_options(parser: argparse.ArgumentParser, *, only_given: bool = False) -> None:
    """Adds every flag of COMPILE_FLAGS. `only_given=True`: flags left out do not appear in the parsed namespace
    (a command can then tell what the user set); their help still names CompileOptions' default."""
    from .options import CompileOptions

    fields = CompileOptions.model_fields
    for flag, (name, kind, metavar, text) in COMPILE_FLAGS.items():
        default = fields[name].default
        if only_given:
            shown = text if "default" in text or default is None else f"{text} (default: {default})"
            parser.add_argument(flag, dest=name, type=kind, metavar=metavar, default=argparse.SUPPRESS, help=shown)
        else:
            parser.add_argument(flag, dest=name, type=kind, metavar=metavar, default=default, help=text)


def given_options(args: argparse.Namespace) -> dict:
    """The CompileOptions fields the parsed `args` hold."""
    return {name: getattr(args, name) for name, *_ in COMPILE_FLAGS.values() if hasattr(args, name)}
