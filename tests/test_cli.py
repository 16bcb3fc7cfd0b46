"""`harts compile / ir / demo` through the console entry point's `main`."""
import json

import pytest

import harts_compiler as hc
from harts_compiler.cli import COMMANDS, main
from harts_compiler.demo import example_batch


@pytest.fixture
def batch_file(tmp_path):
    path = tmp_path / "batch.jsonl"
    example_batch(seed=1).save(path)
    return path


def test_compile_json_keys(batch_file, capsys):
    assert main(["compile", str(batch_file), "--json", "--dp-size", "2", "--chunk-size", "16"]) == 0
    stats = json.loads(capsys.readouterr().out)
    for key in ("trajectories", "trajectory_tokens", "compact_tokens", "compression",
                "replay_tokens", "passes", "microbatches"):
        assert key in stats
    assert [p["name"] for p in stats["passes"]] == ["prefix-compress", "layout", "replay-min", "cut-pieces",
                                                    "schedule"]
    assert all(p["ms"] >= 0 for p in stats["passes"])
    batch = hc.TreeBatch.load(batch_file)
    assert stats["trajectories"] == len(batch)
    assert stats["trajectory_tokens"] == batch.tokens.size
    assert stats["compression"] == pytest.approx(stats["trajectory_tokens"] / stats["compact_tokens"], abs=1e-3)
    # attention pairs counted on the trajectories: each distinct prefix is one compact token at its depth
    trajectories = [batch.trajectory(j).tolist() for j in range(len(batch))]
    prefixes = {tuple(tokens[:p + 1]) for tokens in trajectories for p in range(len(tokens))}
    assert len(prefixes) == stats["compact_tokens"]
    assert stats["attention_pairs"] == sum(len(prefix) for prefix in prefixes)
    assert stats["trajectory_attention_pairs"] == sum(len(t) * (len(t) + 1) // 2 for t in trajectories)
    assert stats["pair_compression"] == pytest.approx(stats["trajectory_attention_pairs"] / stats["attention_pairs"],
                                                      abs=1e-4)
    mbs = stats["microbatches"]
    assert {m["rank"] for m in mbs} <= {0, 1}
    assert sum(m["compact_tokens"] for m in mbs) == stats["compact_tokens"]
    assert sum(m["trajectories"] for m in mbs) == stats["trajectories"]
    assert all(set(m) == {"rank", "slot", "compact_tokens", "trajectories", "rounds", "pieces"} for m in mbs)


def test_compile_pieces_and_schedule_flags(batch_file, capsys):
    """A budget below the largest tree runs it as pieces; the schedule's solver report is in --json."""
    whole = hc.compile(hc.TreeBatch.load(batch_file)).program.forest
    sizes = whole.tree_end - whole.tree_start
    budget = int(max(sizes.max() // 2, whole.traj_length.max()))
    assert budget < sizes.max()
    argv = ["compile", str(batch_file), "--json", "--dp-size", "2", "--microbatch-tokens",
            str(budget), "--objective", "max_rank_total", "--schedule-time-limit", "0.1"]
    assert main(argv) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["pieces"]["pieces"] > stats["pieces"]["split_trees"] >= 1
    assert stats["compact_tokens"] == whole.num_tokens  # pieces compute every token once
    assert stats["planned_tokens"] == whole.num_tokens + stats["replay_tokens"] + stats["cut_replay_rows"]
    schedule = stats["schedule"]
    assert schedule["objective_kind"] == "max_rank_total"
    assert {"status", "objective", "lower_bound", "wall_time_s"} <= set(schedule)
    assert all(max(m["pieces"] or [m["compact_tokens"]]) <= budget for m in stats["microbatches"])
    assert any(m["pieces"] for m in stats["microbatches"])
    assert main(["compile", str(batch_file), "--microbatch-tokens", str(budget)]) == 0
    text = capsys.readouterr().out
    assert "no token computed twice" in text and "schedule" in text
    assert main(["compile", str(batch_file), "--objective", "fastest"]) == 2
    assert "objective" in capsys.readouterr().err


def test_compile_summary_dump_and_plan(batch_file, tmp_path, capsys):
    dump = tmp_path / "ir"
    out = tmp_path / "plan.hir"
    assert main(["compile", str(batch_file), "--dump-ir", str(dump), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "compression" in text and "rank 0 slot 0" in text
    names = sorted(p.name for p in dump.glob("*.hir"))
    assert names == ["00-input.hir", "01-prefix-compress.hir", "02-layout.hir",
                     "03-replay-min.hir", "04-cut-pieces.hir", "05-schedule.hir"]
    plan = hc.Plan.load(out)
    assert plan.stats["compact_tokens"] == hc.compile(hc.TreeBatch.load(batch_file)).stats["compact_tokens"]
    assert main(["ir", str(dump / "03-replay-min.hir")]) == 0
    printed = capsys.readouterr().out
    assert "valid (sequenced)" in printed and "seq tree=" in printed


@pytest.mark.parametrize("lines, needle", [
    (['{"id": "a", "tokens": []}'], "line 1 (trajectory): field tokens: empty token list"),
    (['{"id": "a", "tokens": [1]}', '{"id": "a", "tokens": [2]}'], "duplicate trajectory id 'a'"),
    (['{"id": "a", "tokens": [1, 500]}'], "token 500 >= vocab_size 100"),
])
def test_bad_input_exit_code_2_without_traceback(tmp_path, capsys, lines, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert main(["compile", str(path), "--vocab-size", "100"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_too_large_tree_and_bad_options_exit_2(batch_file, capsys):
    assert main(["compile", str(batch_file), "--microbatch-tokens", "10"]) == 2
    assert "microbatch_tokens=10 is smaller than one chunk" in capsys.readouterr().err
    assert main(["compile", str(batch_file), "--microbatch-tokens", "0"]) == 2
    assert "option microbatch_tokens" in capsys.readouterr().err
    assert main(["compile", str(batch_file), "--dp-size", "0"]) == 2
    assert "option dp_size" in capsys.readouterr().err


def test_ir_rejects_corrupt_file(tmp_path, capsys, batch_file):
    dump = tmp_path / "ir"
    assert main(["compile", str(batch_file), "--dump-ir", str(dump)]) == 0
    text = (dump / "02-layout.hir").read_text()
    # Corrupt one node's multiplicity: the verifier must name it.
    broken = text.replace(" mult=", " mult=9", 1)
    (tmp_path / "broken.hir").write_text(broken)
    capsys.readouterr()
    assert main(["ir", str(tmp_path / "broken.hir")]) == 2
    assert "node_multiplicity" in capsys.readouterr().err


def test_demo_and_usage(capsys):
    assert main(["demo", "--dp-size", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "compression" in out and "verified: tree mode equals trajectory-wise training" in out
    assert main([]) == 2 and main(["--help"]) == 0
    assert main(["nonsense"]) == 2
    assert {"compile", "ir", "demo"} <= set(COMMANDS)


def test_layer_counts_reach_the_cost_model(batch_file, capsys):
    """--linear-layers / --full-layers scale the schedule's predicted cost (defaults: CompileOptions')."""
    objectives = []
    for layers in (["--linear-layers", "3", "--full-layers", "1"], ["--linear-layers", "30", "--full-layers", "10"]):
        assert main(["compile", str(batch_file), "--json", *layers]) == 0
        objectives.append(json.loads(capsys.readouterr().out)["schedule"]["objective"])
    assert objectives[1] > 5 * objectives[0]


def test_compile_with_a_model_predicts_the_step_against_trajectory_wise(batch_file, tmp_path, capsys):
    args = ["compile", "--microbatch-tokens", "512", "--model", "tiny-qwen3-next", "--json"]
    assert main(args[:1] + [str(batch_file)] + args[1:]) == 0
    stats = json.loads(capsys.readouterr().out)
    p = stats["predicted_step"]
    assert p["token_ratio"] == pytest.approx(stats["compression"], rel=1e-3)
    assert p["pair_ratio"] == stats["pair_compression"] and 0 < p["pair_share"] < 1
    # attention shrinks by the pair ratio only; tree mode's per-round and replay costs keep it under its ceiling
    assert p["pair_ratio"] <= p["ceiling"] <= p["token_ratio"]
    assert 1 < p["speedup"] <= p["ceiling"] and p["speedup"] == pytest.approx(p["traj_ms"] / p["tree_ms"])
    # nothing shared: the same work in both modes
    disjoint = tmp_path / "disjoint.jsonl"
    disjoint.write_text("".join(json.dumps({"id": str(i), "tokens": [i * 100 + t for t in range(90)]}) + "\n"
                                for i in range(6)))
    assert main(["compile", str(disjoint)] + args[1:]) == 0
    p = json.loads(capsys.readouterr().out)["predicted_step"]
    assert p["token_ratio"] == p["ceiling"] == 1 and p["speedup"] == pytest.approx(1.0, rel=1e-6)
    assert main(["compile", str(disjoint), "--microbatch-tokens", "512", "--model", "tiny-qwen3-next"]) == 0
    assert "predicted step" in capsys.readouterr().out
