"""`harts` command line: one table of subcommands, each `main(argv) -> exit code`.

Adding a command is one line in COMMANDS ("module:function" is imported only when run, so
`harts --help` stays fast). Bad input (InputError) prints one line per problem (the first
MAX_PROBLEMS_SHOWN, then how many more) and exits 2; so does running out of memory (one line, no traceback).
"""
from __future__ import annotations

import importlib
import os
import sys

MAX_PROBLEMS_SHOWN = 20  # a file with thousands of bad lines names the first ones, not all of them

COMMANDS: dict[str, tuple[str, str]] = {
    "compile": ("harts_compiler.commands:compile_main", "compile a JSONL batch into a plan"),
    "ir": ("harts_compiler.commands:ir_main", "pretty-print and validate a .hir dump"),
    "lower": ("harts_compiler.lower_cmd:lower_main", "show the launch plan a model runs for each microbatch"),
    "demo": ("harts_compiler.demo:demo_main", "built-in batch: compile, run tree vs trajectory-wise, verify"),
    "verify": ("harts_compiler.verify:verify_main", "check a batch's tree execution against trajectory-wise"),
    "bench": ("harts_compiler.commands:bench_main",
              "run a benchmark of bench/ (harts bench --help lists them; default e2e)"),
    "gen": ("harts_compiler.generator:gen_main", "generate a seeded rollout batch (JSONL)"),
    "show": ("harts_compiler.show:show_main", "print a plan's trees and rank x slot loads (--png: draw them)"),
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("harts-compiler")
    except PackageNotFoundError:  # run from a source tree that was not installed
        return "unknown (not installed)"


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: harts COMMAND [options]   (harts COMMAND --help for its options; harts --version)", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from .errors import InputError
    from .ir import ArtifactError

    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"harts {_version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"harts: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, _, function = COMMANDS[name][0].partition(":")
    command = getattr(importlib.import_module(module_name), function)
    try:
        return int(command(rest) or 0)
    except InputError as error:
        shown = error.problems[:MAX_PROBLEMS_SHOWN]
        for problem in shown:
            print(f"harts {name}: {problem}", file=sys.stderr)
        if len(error.problems) > len(shown):
            print(f"harts {name}: ... and {len(error.problems) - len(shown):,} more problems", file=sys.stderr)
        return 2
    except ArtifactError as error:  # a saved plan's files: the message names them
        print(f"harts {name}: {error}", file=sys.stderr)
        return 2
    except MemoryError as error:  # e.g. explicit trees whose trajectories expand past this machine's memory
        detail = f" ({' '.join(str(error).split())})" if str(error) else ""
        print(f"harts {name}: out of memory{detail}; the input is too large for this machine", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `harts ... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
