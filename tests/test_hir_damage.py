"""Damaged or hand-edited `.hir` text is refused with its line before anything is derived: a parent link
edited into a cycle, indices out of range, unknown records and fields, wrong counts. A fuzz test edits
saved plans at random and asserts `harts ir` ends with success or one line and exit 2, within bounded time
and memory."""
import re
from pathlib import Path
import resource
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import harts_compiler as hc
from harts_compiler.cli import main
from harts_compiler.ir import IRError, format_program, parse_hir

BATCH = hc.TreeBatch.from_trajectories([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9], [4, 4]])
TEXT = format_program(hc.compile(BATCH, hc.CompileOptions(chunk_size=2, dp_size=2)).program)[0]


def edit(text: str, kind: str, field: str, value: str, which: int = 0) -> str:
    """`text` with `field=` of the `which`-th `kind` record set to `value`."""
    lines, seen = text.splitlines(), -1
    for k, line in enumerate(lines):
        if line.startswith(kind + " "):
            seen += 1
            if seen == which:
                lines[k] = re.sub(rf"\b{field}=\S+", f"{field}={value}", line)
                return "\n".join(lines) + "\n"
    raise AssertionError(f"no {kind} record {which}")


def test_the_clean_text_parses():
    parse_hir(TEXT).verify()


@pytest.mark.parametrize("kind, field, value, message", [
    ("node", "parent", "1", "parent"),                 # root 0 -> child 1: a cycle through the parent links
    ("node", "parent", "0", "own parent"),
    ("node", "parent", "99", "parent=99 must be in"),
    ("node", "tree", "5", "tree=5 must be in"),
    ("node", "len", "1000000000000", "len=1000000000000"),
    ("node", "start", "7", "starts at 7"),
    ("node", "pos", "3", "position"),
    ("end", "node", "-2", "node=-2 must be in"),
    ("seq", "own", "0:100000", "outside the forest"),
    ("seq", "init", "77@0", "names no sequence"),
    ("mb", "rank", "9", "rank=9 must be in"),
    ("mb", "trees", "[0 8]", "every entry of trees"),
    ("forest", "nodes", "3", "nodes=3 but"),
    ("sequences", "chunk_size", "0", "chunk_size=0"),
    ("node", "tokens", "[1 2 3 4 5 6 7 8 9]", "tokens"),
    ("node", "mult", str(2**63), "does not fit in 64 bits"),  # numpy's OverflowError, a traceback
    ("node", "tokens", f"[1 {2**64}]", "does not fit in 64 bits"),
    ("mb", "slot", str(2**62), f"slot={2**62} must be in [0, "),  # an array of that many slots
    ("microbatches", "dp_size", str(2**62), f"dp_size={2**62} must be in [1, "),  # `harts show` draws every rank
])
def test_damaged_fields_are_named_with_their_line(kind, field, value, message):
    with pytest.raises(IRError, match=r"\.hir line \d+") as caught:
        parse_hir(edit(TEXT, kind, field, value)).verify()
    assert message in str(caught.value)


def test_a_parent_cycle_over_several_nodes_is_refused_not_walked():
    parents = [int(m) for m in re.findall(r"^node parent=(-?\d+)", TEXT, re.M)]
    text = edit(TEXT, "node", "parent", str(len(parents) - 1), which=parents.index(-1))  # root -> a descendant
    with pytest.raises(IRError, match="line"):
        parse_hir(text)


@pytest.mark.parametrize("line, message", [
    ("frobnicate x=1", "unknown record 'frobnicate'"),
    ("node parent=-1 colour=3", "unknown field 'colour'"),
    ("tree id=3", "field id must be a string"),
])
def test_unknown_records_and_fields_are_refused(line, message):
    with pytest.raises(IRError, match=message):
        parse_hir(TEXT + line + "\n")


def test_harts_ir_on_a_cycle_is_one_line_exit_2(tmp_path, capsys):
    path = tmp_path / "cycle.hir"
    path.write_text(edit(TEXT, "node", "parent", "1"))
    assert main(["ir", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line" in err


MUTATIONS = st.sampled_from(["delete", "duplicate", "digit", "swap", "truncate", "junk"])


@st.composite
def damaged_texts(draw) -> str:
    lines = TEXT.splitlines()
    for _ in range(draw(st.integers(1, 3))):
        k = draw(st.integers(0, len(lines) - 1))
        how = draw(MUTATIONS)
        if how == "delete":
            del lines[k]
        elif how == "duplicate":
            lines.insert(k, lines[k])
        elif how == "digit":
            digits = [m.start() for m in re.finditer(r"\d", lines[k])]
            if digits:
                at = draw(st.sampled_from(digits))
                lines[k] = lines[k][:at] + draw(st.sampled_from("0123456789-")) + lines[k][at + 1:]
        elif how == "swap" and k + 1 < len(lines):
            lines[k], lines[k + 1] = lines[k + 1], lines[k]
        elif how == "truncate":
            lines[k] = lines[k][:draw(st.integers(0, len(lines[k])))]
        else:
            lines[k] += draw(st.sampled_from([" x=1", " parent=", " [", ' "', " tokens=[-1]", " own=5:2"]))
        if not lines:
            break
    return "\n".join(lines) + "\n"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(damaged_texts())
def test_fuzzed_hir_is_read_or_refused_never_crashes(text):
    try:
        parse_hir(text).verify()
    except IRError:
        pass


def test_fuzzed_hir_through_the_command_line_has_bounded_time_and_memory(tmp_path):
    """A few damaged files through `harts ir` in a child with a 2 GB address-space cap and a timeout."""
    paths = []
    for k, value in enumerate(["1", "99", "1000000000000"]):
        field = "len" if value.startswith("1000") else "parent"
        paths.append(tmp_path / f"{k}.hir")
        paths[-1].write_text(edit(TEXT, "node", field, value))

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    for path in paths:
        run = subprocess.run([sys.executable, "-m", "harts_compiler.cli", "ir", str(path)], capture_output=True,
                             text=True, timeout=60, preexec_fn=cap)
        assert run.returncode == 2 and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr


def test_a_cycle_before_layout_is_refused_by_positions():
    """Before layout, parents may follow children; positions still grow along parent links."""
    text = (Path(__file__).parent / "golden" / "small.01-prefix-compress.hir").read_text()
    parse_hir(text).verify()
    with pytest.raises(IRError, match="does not start where its parent"):
        parse_hir(edit(text, "node", "parent", "0", which=3))  # node 3 (a root) under node 0, its own child


@pytest.mark.parametrize("field, value", [("context", "7"), ("replay", "3")])
def test_a_piece_record_that_disagrees_with_its_first_token_is_named(field, value):
    """A piece's recorded context keys and cut replay rows are checked against the forest."""
    token_lists = [[1] * 9 + [2, 3, 4, 5, 6], [1] * 9 + [7, 8, 9, 10]]
    plan = hc.compile(hc.TreeBatch.from_trajectories(token_lists), hc.CompileOptions(chunk_size=4,
                                                                                     microbatch_tokens=10))
    text = format_program(plan.program)[0]
    assert "own=8:18 context=8 replay=0" in text  # the second piece reads the 8 keys before it, chunk-aligned
    with pytest.raises(IRError, match=f"piece 1 records {field}={value}"):
        parse_hir(edit(text, "piece", field, value, which=1)).verify()


def test_a_lone_surrogate_in_a_string_is_refused():
    """json reads `"\\ud800"` into a str that cannot be printed: `harts show` crashed on such a trajectory id."""
    text = TEXT.replace('end id="', 'end id="\\ud800', 1)
    with pytest.raises(IRError, match="lone UTF-16 surrogate"):
        parse_hir(text)


def test_pieces_cut_for_another_budget_than_the_microbatches_have_are_refused():
    plan = hc.compile(hc.TreeBatch.from_trajectories([[1] * 9 + [2, 3, 4, 5, 6], [1] * 9 + [7, 8, 9, 10]]),
                      hc.CompileOptions(chunk_size=4, microbatch_tokens=10))
    text = format_program(plan.program)[0]
    with pytest.raises(IRError, match="cut for a budget of 10 tokens, the microbatches have microbatch_tokens=99"):
        parse_hir(edit(text, "microbatches", "microbatch_tokens", "99")).verify()
