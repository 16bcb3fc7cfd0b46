"""Every command-line failure is one line on stderr and exit 2, never a traceback: a test per failure mode, and
a fuzz test of the JSONL input through `harts compile`."""
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harts_compiler.cli import main

GOOD = b'{"id": "a", "tokens": [1, 2, 3]}\n{"id": "b", "tokens": [1, 2, 4]}\n'


@pytest.fixture
def batch(tmp_path):
    path = tmp_path / "batch.jsonl"
    path.write_bytes(GOOD)
    return path


def one_line_exit_2(capsys, argv, expect: str):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and expect in err, err


def test_input_failures(tmp_path, capsys, batch):
    one_line_exit_2(capsys, ["compile", str(tmp_path / "none.jsonl")], "no such file")
    one_line_exit_2(capsys, ["compile", str(tmp_path)], "is a directory")
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"id": "a", "tokens": [1, \xff]}\n')
    one_line_exit_2(capsys, ["compile", str(bad)], "line 1")
    bad.write_bytes(b'{"id": "a", "tokens": [01]}\n')
    one_line_exit_2(capsys, ["compile", str(bad)], "leading zero")


def test_many_problems_are_counted_not_listed(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "a", "tokens": [0.5] * 5000}) + "\n")
    one_line_exit_2(capsys, ["compile", str(bad)], "(and 4,999 more in this field)")
    bad.write_text("".join(json.dumps({"id": f"t{i}", "tokens": [-1]}) + "\n" for i in range(300)))
    assert main(["compile", str(bad)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 21 and "line 20 " in lines[19] and lines[-1] == "harts compile: ... and 280 more problems"


def test_output_failures(tmp_path, capsys, batch):
    one_line_exit_2(capsys, ["compile", str(batch), "-o", str(tmp_path / "no" / "p.hir")], "does not exist")
    one_line_exit_2(capsys, ["compile", str(batch), "-o", str(tmp_path)], "is a directory")
    one_line_exit_2(capsys, ["compile", str(batch), "-o", str(tmp_path / "p.npz")], "reserved")
    (tmp_path / "file").write_text("x")
    one_line_exit_2(capsys, ["compile", str(batch), "--dump-ir", str(tmp_path / "file")], "not a directory")
    one_line_exit_2(capsys, ["gen", "--scale", "0.001", "-o", str(tmp_path)], "is a directory")
    one_line_exit_2(capsys, ["gen", "--scale", "0.001", "-o", str(tmp_path / "no" / "x.jsonl")], "does not exist")


@pytest.mark.parametrize("argv, expect", [
    (["gen", "--scale", "inf"], "scale"),
    (["gen", "--scale", "nan"], "scale"),
    (["gen", "--scale", "1e9"], "distinct tokens"),
    (["gen", "--tasks", "0"], "tasks"),
    (["compile", "-", "--microbatch-tokens", "0"], "microbatch_tokens"),
    (["nonsense"], "unknown command"),
])
def test_bad_parameters(capsys, argv, expect):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err


def test_stdin_and_version(monkeypatch, capsys):
    import io
    import sys
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(GOOD)))
    assert main(["compile", "-", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["trajectories"] == 2
    assert main(["--version"]) == 0 and capsys.readouterr().out.startswith("harts ")


def test_warnings_for_a_missing_budget_and_idle_ranks(capsys, batch):
    assert main(["compile", str(batch), "--dp-size", "4"]) == 0
    err = capsys.readouterr().err
    assert "no --microbatch-tokens" in err and "3 of 4 ranks get no microbatch" in err


def test_bench_lists_its_benchmarks(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert "e2e" in out and "attention" in out and "gdn" in out
    one_line_exit_2(capsys, ["bench", "nope"], "no such benchmark")


FRAGMENTS = [b'{"id": "a", "tokens": [1, 2]}', b'{"id": "b", "tokens": [1, 3], "reward": 1.0}', b'{"id":',
             b'"tokens": [', b'01', b'NaN', b'[1,]', b'}', b'{', b'"nodes": [{"id": 0, "parent": null, "tokens": [5]}]',
             b'"parent": 0', b'\xef\xbb\xbf', b'\xff', b'\n', b' ', b'"trajectories": [{"id": "x", "node": 9}]',
             b'{"id": "t", "nodes": [{"id": 0, "parent": 1, "tokens": [1]}, {"id": 1, "parent": 0, "tokens": [2]}]}',
             b'{"id": "a", "tokens": [1e400]}', b'{"id": "a", "tokens": [-1]}', b'{"id": "a", "tokens": []}']


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=8))
def test_fuzzed_jsonl_compiles_or_is_refused_in_one_line_per_problem(tmp_path, capsys, parts):
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(b"".join(parts))
    code = main(["compile", str(path), "--json"])
    captured = capsys.readouterr()
    assert code in (0, 2) and "Traceback" not in captured.err
    if code == 2:
        assert all(line.startswith("harts compile: ") for line in captured.err.splitlines())
