"""The scripts in bench/ as tests use them: run one at toy size on the CPU, or import its helpers.

bench/ is not a package (its scripts import each other by name), so imports go through `bench_on_path`, which puts
the folder on sys.path only for the `with` block."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def run_bench(script: str, out_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """bench/`script` --device cpu --tiny `args`, its JSON under `out_dir`; fails the test on a non-zero exit."""
    env = dict(os.environ, OUT=str(out_dir), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(BENCH / script), "--device", "cpu", "--tiny", *args],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@contextlib.contextmanager
def bench_on_path():
    sys.path.insert(0, str(BENCH))
    try:
        yield
    finally:
        sys.path.remove(str(BENCH))
