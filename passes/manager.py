"""Pass manager: runs passes in order, verifies between them, times them, dumps `.hir`."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from harts_compiler.progress import progress
from harts_compiler.ir import Program, write_hir

from .base import Pass


@dataclass(frozen=True)
class PassTiming:
    name: str
    ms: float


def run_passes(program: Program, passes: list[Pass], *, verify: bool = True,
               dump_dir: str | Path | None = None, quiet: bool = True) -> tuple[Program, list[PassTiming]]:
    """Run `passes` on `program`. With `verify`, Program.verify() runs on the input and after
    every pass (not timed). With `dump_dir`, writes 00-input.hir and NN-<pass>.hir after pass NN.
    `quiet=False` shows a bar over the passes on a terminal."""
    if dump_dir is not None:
        dump_dir = Path(dump_dir)
        dump_dir.mkdir(parents=True, exist_ok=True)
        write_hir(program, dump_dir / "00-input.hir")
    if verify:
        program.verify()
    timings = []
    for index, compiler_pass in enumerate(progress(passes, desc="compiling", unit="pass", quiet=quiet), start=1):
        start = time.perf_counter()
        previous, program = program, compiler_pass.run(program)
        ms = (time.perf_counter() - start) * 1e3
        program = program.replace(provenance=program.provenance + ((compiler_pass.name, ms),))
        timings.append(PassTiming(compiler_pass.name, ms))
        if verify:
            program.verify(unchanged_from=previous)  # parts a pass kept were verified already
        if dump_dir is not None:
            write_hir(program, dump_dir / f"{index:02d}-{compiler_pass.name}.hir")
    return program, timings
