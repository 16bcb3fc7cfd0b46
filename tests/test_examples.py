"""The "drop into your stack" example (examples/grpo_step_hf.py) runs and its checks mean something.

The example is documentation that verifies itself: a GRPO step with `TreeModel.from_hf` against the
HF model's own forward. Here it runs at its smallest size (a few seconds) as a user would run it,
and once in-process with the ordinary path's weights perturbed, where it must report the miss.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_step_hf.py"
SMALLEST = ["--tasks", "2", "--rollouts-per-task", "2", "--scale", "0.01"]
CHECK_LINE = re.compile(r"^(?P<label>max \|log-prob diff\||\|loss diff\||max rel\. gradient diff|"
                        r"max \|parameter diff\| after step)\s+(?P<value>\S+)\s+\(bar (?P<bar>\S+)\) "
                        r"(?P<verdict>ok|MISSED)$", re.M)


def parse_checks(output: str) -> dict[str, tuple[float, float, str]]:
    return {m["label"]: (float(m["value"]), float(m["bar"]), m["verdict"]) for m in CHECK_LINE.finditer(output)}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_grpo_step_example_agrees_with_hf(dtype):
    result = subprocess.run([sys.executable, str(EXAMPLE), *SMALLEST, "--dtype", dtype],
                            capture_output=True, text=True, timeout=300, cwd=EXAMPLE.parents[1])
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    checks = parse_checks(out)
    assert len(checks) == 4, out  # log-prob, loss, gradient, parameter lines all printed
    for label, (value, bar, verdict) in checks.items():
        assert verdict == "ok" and 0.0 <= value <= bar, f"{label}: {value} vs bar {bar}\n{out}"
    assert checks["max |log-prob diff|"][1] == pytest.approx(1e-5)
    assert checks["max rel. gradient diff"][1] == pytest.approx(5e-5)
    assert "TreeModel shares the HF model's parameters (no copy): True" in out
    assert "agree: HARTS step == ordinary HF step" in out
    # the smallest size still exercises several microbatches, several groups and shared prefixes
    summary = re.search(r"(\d+) trajectories in (\d+) GRPO groups, (\d+) microbatch", out)
    assert summary and int(summary[2]) >= 2 and int(summary[3]) >= 2, out
    assert float(re.search(r"compression (\S+)x", out)[1]) > 1.5, out


def load_example():
    spec = importlib.util.spec_from_file_location("grpo_step_hf", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_step_example_reports_a_disagreement(monkeypatch, capsys):
    example = load_example()
    ordinary_step = example.ordinary_step

    def ordinary_step_on_other_weights(model, *args):
        with torch.no_grad():  # a reference that is not the same model: every check must see it
            model.lm_head.weight.mul_(1.5)
        return ordinary_step(model, *args)

    monkeypatch.setattr(example, "ordinary_step", ordinary_step_on_other_weights)
    assert example.main(SMALLEST) == 1
    out = capsys.readouterr().out
    checks = parse_checks(out)
    assert len(checks) == 4, out
    for label in ("max |log-prob diff|", "|loss diff|", "max rel. gradient diff", "max |parameter diff| after step"):
        value, bar, verdict = checks[label]
        assert verdict == "MISSED" and value > bar, f"{label} not reported as a miss\n{out}"
    assert "DISAGREE" in out
