"""`compile(batch, options) -> Plan`: input batch -> passes -> a scheduled Program."""
from __future__ import annotations

from pathlib import Path

from .batch import TreeBatch
from .options import CompileOptions
from .plan import Plan
from harts_compiler.ir import Program, Trajectories
from harts_compiler.passes import build_pipeline, run_passes


def program_from_batch(batch: TreeBatch) -> Program:
    return Program(trajectories=Trajectories(tokens=batch.tokens, offsets=batch.offsets,
                                             ids=list(batch.ids), groups=list(batch.groups)))


def compile(batch: TreeBatch, options: CompileOptions | None = None, *,
            passes: list[str] | None = None, dump_ir: str | Path | None = None, quiet: bool = True) -> Plan:
    """Compile a batch. `passes` restricts the pipeline to a prefix of the registry (e.g. no
    `schedule`); `dump_ir` writes a `.hir` after every pass into that directory; `quiet=False` shows
    progress on a terminal."""
    options = options or CompileOptions()
    if options.vocab_size is not None:
        batch.check_vocab(options.vocab_size)
    pipeline = build_pipeline(options, passes)
    program, timings = run_passes(program_from_batch(batch), pipeline, verify=options.verify,
                                  dump_dir=dump_ir, quiet=quiet)
    metadata = {batch.ids[j]: batch.metadata_of(j) for j in range(len(batch)) if batch.metadata_of(j)}
    return Plan(program=program, options=options, timings=timings,
                trajectory_tokens=int(batch.tokens.size), metadata=metadata or None)
