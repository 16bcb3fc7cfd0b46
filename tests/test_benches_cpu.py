"""Toy-size CPU runs of bench/e2e.py and bench/calibrate.py, so the GPU benchmarks cannot rot:
they must finish, write their JSON to $OUT, and report what the GPU runs report."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harts_compiler.passes import cost_model as cm

BENCH = Path(__file__).resolve().parent.parent / "bench"


def run_bench(script: str, out_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OUT=str(out_dir), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(BENCH / script), "--device", "cpu", "--tiny", *args],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.parametrize("model", ["qwen3-next", "kimi-linear"])
def test_device_drawn_model_matches_from_config_distributions(model):
    """The GPU benches draw weights on the device; check that path (here on CPU) initialises
    every parameter like TreeModel.from_config does, and trains."""
    sys.path.insert(0, str(BENCH))
    try:
        import common
    finally:
        sys.path.remove(str(BENCH))
    config = common.model_config(tiny=True, model=model)
    cpu = torch.device("cpu")
    drawn = common.build_model(config, cpu, torch.float32, seed=1, draw_on_device=True)
    reference = common.build_model(config, cpu, torch.float32, seed=1)
    named = dict(reference.named_parameters())
    for name, param in drawn.named_parameters():
        ref = named.pop(name)
        assert param.shape == ref.shape and torch.isfinite(param).all(), name
        if ref.numel() > 16 and ref.std() > 0:  # same distribution: std within 30%
            assert abs(param.std().item() / ref.std().item() - 1) < 0.3, name
        elif ref.numel() > 1 and "A_log" not in name:
            assert torch.equal(param, ref), name  # constant inits (norms, dt_bias)
    assert not named
    batch, _ = common.sized_batch("grpo", 50, length_scale=0.01, vocab_size=config.vocab_size, rollouts=2)
    _, indices, *_ = common.plan_microbatches(batch, 4096, cpu, chunk_size=16, conv_width=4)
    common.Step(drawn, indices, int(batch.lengths.sum()))()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in drawn.parameters())


@pytest.mark.parametrize("model,family", [("qwen3-next", "next"), ("kimi-linear", "kimi")])
def test_e2e_tiny_cpu(tmp_path, model, family):
    result = run_bench("e2e.py", tmp_path, "--model", model)
    payload = json.loads((tmp_path / "e2e.json").read_text())
    assert payload["failures"] == [] and payload["model"]["family"] == family
    rows = {row["preset"]: row for row in payload["rows"]}
    assert set(rows) == {"swe", "tau2", "grpo"}
    for preset, row in rows.items():
        assert row["compact_tokens"] < row["trajectory_tokens"], preset
        assert row["planned_tokens"] >= row["compact_tokens"]  # split trees recompute root paths
        assert row["ideal"] == round(row["trajectory_tokens"] / row["compact_tokens"], 4)
        assert row["tree_ms"] > 0 and row["traj_ms"] > 0
        assert math.isclose(row["speedup"], row["traj_ms"] / row["tree_ms"])
        # float64 reference: both bf16 modes carry a real, finite error; tree within the factor
        assert 0 < row["err_traj"] < 0.1 and 0 <= row["err_tree"] < 0.1
        assert row["numerics_ok"] is True
        assert row["grad_rel_diff"] < 0.05
        parts = row["breakdown_ms"]
        for component in ("linear attention", "attention", "log-probs", "MoE/MLP"):
            assert parts.get(component, 0) > 0, (preset, component, parts)
        assert parts["total"] > 0 and row["tree_predicted_ms"] > 0
    assert "swe ours (trajectory mode)" in result.stdout  # no fla on the CPU: our trajectory mode is the baseline
    assert "speedup" in result.stdout and "of ideal" in result.stdout


def test_calibrate_tiny_cpu(tmp_path):
    result = run_bench("calibrate.py", tmp_path, "--write", str(tmp_path / "written.json"))
    files = sorted(p.name for p in tmp_path.glob("cost_model_*.json"))
    assert len(files) == 1, files
    model = cm.load_cost_model(tmp_path / files[0])
    assert model.device and model.date and model.source.endswith(files[0])  # loaded: source = file
    assert json.loads((tmp_path / files[0]).read_text())["source"] == "bench/calibrate.py"
    assert model.fit["held_out"]["count"] > 0 and model.fit["train"]["count"] > 0
    assert model.fit["median_rel_err"] == model.fit["held_out"]["median_rel_err"]
    assert min(model.coefficients.values()) >= 0
    assert len(model.fit["measurements"]) == 3 * 8  # three layer variants x eight shapes
    assert cm.load_cost_model(tmp_path / "written.json").coefficients == model.coefficients
    assert "held_out" in result.stdout and "median relative error" in result.stdout


def test_gdn_batch_tiny_cpu(tmp_path):
    """bench/gdn_batch.py: tree vs trajectory-wise GDN rounds on generated batches."""
    result = run_bench("gdn_batch.py", tmp_path)
    table = result.stdout.splitlines()[-3:]
    assert "tree ms" in table[0] and "of ideal" in table[0]
    for line, preset in zip(table[1:], ["swe", "tau2"]):
        cells = line.split()
        assert cells[0] == preset
        assert all(math.isfinite(float(c)) and float(c) > 0 for c in cells[1:]), line


def test_gdn_scans_interpreted(tmp_path):
    """bench/gdn_scans.py: the scans alone under a launch, on the Triton interpreter at a toy size (one head)."""
    env = dict(os.environ, OUT=str(tmp_path), OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, str(BENCH / "gdn_scans.py"), "--device", "cpu", "--shrink", "512",
                             "--cases", "root1", "roots6", "--launches", "16:4", "--stages", "3",
                             "--value-heads", "1"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    best = result.stdout.splitlines()[-2:]
    assert best[0].startswith("root1") and best[1].startswith("roots6"), best
    assert all("nan" not in line for line in best), best


def test_gdn_batch_chunk_ratio_is_below_the_token_ratio(tmp_path):
    """bench/gdn_batch.py --chunks-only: per-sequence partial chunks and replays cost tree mode chunks."""
    result = run_bench("gdn_batch.py", tmp_path, "--chunks-only")
    for line in result.stdout.splitlines()[-2:]:
        cells = line.split()
        ideal, chunk_ratio = float(cells[4]), float(cells[5])
        assert 0 < chunk_ratio <= ideal + 1e-9, line


def test_gdn_batch_plans_the_gdn_tree_cases_with_the_compiler(tmp_path):
    """bench/gdn_batch.py --trees: bench/gdn.py's agentic batch as the compiler plans it, one microbatch of two
    rounds in which each tree's first branch continues its root's sequence (docs/design.md section 6), so round 0
    holds the 6 roots and round 1 the other 36 branches, and fewer chunks than gdn.py's hand-made plan (1,254)."""
    result = run_bench("gdn_batch.py", tmp_path, "--presets", "--trees", "agentic", "--chunks-only")
    row = next(line for line in result.stdout.splitlines() if line.startswith("[agentic 6 trees]"))
    assert "'rounds': 2" in row and "'sequences': [[6, 36]]" in row, row
    assert "'compact': 77518" in row and "'trajectory_tokens': 188513" in row, row
    assert f"'chunk_ratio': {2963 / 1248}" in row, row


def test_attention_tiny_cpu(tmp_path, monkeypatch):
    # the plain-torch path (the kernels have their own interpreter tests): the script must run and report
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    result = run_bench("attention.py", tmp_path)
    payload = json.loads((tmp_path / "attention.json").read_text())
    assert set(payload["table"]) == {"gqa", "mla"}
    for shape, rows in payload["table"].items():
        assert {row["case"] for row in rows} == {"P64 B3 L48", "single 256", "P64 ctx + B3 L48"}, shape
        for row in rows:
            assert row["ours_fwd"] > 0 and row["ours_bwd_tflops"] > 0 and row["flash_fwd_of_ideal"] > 0, row
        suffix = next(row for row in rows if "ctx" in row["case"])
        assert suffix["queries"] < suffix["compact"] and suffix["ideal"] == 1.0  # no query shares work
        assert rows[0]["ideal"] > 1
        errors = payload["errors"][shape]
        assert len(errors) == 2 and all(max(e["ours"]) < 1e-5 for e in errors), errors
    assert "fwd of ideal (cuDNN)" in result.stdout
