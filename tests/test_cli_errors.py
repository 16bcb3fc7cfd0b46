"""Every command-line failure is one line on stderr and exit 2, never a traceback: a test per failure mode, and
a fuzz test of the JSONL input through `harts compile`."""
import json
from pathlib import Path

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


@pytest.mark.parametrize("flag, value, expect", [
    ("--microbatch-tokens", str(10**19), "option microbatch_tokens"),  # past int64: numpy overflowed
    ("--chunk-size", str(2**63), "option chunk_size"),
    ("--dp-size", str(10**19), "option dp_size"),
    ("--dp-size", str(2**20 + 1), "option dp_size"),  # a per-rank table this size filled memory and time
    ("--linear-layers", str(10**400), "option linear_layers"),  # too large for a float
], ids=["microbatch-tokens", "chunk-size", "dp-size", "dp-size-2**20+1", "linear-layers"])
def test_option_values_beyond_what_the_compiler_holds(capsys, batch, flag, value, expect):
    one_line_exit_2(capsys, ["compile", str(batch), flag, value], expect)


@pytest.mark.parametrize("line, expect", [
    (b'{"id": "a", "tokens": [' + b"9" * 5000 + b"]}", "line 1: invalid JSON: a number with more than"),
    (b'{"id": "a", "tokens": [1], "extra": ' + b"1" * 5000 + b"}", "line 1: invalid JSON: a number with more than"),
    (b'{"id": "\\ud800", "tokens": [1, 2]}', "line 1: field id: string '\\ud800' holds a lone UTF-16 surrogate"),
    (b'{"id": "a", "tokens": [1], "x": {"y": ["ok", "\\udc00"]}}', "line 1: field x.y[1]: string '\\udc00'"),
    (b'{"id": "t", "nodes": [{"id": "\\udfff", "parent": null, "tokens": [1]}]}', "field nodes[0].id: string"),
], ids=["long-token", "long-extra-field", "surrogate-id", "surrogate-nested", "surrogate-node-id"])
def test_numbers_python_cannot_read_and_lone_surrogates_are_named(tmp_path, capsys, line, expect):
    """A 5,000-digit number raised a ValueError traceback; a lone surrogate escape was accepted and crashed
    `harts show` (and any print) with UnicodeEncodeError."""
    path = tmp_path / "bad.jsonl"
    path.write_bytes(line + b"\n")
    one_line_exit_2(capsys, ["compile", str(path)], expect)
    one_line_exit_2(capsys, ["show", str(path)], expect)


def test_a_surrogate_pair_is_text(tmp_path, capsys):
    path = tmp_path / "emoji.jsonl"
    path.write_bytes(b'{"id": "\\ud83d\\ude00", "tokens": [1, 2]}\n')
    assert main(["show", str(path)]) == 0 and "\U0001F600" in capsys.readouterr().out


@pytest.mark.parametrize("content, expect", [
    (None, "cannot read a cost model (Is a directory)"),
    (b"\xff\xfe garbage", "not a JSON cost model"),
    (b'{"coefficients": {}, "model": "abc"}', "field model: not an object"),
    (b'{"coefficients": {}, "fit": [1, 2]}', "field fit: not an object"),
    (b'{"coefficients": {"linear_token": 1' + b"0" * 400 + b"}}", "coefficients.linear_token: must be a finite"),
    (b'{"coefficients": {"linear_token": -1.0}}', "coefficients.linear_token: must be a finite number >= 0"),
    (b'{"coefficients": {"linear_token": true}}', "coefficients.linear_token: must be a finite number >= 0"),
    (b'{"coefficients": {"linear_token": 1e308, "head_token": 1e308}}', "predicted time is not a finite number"),
], ids=["directory", "binary", "model-str", "fit-list", "huge-int", "negative", "bool", "overflowing-cost"])
@pytest.mark.filterwarnings("error")  # a numpy overflow warning would be two more lines on stderr
def test_cost_model_files_that_cannot_be_used(tmp_path, capsys, batch, content, expect):
    path = tmp_path / "cost.json"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    one_line_exit_2(capsys, ["compile", str(batch), "--cost-model", str(path)], expect)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc, where no file can be created")
@pytest.mark.parametrize("argv, expect", [
    (["compile", "BATCH", "-o", "/proc/harts-test.hir"], "-o /proc/harts-test.hir: cannot write"),
    (["compile", "BATCH", "--dump-ir", "/proc/harts-test-ir"], "--dump-ir /proc/harts-test-ir: cannot write"),
    (["gen", "--scale", "0.001", "--tasks", "1", "-o", "/proc/harts-test.jsonl"], "cannot write"),
], ids=["compile-o", "dump-ir", "gen-o"])
def test_outputs_that_cannot_be_written(capsys, batch, argv, expect):
    one_line_exit_2(capsys, [str(batch) if a == "BATCH" else a for a in argv], expect)


@pytest.mark.parametrize("flag, value, expect", [
    ("--seed", "-1", "seed: need a non-negative integer"),
    ("--vocab-size", "3000000000", "vocab_size: at most 2,147,483,648"),  # int32 ids wrapped to negative ones
    ("--max-context", "-5", "max_context: need at least 1"),
])
def test_gen_parameters_are_named(capsys, flag, value, expect):
    one_line_exit_2(capsys, ["gen", "--scale", "0.001", "--tasks", "1", flag, value], expect)


def test_running_out_of_memory_is_one_line(monkeypatch, capsys, batch):
    from harts_compiler import TreeBatch

    def load(path):
        raise MemoryError("Unable to allocate 1.49 GiB for an array with shape (200010000,)")
    monkeypatch.setattr(TreeBatch, "load", load)
    one_line_exit_2(capsys, ["compile", str(batch)], "out of memory (Unable to allocate 1.49 GiB")


@pytest.mark.parametrize("fields", ['"reward": 1e400, "group": "g"', '"advantage": -1e999',
                                    '"old_logprobs": [0, 1e400]'])
def test_typed_numbers_that_overflow_to_infinity_are_refused(tmp_path, capsys, fields):
    """JSON has no Infinity (refused as a literal), but 1e400 is valid JSON that parses to inf: it was taken as a
    reward or log-prob, and the loss would have been inf or NaN."""
    path = tmp_path / "inf.jsonl"
    path.write_text('{"id": "a", "tokens": [1, 2], ' + fields + "}\n")
    one_line_exit_2(capsys, ["compile", str(path)], "Input should be a finite number")


@pytest.mark.parametrize("argv, expect", [
    (["verify", "BATCH", "--threads", "100000"], "--threads 100000: this machine has"),  # torch crashed (SIGSEGV)
    (["verify", "BATCH", "--seed", str(10**30)], "--seed must be an integer in [0, 2**32)"),  # torch's OverflowError
    (["demo", "--dump-ir", "BATCH"], "--dump-ir BATCH: cannot write"),  # FileExistsError traceback
    (["ir", "PLAN", "--lines", "-1"], "--lines -1: need a count >= 0"),  # printed no records, exit 0
], ids=["verify-threads", "verify-seed", "demo-dump-ir-file", "ir-lines"])
def test_run_flags_out_of_range(tmp_path, capsys, batch, argv, expect):
    plan = tmp_path / "p.hir"
    assert main(["compile", str(batch), "-q", "-o", str(plan)]) == 0
    capsys.readouterr()
    names = {"BATCH": str(batch), "PLAN": str(plan)}
    one_line_exit_2(capsys, [names.get(a, a) for a in argv] + (["--threads", "1"] if argv[0] == "demo" else []),
                    expect.replace("BATCH", str(batch)))


@pytest.mark.parametrize("command", ["compile", "lower", "verify"])
def test_an_unknown_model_is_named_once(tmp_path, capsys, batch, command):
    # compile, lower and verify share one message for a --model that is no preset and no checkpoint directory
    for spec in ("no-such-model", str(tmp_path)):  # tmp_path: a directory without config.json
        one_line_exit_2(capsys, [command, str(batch), "--model", spec], "neither a preset")
        assert main([command, str(batch), "--model", spec]) == 2 and capsys.readouterr().err.count("--model") == 1
