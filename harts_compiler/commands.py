"""`harts compile` and `harts ir`."""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from .cli_help import HelpFormatter
from .errors import InputError, cannot_write
from .metadata import field_hints
from .progress import add_quiet_argument


STATUS_MEANING = {"OPTIMAL": "proven optimal", "FEASIBLE": "CP-SAT improved the greedy plan, not proven optimal",
                  "GREEDY_FALLBACK": "CP-SAT found nothing better within its time limit: the greedy plan"}


def format_summary(plan, stats: dict | None = None) -> str:
    stats = plan.stats if stats is None else stats
    lines = [
        f"trajectories       {stats['trajectories']:>12,}   -> {stats['trees']:,} trees, "
        f"{stats['nodes']:,} nodes",
        f"trajectory tokens  {stats['trajectory_tokens']:>12,}",
        f"compact tokens     {stats['compact_tokens']:>12,}   compression "
        f"{stats['compression']:.2f}x",
        f"attention pairs    {stats['attention_pairs']:>12,}   compression {stats['pair_compression']:.2f}x "
        f"(of {stats['trajectory_attention_pairs']:,} trajectory-wise; full attention's work shrinks by this)",
        f"replay tokens      {stats['replay_tokens']:>12,}   sequences {stats['sequences']:,}, "
        f"rounds (max per tree) {stats['rounds']}",
        "passes             " + ", ".join(f"{p['name']} {p['ms']:.1f} ms" for p in stats["passes"]),
    ]
    if "pieces" in stats:
        pieces = stats["pieces"]
        lines.append(f"pieces             {pieces['split_trees']:,} trees over the budget -> "
                     f"{pieces['pieces']:,} pieces of <= {pieces['max_piece_tokens']:,} tokens; carried context "
                     f"{pieces['context_tokens']:,} tokens, {pieces['cut_replay_rows']:,} replay rows at cuts "
                     "(no token computed twice)")
        for tree in pieces.get("memory", []):
            lines.append(f"  tree {tree['tree']}: {len(tree['pieces'])} pieces carry "
                         f"{tree['carried_bytes'] / 2**30:.2f} GiB, predicted peak "
                         f"{tree['predicted_peak_bytes'] / 2**30:.2f} GiB (bf16, recomputation); with "
                         f"offload_piece_inputs {tree['predicted_peak_offloaded_bytes'] / 2**30:.2f} GiB + "
                         f"{tree['offloaded_host_bytes'] / 2**30:.2f} GiB on the host")
    if "schedule" in stats:
        sched = stats["schedule"]
        lines.append(f"schedule           {sched['status']} ({STATUS_MEANING.get(sched['status'], '?')}; "
                     f"{sched['method']}), {sched['objective_kind']} {sched['objective']:.4g} predicted ms vs bound "
                     f"{sched['lower_bound']:.4g} (gap {100 * sched['gap']:.2f}%, greedy "
                     f"{sched['greedy_objective']:.4g}), {sched['num_slots']} slots, "
                     f"{1e3 * sched['wall_time_s']:.0f} ms")
    if stats["microbatches"]:
        lines.append("microbatches")
        for mb in stats["microbatches"]:
            lines.append(f"  rank {mb['rank']} slot {mb['slot']}: {mb['compact_tokens']:,} compact "
                         f"tokens, {mb['trajectories']:,} trajectories, {mb['rounds']} rounds")
    return "\n".join(lines)


def compile_main(argv: list[str]) -> int:
    from . import CompileOptions, TreeBatch, compile
    from .compile_flags import add_compile_options, given_options
    from .ir import check_plan_path

    parser = argparse.ArgumentParser(prog="harts compile", formatter_class=HelpFormatter,
                                     description="Compile a JSONL rollout batch into a plan (docs/design.md in "
                                     "the source tree explains the passes).")
    parser.add_argument("input", help="JSONL: trajectories {id, tokens, ...} and/or trees {id, nodes}; - = stdin")
    add_compile_options(parser)
    parser.add_argument("--dump-ir", metavar="DIR", help="write a .hir after every pass into DIR")
    parser.add_argument("--no-verify", action="store_true", help="skip the IR verification between passes")
    parser.add_argument("--json", action="store_true", help="print statistics as one JSON object")
    parser.add_argument("-o", "--output", metavar="PLAN", help="save the plan: PLAN (.hir text) and, for long "
                        "token lists, PLAN.npz beside it")
    parser.add_argument("--model", metavar="PRESET|DIR", help="a model preset or checkpoint directory (its "
                        "config.json): report the step's predicted time against trajectory-wise training (the "
                        "repository's H200 fit unless --cost-model names another), and the bytes trees in "
                        "pieces carry and their predicted peak memory")
    add_quiet_argument(parser)
    args = parser.parse_args(argv)
    config = model_config(args.model) if args.model else None
    options = CompileOptions.checked(verify=not args.no_verify, **given_options(args))
    if args.output:
        check_plan_path(args.output)  # refused before a long compile, not after it
    if args.dump_ir and Path(args.dump_ir).exists() and not Path(args.dump_ir).is_dir():
        raise InputError(f"--dump-ir {args.dump_ir}: exists and is not a directory")
    batch = TreeBatch.load(args.input)
    # a bar only where compiling takes a while (a few million tokens and up)
    with cannot_write("--dump-ir", args.dump_ir):
        plan = compile(batch, options, dump_ir=args.dump_ir, quiet=args.quiet or batch.tokens.size < 2_000_000)
    if args.output:
        with cannot_write("-o", args.output):
            plan.save(args.output)
    for warning in plan_warnings(plan):
        print(f"harts compile: warning: {warning}", file=sys.stderr)
    stats = dict(plan.stats)
    if config is not None and "pieces" in stats:
        stats["pieces"] = {**stats["pieces"], "memory": pieces_memory(plan, config)}
    prediction = None
    if config is not None and plan.program.microbatches is not None:
        from .predict import format_prediction, predicted_step
        prediction = predicted_step(plan, batch, config)
        stats["predicted_step"] = prediction
    print(json.dumps(stats) if args.json else format_summary(plan, stats))
    if prediction is not None and not args.json:
        print(format_prediction(prediction))
    return 0


def unknown_model(spec: str) -> InputError:
    """The error of a --model that names no preset and no checkpoint directory with a config.json."""
    from harts_compiler.runtime import PRESETS

    return InputError(f"--model {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a checkpoint "
                      "directory with a config.json")


def model_config(spec: str):
    """The ModelConfig of a preset name or a checkpoint directory's config.json (no weights loaded)."""
    from harts_compiler.runtime import PRESETS, UnsupportedModelError
    from harts_compiler.runtime.config import resolve_config

    path = Path(spec) / "config.json"
    if spec not in PRESETS and not path.is_file():
        raise unknown_model(spec)
    try:
        return resolve_config(spec if spec in PRESETS else json.loads(path.read_text()))
    except (ValueError, KeyError, UnsupportedModelError) as error:  # the message names the file's field
        raise InputError(f"--model {spec}: {' '.join(str(error).split())}") from None


def pieces_memory(plan, config, dtype_bytes: int = 2) -> list[dict]:
    """Per tree run as pieces (bf16 activations): each piece's tokens, context and carried bytes, and the
    tree's predicted peak (`piece_memory`'s model)."""
    from .piece_memory import offloaded_bytes, piece_memory, predicted_peak

    out = []
    for mb in plan.microbatches():
        if not mb.runs_as_pieces:
            continue
        pieces = piece_memory(mb.build_chain(), config, dtype_bytes)
        out.append({"tree": plan.program.forest.tree_ids[mb.trees[0]], "rank": mb.rank, "slot": mb.slot,
                    "pieces": [{"tokens": p.tokens, "context_tokens": p.context_tokens,
                                "carried_bytes": p.carried_bytes} for p in pieces],
                    "carried_bytes": sum(p.carried_bytes for p in pieces),
                    "predicted_peak_bytes": predicted_peak(pieces),
                    "predicted_peak_offloaded_bytes": predicted_peak(pieces, offloaded=True),
                    "offloaded_host_bytes": offloaded_bytes(pieces)})
    return out


def plan_warnings(plan) -> list[str]:
    """What a user should know about a plan that compiled but may not be what they meant."""
    warnings = []
    stats = plan.stats
    if plan.options.microbatch_tokens is None and plan.program.microbatches is not None:
        largest = max((mb["compact_tokens"] for mb in stats["microbatches"]), default=0)
        warnings.append(f"no --microbatch-tokens: each rank runs its trees as one microbatch (the largest has "
                        f"{largest:,} compact tokens); give the budget one forward+backward fits")
    warnings += field_hints((plan.metadata or {}).values())
    idle = plan.options.dp_size - len({mb["rank"] for mb in stats["microbatches"]})
    if stats["microbatches"] and idle > 0:
        warnings.append(f"{idle} of {plan.options.dp_size} ranks get no microbatch ({stats['trees']} trees to "
                        "spread); they would only wait")
    return warnings


def ir_main(argv: list[str]) -> int:
    from .ir import IRError, format_program, read_hir

    parser = argparse.ArgumentParser(prog="harts ir", formatter_class=HelpFormatter,
                                     description="Pretty-print and validate a .hir dump.")
    parser.add_argument("file", help="a .hir (a saved plan or an --dump-ir stage); its .npz is read from beside it")
    parser.add_argument("--full", action="store_true", help="print every record")
    parser.add_argument("--lines", type=int, default=8,
                        help="records of each kind to print without --full")
    args = parser.parse_args(argv)
    if args.lines < 0:
        raise InputError(f"--lines {args.lines}: need a count >= 0 (--full prints every record)")
    try:
        program = read_hir(args.file)  # ArtifactError names the files itself
        program.verify()
    except (OSError, IRError) as error:
        raise InputError(f"{args.file}: {error}") from None
    print(describe_program(program))
    lines = format_program(program)[0].splitlines()
    if not args.full:
        lines = [_short_tokens(line, args.lines) for line in lines]
    print(_abridged(lines, None if args.full else args.lines))
    print(f"{args.file}: valid ({program.stage})")
    return 0


def describe_program(program) -> str:
    parts = [f"stage {program.stage}"]
    if program.trajectories is not None:
        t = program.trajectories
        parts.append(f"{len(t.ids)} trajectories, {t.num_tokens} tokens")
    if program.forest is not None:
        f = program.forest
        parts.append(f"{f.num_trees} trees, {f.num_nodes} nodes, {f.num_tokens} compact tokens, "
                     f"{f.num_trajectories} trajectories ({int(f.traj_length.sum())} tokens)")
    if program.sequences is not None:
        q = program.sequences
        parts.append(f"{q.num_sequences} sequences, C={q.chunk_size}, "
                     f"rounds {int(q.tree_rounds.max(initial=0))}, {q.replay_tokens} replay tokens")
    if program.microbatches is not None:
        parts.append(f"{program.microbatches.num_microbatches} microbatches on "
                     f"{program.microbatches.dp_size} ranks")
    if program.provenance:
        parts.append("passes " + " -> ".join(name for name, _ in program.provenance))
    return "# " + "\n# ".join(parts)


_TOKEN_LIST = re.compile(r"tokens=\[([^\]]*)\]")


def _short_tokens(line: str, keep: int) -> str:
    """`tokens=[a b c ... z]` cut to its first `keep` ids (a node can hold thousands)."""
    def cut(match):
        ids = match.group(1).split()
        if len(ids) <= keep:
            return match.group(0)
        return f"tokens=[{' '.join(ids[:keep])} ... ({len(ids)} tokens)]"
    return _TOKEN_LIST.sub(cut, line)


def _abridged(lines: list[str], per_kind: int | None) -> str:
    """The records, at most `per_kind` consecutive records of each kind (None = all)."""
    out, run_kind, run_length, hidden = [], None, 0, 0
    for line in lines + [""]:
        kind = line.partition(" ")[0]
        if kind != run_kind:
            if hidden:
                out.append(f"  ... {hidden} more {run_kind} records (--full)")
            run_kind, run_length, hidden = kind, 0, 0
        run_length += 1
        if per_kind is None or run_length <= per_kind:
            out.append(line)
        else:
            hidden += 1
    return "\n".join(out).rstrip()


def bench_main(argv: list[str]) -> int:
    """`harts bench [NAME] [options]`: run benchmark NAME of the source checkout's bench/ folder (default e2e, the
    end-to-end tree vs trajectory-wise step); `harts bench --help` lists them, `harts bench NAME --help` gives
    one's options."""
    bench_dir = Path(__file__).resolve().parent.parent / "bench"
    available = _benchmarks(bench_dir)
    if argv[:1] in (["-h"], ["--help"], ["list"]):
        print(_bench_usage(available))
        return 0
    name = argv[0] if argv and not argv[0].startswith("-") else "e2e"
    rest = argv[1:] if argv and not argv[0].startswith("-") else argv
    if name not in available:
        raise InputError(f"bench {name!r}: no such benchmark" + (f" (available: {', '.join(available)})" if available
                                                                 else " (harts bench needs a source checkout)"))
    if "-h" not in rest and "--help" not in rest:
        import torch
        if not torch.cuda.is_available():
            print(f"harts bench: warning: no CUDA device; {name}'s default sizes are for an H200 and may take "
                  f"long on a CPU (harts bench {name} --help shows the size options)", file=sys.stderr)
    script = bench_dir / f"{name}.py"
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv, sys.path[:0] = [f"harts bench {name}", *rest], [str(bench_dir)]
    try:  # exec, not runpy.run_path, which would put the script's path into argv[0] (its usage line)
        exec(compile(script.read_text(), str(script), "exec"), {"__name__": "__main__", "__file__": str(script)})
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


def _benchmarks(bench_dir: Path) -> dict[str, str]:
    """name -> first line of its docstring, for every runnable script of bench/ (helpers have no main)."""
    import ast

    found = {}
    for path in sorted(bench_dir.glob("*.py")) if bench_dir.is_dir() else []:
        source = path.read_text()
        if "__main__" not in source:
            continue
        doc = ast.get_docstring(ast.parse(source)) or ""
        found[path.stem] = doc.strip().splitlines()[0] if doc.strip() else ""
    return found


def _bench_usage(available: dict[str, str]) -> str:
    if not available:
        return "harts bench: no bench/ folder here (the benchmarks run from a source checkout)"
    width = max(map(len, available))
    lines = ["usage: harts bench [NAME] [options]   (default NAME: e2e; harts bench NAME --help for its options)",
             "", "benchmarks (GPU sizes by default; on a CPU they are slow or skip what needs CUDA):"]
    lines += [f"  {name:<{width}}  {summary}" for name, summary in available.items()]
    return "\n".join(lines)
