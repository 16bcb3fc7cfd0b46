"""A saved plan is one artifact: its arrays file is named after the whole text file name and bound to it by a
sha256, so plans saved side by side never mix, a replaced half is refused naming both files, and saving
never overwrites a file of another kind. A plan's identity leaves wall-clock fields out."""
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import harts_compiler as hc
from harts_compiler.cli import main
from harts_compiler.ir import ArtifactError, IRError, arrays_path, structural_diff

OPTIONS = hc.CompileOptions(chunk_size=16, microbatch_tokens=None)


def long_batch(seed: int, n: int = 3) -> hc.TreeBatch:
    """Token lists long enough (> the 4096-token inline limit) that the arrays go to their own file."""
    rng = np.random.default_rng(seed)
    root = rng.integers(0, 50_000, 5000).tolist()
    return hc.TreeBatch.from_trajectories([root + rng.integers(0, 50_000, 30 + k).tolist() for k in range(n)])


def test_plans_saved_under_colliding_names_each_load_back_their_own_tokens(tmp_path):
    names = ["run", "run.hir", "run.plan", "run.hir.hir", "run.npz.hir", "r.u.n", "plan.hir", ".hir"]
    plans = {}
    for seed, name in enumerate(names):
        plans[name] = hc.compile(long_batch(seed), OPTIONS)
        plans[name].save(tmp_path / name)
    for name in ("run.npz", "run.hir.npz"):  # reserved for arrays files: refused, nothing written
        with pytest.raises(ArtifactError, match="reserved"):
            plans["run"].save(tmp_path / name)
    for name, plan in plans.items():
        assert arrays_path(tmp_path / name).is_file()
        loaded = hc.Plan.load(tmp_path / name)
        assert structural_diff(loaded.program, plan.program) is None
        assert loaded.identity == plan.identity
    assert len({plan.identity for plan in plans.values()}) == len(names)


def test_a_replaced_or_missing_arrays_file_is_refused_naming_both(tmp_path, capsys):
    a, b = tmp_path / "a.hir", tmp_path / "b.hir"
    hc.compile(long_batch(1), OPTIONS).save(a)
    hc.compile(long_batch(2), OPTIONS).save(b)  # same sizes, other tokens: the silent mix-up to refuse
    shutil.copy(arrays_path(b), arrays_path(a))
    with pytest.raises(ArtifactError, match="do not belong together") as caught:
        hc.Plan.load(a)
    assert str(a) in str(caught.value) and str(arrays_path(a)) in str(caught.value)
    for command in (["ir", str(a)], ["lower", str(a)]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "do not belong together" in err and "Traceback" not in err
    arrays_path(a).unlink()
    assert main(["ir", str(a)]) == 2
    assert "arrays file" in capsys.readouterr().err
    with pytest.raises(ArtifactError, match="missing"):
        hc.Plan.load(a)
    arrays_path(a).write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(ArtifactError, match="not a readable arrays file"):
        hc.Plan.load(a)


def test_compile_output_refuses_reserved_suffixes_directories_and_other_files(tmp_path, capsys):
    batch_file = tmp_path / "batch.jsonl"
    long_batch(3).save(batch_file)
    before = batch_file.read_bytes()
    cases = {str(tmp_path / "plan.npz"): "reserved", str(tmp_path): "is a directory",
             str(tmp_path / "missing" / "p.hir"): "does not exist", str(batch_file): "not a saved plan"}
    for output, message in cases.items():
        assert main(["compile", str(batch_file), "-o", output]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert batch_file.read_bytes() == before and not (tmp_path / "plan.npz").exists()
    assert main(["compile", str(batch_file), "-o", str(tmp_path / "ok.hir")]) == 0
    assert main(["compile", str(batch_file), "-o", str(tmp_path / "ok.hir")]) == 0  # a plan may replace a plan
    capsys.readouterr()
    (tmp_path / "d").write_text("x")
    assert main(["compile", str(batch_file), "--dump-ir", str(tmp_path / "d")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_a_smaller_plan_saved_over_a_larger_one_removes_the_old_arrays(tmp_path):
    path = tmp_path / "p.hir"
    hc.compile(long_batch(4), OPTIONS).save(path)
    assert arrays_path(path).is_file()
    small = hc.compile(hc.TreeBatch.from_trajectories([[1, 2, 3], [1, 2, 4]]), OPTIONS)
    small.save(path)
    assert not arrays_path(path).exists()
    assert hc.Plan.load(path).identity == small.identity


def test_arrays_and_binary_files_given_as_plans_are_one_line_errors(tmp_path, capsys):
    path = tmp_path / "p.hir"
    hc.compile(long_batch(5), OPTIONS).save(path)
    (tmp_path / "bin.hir").write_bytes(b"hir 2\n\xff\xfe")
    for target, message in ((arrays_path(path), "is an arrays file"), (tmp_path / "bin.hir", "not UTF-8"),
                            (tmp_path, "is a directory"), (tmp_path / "none.hir", "no such file")):
        assert main(["ir", str(target)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("name, array, message", [
    ("forest.token_ids", lambda t: t.astype(np.float64) + 0.5, "is float64 of shape"),
    ("forest.token_ids", lambda t: t.astype(np.uint64) + np.uint64(2**63), "is uint64 of shape"),
    ("forest.token_ids", lambda t: t.astype(str), "of shape"),
    ("forest.token_ids", lambda t: t.reshape(1, -1), "of shape (1, "),
    ("extra", lambda t: np.zeros(3), "array 'extra' is not one of a plan's"),
], ids=["float", "uint64-past-int64", "text", "2-d", "unknown-array"])
def test_arrays_whose_hash_matches_but_are_not_a_plans_are_refused(tmp_path, capsys, name, array, message):
    """The sha256 binds the pair; it does not make the arrays token ids: a float, wrapped or text array with a
    recomputed hash loaded as tokens (or crashed the checks with a numpy error)."""
    from harts_compiler.ir.text import arrays_digest

    path = tmp_path / "p.hir"
    hc.compile(long_batch(7), OPTIONS).save(path)
    with np.load(arrays_path(path)) as data:
        arrays = {key: data[key] for key in data.files}
    arrays[name] = array(arrays["forest.token_ids"])
    np.savez(arrays_path(path), **arrays)
    text = path.read_text()
    old = text.split("sha256=")[1].split()[0]
    path.write_text(text.replace(old, arrays_digest(arrays)))
    with pytest.raises(ArtifactError, match=re.escape(message)):
        hc.Plan.load(path)
    assert main(["ir", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_an_arrays_file_that_is_no_zip_is_named_so(tmp_path):
    path = tmp_path / "p.hir"
    hc.compile(long_batch(8), OPTIONS).save(path)
    arrays_path(path).write_bytes(b"hello")  # np.load read it as a pickle and said so
    with pytest.raises(ArtifactError, match="not an .npz zip archive"):
        hc.Plan.load(path)


IDENTITY = """
import sys, harts_compiler as hc
from harts_compiler.generator import generate
_, lists = zip(*generate("tau2", 3, tasks=6, scale=0.05).trajectories)
batch = hc.TreeBatch.from_trajectories(lists)
plan = hc.compile(batch, hc.CompileOptions(microbatch_tokens=4096, dp_size=2, chunk_size=64))
plan.save(sys.argv[1])
print(plan.identity)
"""


def test_identity_is_stable_across_runs_though_the_saved_timings_differ(tmp_path):
    runs = []
    for k, seed in enumerate(("1", "2")):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", IDENTITY, str(tmp_path / f"{k}.hir")], env=env, check=True,
                             capture_output=True, text=True).stdout
        runs.append(out.strip())
    assert runs[0] == runs[1] and len(runs[0]) == 64
    assert hc.Plan.load(tmp_path / "0.hir").identity == runs[0]
    assert f"# identity {runs[0]}" in (tmp_path / "1.hir").read_text()
    loaded = hc.Plan.load(tmp_path / "0.hir")
    other = hc.Plan(program=loaded.program, options=loaded.options.model_copy(update={"chunk_size": 32}))
    assert other.identity != runs[0]  # options are part of what a plan is


@pytest.mark.parametrize("header, message", [
    ('# options {"chunk_size": 16', "header '# options': Expecting"),  # json's error: a traceback
    ('# options {"chunk_size": 0}', "header '# options': field chunk_size: Input should be greater"),  # pydantic's
    ("# options []", "header '# options': field <options>: Input should be a valid dictionary"),
    ('# options {"chunk_size": 32}', "chunk_size=32 but the plan's records were compiled with chunk_size=16"),
    ('# options {"chunk_size": 16, "dp_size": 7}', "dp_size=7 but the plan's records were compiled with dp_size=1"),
    ("# metadata {bad", "header '# metadata': Expecting"),
    ("# metadata [1]", "header '# metadata': must map each trajectory id to an object"),
    ('# metadata {"nosuch": {"reward": 1.0}}', "trajectory 'nosuch' is not one of the plan's"),
], ids=["options-not-json", "options-invalid", "options-list", "options-chunk", "options-dp",
        "metadata-not-json", "metadata-list", "metadata-stray-id"])
def test_a_saved_plans_damaged_headers_are_one_line_errors(tmp_path, capsys, header, message):
    """The options and metadata header lines were read with json.loads and CompileOptions(**...) unchecked: a
    traceback for text that is not JSON, and a plan shown (or lowered) with options its records disagree with."""
    path = tmp_path / "p.hir"
    hc.compile(hc.TreeBatch.from_trajectories([[1, 2, 3], [1, 2, 4]]), OPTIONS).save(path)
    prefix = " ".join(header.split()[:2])  # "# options" or "# metadata": the line the header replaces
    lines = [line for line in path.read_text().splitlines() if not line.startswith(prefix)]
    path.write_text("\n".join([header] + lines) + "\n")
    with pytest.raises(IRError, match=re.escape(message)):
        hc.Plan.load(path)
    assert main(["show", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err
