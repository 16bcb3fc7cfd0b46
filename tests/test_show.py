"""`harts show`: the printed trees and load table agree with counts worked out by hand; --png writes a PNG;
bad input is one line and exit 2."""
import json
import re
import sys

import pytest

import harts_compiler as hc
from harts_compiler.cli import main

CHUNK = 4
# Tree 1: a root of 6 tokens shared by all four, then "7 8 9 10" (a) and "20" (b, c, d), which branches into
# "21 22" (b) and "30" (c ends there, d continues with "31"). Tree 2: "50 51" then "52" (e) and "53 54" (f).
TRAJECTORIES = {
    "a": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    "b": [1, 2, 3, 4, 5, 6, 20, 21, 22],
    "c": [1, 2, 3, 4, 5, 6, 20, 30],
    "d": [1, 2, 3, 4, 5, 6, 20, 30, 31],
    "e": [50, 51, 52],
    "f": [50, 51, 53, 54],
}
# (start, end) -> (shared, children, trajectories ending there, chunks text with C=4)
TREE_1 = {
    (0, 6): (4, 2, "", "0-1, cut at 4"),
    (6, 10): (1, 0, "a", "1-2, cut at 8"),
    (6, 7): (3, 2, "", "1"),
    (7, 9): (1, 0, "b", "1-2, cut at 8"),
    (7, 8): (2, 1, "c", "1"),
    (8, 9): (1, 0, "d", "2"),
}
TREE_2 = {(0, 2): (2, 2, "", "0"), (2, 3): (1, 0, "e", "0"), (2, 4): (1, 0, "f", "0")}

ROW = re.compile(r"^  [│├└─ ]*(?P<node>\d+)\s+\[(?P<start>[\d,]+), (?P<end>[\d,]+)\)\s+(?P<tokens>[\d,]+)\s+"
                 r"(?P<shared>[\d,]+)\s+(?:(?P<branch>\d+)\s+)?(?P<chunks>\d+(?:-\d+)?(?:, cut at \d+|, \d+ cuts)?)"
                 r"\s+round (?P<round>\d+), (?P<sequence>continues|replay \d+)"
                 r"(?:\s+(?P<piece>\d+(?:-\d+)?(?:, cut at \d+|, \d+ cuts)?))?(?:\s+ends (?P<ends>.*))?$")


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def parse_trees(text: str) -> list[list[dict]]:
    """The node rows of each printed tree (a tree starts at its `tree '...'` header)."""
    trees = []
    for line in text.splitlines():
        if line.startswith("tree '"):
            trees.append([])
        match = ROW.match(line)
        if match:
            trees[-1].append(match.groupdict())
    return trees


@pytest.fixture
def batch_file(tmp_path):
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps({"id": key, "tokens": tokens}) + "\n" for key, tokens in TRAJECTORIES.items()))
    return path


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_tree_rows_match_the_hand_counts(batch_file, capsys):
    code, out, _ = run(["show", str(batch_file), "--chunk-size", str(CHUNK), "--dp-size", "2", "--trees", "0"], capsys)
    assert code == 0
    trees = parse_trees(out)
    assert len(trees) == 2
    by_root = {len(rows): rows for rows in trees}
    for expected, rows in ((TREE_1, by_root[6]), (TREE_2, by_root[3])):
        seen = {}
        for row in rows:
            start, end = _number(row["start"]), _number(row["end"])
            assert _number(row["tokens"]) == end - start
            seen[(start, end)] = (_number(row["shared"]), int(row["branch"] or 0), row["ends"] or "", row["chunks"])
            # A node that does not continue its parent's sequence starts at the aligned boundary below its
            # first token and replays the ancestor tokens in between.
            if row["sequence"] != "continues":
                assert row["sequence"] == f"replay {start % CHUNK}"
        assert {key: (shared, children if children > 1 else 0, ends, chunks)
                for key, (shared, children, ends, chunks) in expected.items()} == seen
        roots = [row for row in rows if not row["sequence"] == "continues" and row["start"] == "0"]
        assert len(roots) == 1 and roots[0]["round"] == "0"
    # one child of every inner node continues its parent's sequence, the others start sequences of their own:
    # inner nodes are both roots, "20" and "30"
    continuing = sum(row["sequence"] == "continues" for rows in trees for row in rows)
    assert continuing == 4
    plan = hc.compile(hc.TreeBatch.load(batch_file), hc.CompileOptions(chunk_size=CHUNK, dp_size=2))
    replay = sum(int(row["sequence"].split()[1]) for rows in trees for row in rows if row["sequence"] != "continues")
    assert replay == plan.stats["replay_tokens"]
    assert "trees not shown" not in out


def parse_grid(text: str, title: str) -> dict[str, list[float]]:
    """A rank x slot block of the schedule tables: row label -> the numbers of its cells ('-' = None)."""
    lines = text.splitlines()
    lines = lines[next(k for k, line in enumerate(lines) if line.startswith(title)) + 2:]  # after title and header
    rows = {}
    for line in lines:
        label, _, rest = line.strip().partition(" ")
        if label == "slot":
            number, _, rest = rest.strip().partition(" ")
            label = f"slot {number}"
        elif label != "total":
            break
        rows[label] = [None if cell == "-" else float(cell.replace(",", "")) for cell in rest.split()]
    return rows


def test_load_table_totals(batch_file, capsys):
    code, out, _ = run(["show", str(batch_file), "--chunk-size", str(CHUNK), "--dp-size", "2"], capsys)
    assert code == 0
    assert "schedule: 2 ranks x 1 slots" in out
    tokens, trajectories = parse_grid(out, "compact tokens"), parse_grid(out, "trajectories")
    ms = parse_grid(out, "predicted fwd+bwd ms")
    compact = sum(end - start for tree in (TREE_1, TREE_2) for start, end in tree)
    assert compact == 20
    assert tokens == {"slot 0": tokens["slot 0"], "total": tokens["slot 0"]}  # one slot: the totals are that slot
    assert sorted(tokens["slot 0"][:2]) == [5, 15] and tokens["slot 0"][2] == compact  # a tree per rank, then sum
    assert sorted(trajectories["slot 0"][:2]) == [2, 4] and trajectories["slot 0"][2] == len(TRAJECTORIES)
    assert all(value > 0 for value in ms["slot 0"])
    assert ms["slot 0"][2] == max(ms["slot 0"][:2])  # a lockstep slot lasts as long as its slowest rank
    assert "imbalance: slowest rank" in out


def test_tree_limit_says_what_was_left_out(batch_file, capsys):
    code, out, _ = run(["show", str(batch_file), "--chunk-size", str(CHUNK), "--trees", "1"], capsys)
    assert code == 0
    assert len(parse_trees(out)) == 1
    assert "1 more trees not shown" in out
    code, out, _ = run(["show", str(batch_file), "--chunk-size", str(CHUNK), "--trees", "1", "--nodes", "2"], capsys)
    assert len(parse_trees(out)[0]) == 2 and "more nodes" in out


def test_saved_plan_shows_like_its_batch(batch_file, tmp_path, capsys):
    plan = hc.compile(hc.TreeBatch.load(batch_file), hc.CompileOptions(chunk_size=CHUNK, dp_size=2))
    saved = tmp_path / "plan.hir"
    plan.save(saved)
    _, from_batch, _ = run(["show", str(batch_file), "--chunk-size", str(CHUNK), "--dp-size", "2"], capsys)
    code, from_plan, _ = run(["show", str(saved)], capsys)
    assert code == 0 and from_plan == from_batch
    code, _, err = run(["show", str(saved), "--dp-size", "4"], capsys)
    assert code == 2 and "--dp-size" in err and len(err.splitlines()) == 1


def test_saved_plan_under_any_name(batch_file, tmp_path, capsys):
    """`harts compile -o PLAN` takes any name: show reads a plan by its text, and the commands that want a JSONL
    batch refuse one in a single line instead of a line of JSON errors per plan line."""
    plan = hc.compile(hc.TreeBatch.load(batch_file), hc.CompileOptions(chunk_size=CHUNK))
    plan.save(tmp_path / "plan.hir")
    plan.save(tmp_path / "plan_out")
    _, from_hir, _ = run(["show", str(tmp_path / "plan.hir")], capsys)
    code, from_any, _ = run(["show", str(tmp_path / "plan_out")], capsys)
    assert code == 0 and from_any == from_hir
    for command in ("compile", "verify"):
        code, _, err = run([command, str(tmp_path / "plan_out")], capsys)
        assert code == 2 and len(err.splitlines()) == 1 and "a saved plan" in err, err


def test_unscheduled_dump(batch_file, tmp_path, capsys):
    """A dump after replay-min (no schedule) shows its trees and rounds and says there is no table; its chunk
    size is the sequences' own (a dump carries no options)."""
    plan = hc.compile(hc.TreeBatch.load(batch_file), hc.CompileOptions(chunk_size=CHUNK),
                      passes=["prefix-compress", "layout", "replay-min"])
    saved = plan.dump_ir(tmp_path / "dump")  # the form --dump-ir writes: no options header
    code, out, _ = run(["show", str(saved), "--png", str(tmp_path / "sequenced.png")], capsys)
    assert code == 0 and "not scheduled" in out and f"chunk size {CHUNK}" in out
    assert len(parse_trees(out)[0]) == 6 and (tmp_path / "sequenced.png").stat().st_size > 0


def test_png_is_written(batch_file, tmp_path, capsys):
    png = tmp_path / "plan.png"
    code, out, _ = run(["show", str(batch_file), "--chunk-size", str(CHUNK), "--dp-size", "2", "--png", str(png)],
                       capsys)
    assert code == 0 and f"wrote {png}" in out
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def _bad(tmp_path):
    not_json = tmp_path / "bad.jsonl"
    not_json.write_text('{"id": "a", "tokens": [1, 2\n')
    not_hir = tmp_path / "bad.hir"
    not_hir.write_text("this is not a plan\n")
    return {"missing": [str(tmp_path / "none.jsonl")], "directory": [str(tmp_path)], "jsonl": [str(not_json)],
            "hir": [str(not_hir)]}


@pytest.mark.parametrize("case", ["missing", "directory", "jsonl", "hir", "png-dir-missing", "png-is-dir",
                                  "trees"])
def test_bad_input_is_one_line_and_exit_2(case, batch_file, tmp_path, capsys):
    argv = {**_bad(tmp_path),
            "png-dir-missing": [str(batch_file), "--png", str(tmp_path / "no" / "such" / "x.png")],
            "png-is-dir": [str(batch_file), "--png", str(tmp_path)],
            "trees": [str(batch_file), "--trees", "-1"]}[case]
    code, out, err = run(["show", *argv], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("harts show: ") and "Traceback" not in err
    assert not out


def test_png_without_matplotlib(batch_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    code, _, err = run(["show", str(batch_file), "--png", str(tmp_path / "x.png")], capsys)
    assert code == 2 and "install harts-compiler[show]" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.png").exists()


def test_generated_batch_invariants(tmp_path, capsys):
    """On a generated batch: every trajectory token is counted once over (node tokens x shared), each
    trajectory ends at exactly one node, the table's cells add up to the plan's compact tokens, and the trees
    over the budget list their pieces in layout order, each piece within the budget."""
    from harts_compiler.generator import generate, write_jsonl

    path = tmp_path / "gen.jsonl"
    write_jsonl(generate("swe", 0, tasks=6, rollouts=3, scale=0.01), path, "flat")
    batch = hc.TreeBatch.load(path)
    code, out, _ = run(["show", str(path), "--trees", "0", "--nodes", "100000", "--dp-size", "2",
                        "--microbatch-tokens", "400"], capsys)
    assert code == 0
    trees = parse_trees(out)
    rows = [row for rows in trees for row in rows]
    plan = hc.compile(batch, hc.CompileOptions(dp_size=2, microbatch_tokens=400))
    assert len(rows) == plan.stats["nodes"]
    assert sum(_number(r["tokens"]) * _number(r["shared"]) for r in rows) == batch.tokens.size
    ends = [name.strip() for r in rows if r["ends"] for name in r["ends"].split(",") if "+" not in name]
    assert len(ends) <= len(batch) and set(ends) <= set(batch.ids)
    pieced = [tree for tree in trees if tree[0]["piece"] is not None]
    assert len(pieced) == len(set(plan.program.pieces.piece_tree.tolist())) > 0
    for tree in pieced:
        spans = [tuple(int(k) for k in row["piece"].split(",")[0].split("-")) for row in tree]
        firsts = [span[0] for span in spans]
        assert firsts == sorted(firsts) and firsts[0] == 0  # pieces are ranges of the layout order
        whole = {}  # tokens of the nodes that lie in one piece
        for row, span in zip(tree, spans):
            if len(span) == 1:
                whole[span[0]] = whole.get(span[0], 0) + _number(row["tokens"])
        assert 0 < max(whole.values()) <= 400
    tokens, ms = parse_grid(out, "compact tokens"), parse_grid(out, "predicted fwd+bwd ms")
    slots = [label for label in tokens if label != "total"]
    assert len(slots) == max(mb["slot"] for mb in plan.stats["microbatches"]) + 1 > 1
    assert tokens["total"][-1] == sum(tokens[s][-1] for s in slots) == plan.stats["compact_tokens"]
    for rank in range(2):
        assert tokens["total"][rank] == sum(tokens[s][rank] or 0 for s in slots)
        # each printed value is rounded to 0.1 ms: the slots' sum may drift by half of that per slot
        assert ms["total"][rank] == pytest.approx(sum(ms[s][rank] or 0 for s in slots), abs=0.05 * (len(slots) + 1))


def test_docs_sample_is_current(tmp_path, capsys, monkeypatch):
    """docs/show.md's commands, run again, print the trees it shows (the times below them depend on the fitted
    cost model, so only the plan's structure is compared)."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "show.md").read_text()
    commands = [line.split()[1:] for line in doc.splitlines() if line.startswith(("harts gen ", "harts show "))]
    assert [c[0] for c in commands] == ["gen", "show"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    assert main(commands[0]) == 0
    capsys.readouterr()
    code, out, _ = run(commands[1], capsys)
    assert code == 0 and (tmp_path / "docs" / "show_example.png").stat().st_size > 10_000
    structure = out[:out.index("schedule: ")].rstrip("\n")
    assert structure in doc
