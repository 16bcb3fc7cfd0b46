"""`harts ir` on large and wrong files: abridged token lists, clear errors instead of tracebacks."""
import numpy as np

from harts_compiler import CompileOptions, TreeBatch, compile
from harts_compiler.cli import main
from harts_compiler.ir import arrays_path


def _dump(tmp_path):
    rng = np.random.default_rng(0)
    root = rng.integers(0, 1000, 5000).tolist()  # large enough for the .npz side file
    batch = TreeBatch.from_trajectories([root + [1, 2], root + [3], root[:100]])
    compile(batch, CompileOptions(), dump_ir=tmp_path)
    return sorted(tmp_path.glob("*-schedule.hir"))[0]


def test_node_token_lists_are_abridged_unless_full(tmp_path, capsys):
    hir = _dump(tmp_path)
    assert main(["ir", str(hir)]) == 0
    out = capsys.readouterr().out
    assert "(100 tokens)]" in out and "valid (scheduled)" in out
    assert main(["ir", str(hir), "--full"]) == 0
    assert "tokens)]" not in capsys.readouterr().out


def test_npz_side_file_is_a_clear_error(tmp_path, capsys):
    hir = _dump(tmp_path)
    assert main(["ir", str(arrays_path(hir))]) == 2
    assert "is an arrays file, not a .hir" in capsys.readouterr().err


def test_bench_command_names_the_available_benchmarks(capsys):
    assert main(["bench", "no-such-bench"]) == 2
    err = capsys.readouterr().err
    assert "available:" in err and "e2e" in err
