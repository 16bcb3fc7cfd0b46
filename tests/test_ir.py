"""IR: `.hir` round trip (golden files, random programs, external .npz arrays) and verify()
rejecting broken invariants."""
import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import harts_compiler as hc
from harts_compiler.ir import IRError, arrays_path, format_program, parse_hir, read_hir, structural_diff, write_hir
from harts_compiler.testing import random_batch, token_lists_strategy

GOLDEN = Path(__file__).parent / "golden"
# The budget of 11 cuts tree "grp" (12 compact tokens) into two parts that share "sys".
# Built-in cost guesses: the golden schedule must not change when a new cost fit lands.
GOLDEN_OPTIONS = hc.CompileOptions(chunk_size=4, dp_size=2, microbatch_tokens=11,
                                   cost_model="default")


def strip_timings(program):
    """Pass times and the solvers' wall times set to 0 (they differ from run to run)."""
    def steady(text):
        note = json.loads(text)
        return json.dumps({k: 0.0 if k in ("wall_time_s", "solver_time_s") else v
                           for k, v in note.items()})

    return program.replace(provenance=tuple((name, 0.0) for name, _ in program.provenance),
                           notes=tuple((name, steady(text)) for name, text in program.notes))


def stage_dumps(tmp_path, batch, options, inline_limit=4096):
    """Every stage's Program (input, then after each pass) written and read back."""
    plan = hc.compile(batch, options, dump_ir=tmp_path)
    return sorted(tmp_path.glob("*.hir")), plan


@pytest.mark.parametrize("stage", ["00-input", "01-prefix-compress", "02-layout",
                                   "03-replay-min", "04-cut-pieces", "05-schedule"])
def test_golden_files(tmp_path, stage):
    """The compiler's output on tests/golden/small.jsonl equals the golden dump of each stage;
    the golden text parses, verifies and prints back identically.
    Regenerate after an intended change with HARTS_REGENERATE_GOLDEN=1."""
    batch = hc.TreeBatch.load(GOLDEN / "small.jsonl")
    hc.compile(batch, GOLDEN_OPTIONS, dump_ir=tmp_path)
    fresh = strip_timings(read_hir(tmp_path / f"{stage}.hir"))
    golden_path = GOLDEN / f"small.{stage}.hir"
    if os.environ.get("HARTS_REGENERATE_GOLDEN"):
        golden_path.write_text(format_program(fresh)[0])
    text = golden_path.read_text()
    golden = parse_hir(text)
    golden.verify()
    assert format_program(golden)[0] == text
    assert structural_diff(golden, fresh) is None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_lists_strategy(max_traj=10, max_len=30), st.sampled_from([1, 3, 64]),
       st.sampled_from([0, 5, 4096]))
def test_round_trip_random_programs(token_lists, chunk_size, inline_limit):
    import tempfile
    batch = hc.TreeBatch.from_trajectories(token_lists)
    options = hc.CompileOptions(chunk_size=chunk_size, dp_size=2, microbatch_tokens=None)
    with tempfile.TemporaryDirectory() as tmp:
        plan = hc.compile(batch, options)
        for program in (plan.program, plan.program.replace(microbatches=None)):
            path = write_hir(program, Path(tmp) / "p.hir", inline_limit=inline_limit)
            # the arrays file appears exactly when the token lists are long (a stale one from the last save goes)
            assert arrays_path(path).exists() == (inline_limit < max(1, program.forest.num_tokens))
            back = read_hir(path)
            back.verify()
            assert structural_diff(back, program) is None


def test_every_stage_round_trips(tmp_path):
    dumps, plan = stage_dumps(tmp_path, random_batch(5, n_traj=30, max_len=200),
                              hc.CompileOptions(chunk_size=8, microbatch_tokens=300, dp_size=3))
    assert len(dumps) == 6
    assert plan.program.pieces is not None  # the pieces stage is exercised
    for path in dumps:
        program = read_hir(path)
        program.verify()
        again = tmp_path / ("again-" + path.name)
        write_hir(program, again)
        assert structural_diff(read_hir(again), program) is None


def test_plan_save_load(tmp_path):
    plan = hc.compile(random_batch(2, n_traj=20, max_len=400), hc.CompileOptions(chunk_size=16))
    plan.save(tmp_path / "plan.hir")
    loaded = hc.Plan.load(tmp_path / "plan.hir")
    assert loaded.options == plan.options
    assert structural_diff(loaded.program, plan.program) is None
    assert loaded.stats["compact_tokens"] == plan.stats["compact_tokens"]


@pytest.fixture(scope="module")
def program():
    program = hc.compile(random_batch(11, n_traj=12, max_len=40),
                         hc.CompileOptions(chunk_size=4, microbatch_tokens=45)).program
    assert program.pieces is not None and program.microbatches.num_microbatches > 1
    return program


def broken(program, part, **changes):
    target = getattr(program, part)
    fixed = {}
    for name, fn in changes.items():
        value = getattr(target, name).copy()
        fixed[name] = fn(value)
    return program.replace(**{part: target.replace(**fixed) if hasattr(target, "replace")
                              else __import__("dataclasses").replace(target, **fixed)})


def bump_last(a):
    a[-1] += 1
    return a


@pytest.mark.parametrize("part, field, mutate, message", [
    ("forest", "node_multiplicity", bump_last, "node_multiplicity"),
    ("forest", "token_position", bump_last, "token_position"),
    ("forest", "node_subtree_end", lambda a: a - 1, "node_subtree_end"),
    ("forest", "traj_length", bump_last, "traj_length"),
    ("forest", "token_ids", lambda a: -a - 1, "negative token"),
    ("forest", "run_length", bump_last, "run_length"),
    ("sequences", "seq_round", lambda a: np.zeros_like(a), "earlier round"),
    ("sequences", "seq_init_offset", lambda a: np.where(a > 0, a + 1, a), "init_offset"),
    ("sequences", "export_offset", lambda a: a + a.size, "exports"),
    ("sequences", "replay", lambda a: a[::-1].copy(), "replay rows"),
    ("microbatches", "mb_slot", lambda a: a + 1, "slot that no rank uses"),
    ("microbatches", "mb_slot", lambda a: np.zeros_like(a), "one \\(rank, slot\\)"),
    ("forest", "token_ids", lambda a: np.where(np.arange(a.size) == 0, a, a[0]), "same token"),
    ("pieces", "piece_end", lambda a: a - 1, "consecutive ranges"),
    ("pieces", "piece_start", lambda a: np.where(a == a.max(), a.max() - 100, a), "budget"),
])
def test_verify_names_broken_invariant(program, part, field, mutate, message):
    program.verify()
    target = getattr(program, part)
    if getattr(target, field).size == 0:
        pytest.skip("example too small for this mutation")
    import dataclasses
    bad = dataclasses.replace(target, **{field: mutate(getattr(target, field).copy())})
    with pytest.raises(IRError, match=message):
        program.replace(**{part: bad}).verify()


def test_verify_names_riders_over_the_budget(program):
    """Whole trees may share a microbatch with a tree in pieces only within its smallest piece's room."""
    from harts_compiler.ir import Microbatches
    n = program.forest.num_trees
    one = Microbatches(dp_size=1, microbatch_tokens=program.microbatches.microbatch_tokens,
                       mb_rank=np.zeros(1, np.int64), mb_slot=np.zeros(1, np.int64),
                       mb_tree_ptr=np.asarray([0, n]), mb_trees=np.arange(n))
    with pytest.raises(IRError, match="riding with piece"):
        program.replace(microbatches=one).verify()


def test_parse_errors():
    with pytest.raises(IRError, match="header"):
        parse_hir("forest laid_out=1\n")
    with pytest.raises(IRError, match="line 2: forest record lacks field 'nodes'"):
        parse_hir("hir 2\nforest laid_out=1 conv_width=4\nnode parent=-1\n")
