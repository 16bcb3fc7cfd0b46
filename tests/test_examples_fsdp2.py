"""examples/grpo_fsdp2.py runs under torchrun as a user starts it, on 2 CPU ranks (gloo, --tiny).

Two launches from the same weights and batch: FSDP2 alone and with expert parallelism over both
ranks (`--ep 2`). Both must print every step's loss, and the first step's losses (same weights, same
batch, same objective) must agree to fp32 rounding, as must the later ones (AdamW steps from equal
gradients). Each rank must hold about half of what one replica holds (parameters, gradients, AdamW
state), and the two halves must cover it.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_fsdp2.py"
STEPS = 2
STEP_LINE = re.compile(r"^step (\d+): loss (\S+)\s+\S+ trajectory tokens/s", re.M)
BYTES_LINE = re.compile(r"^rank (\d+): parameters \+ gradients \+ AdamW state (\S+) MiB sharded vs (\S+) MiB "
                        r"replicated", re.M)


def run_example(*extra: str, timeout_s: float = 120) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(EXAMPLE), "--steps", str(STEPS), *extra]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=EXAMPLE.parents[1])
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def outputs() -> dict[str, str]:
    return {"fsdp": run_example("--tiny"), "ep": run_example("--tiny", "--ep", "2")}


def test_both_layouts_take_the_same_steps(outputs):
    losses = {}
    for name, out in outputs.items():
        steps = [(int(m[1]), float(m[2])) for m in STEP_LINE.finditer(out)]
        assert [s for s, _ in steps] == list(range(STEPS)), out
        losses[name] = [loss for _, loss in steps]
        assert "2 rank(s) on cpu" in out and f"ep={2 if name == 'ep' else 1}" in out, out
    for fsdp, ep in zip(losses["fsdp"], losses["ep"]):
        assert abs(fsdp - ep) <= 1e-6 * max(abs(fsdp), 1e-3), losses
    assert losses["fsdp"][0] != losses["fsdp"][-1], "AdamW's steps changed nothing"


def test_each_rank_holds_half_of_a_replica(outputs):
    for name, out in outputs.items():
        mib = lambda text: float(text.replace(",", ""))  # noqa: E731
        ranks = {int(m[1]): (mib(m[2]), mib(m[3])) for m in BYTES_LINE.finditer(out)}
        assert sorted(ranks) == [0, 1], out
        replicated = {r for _, r in ranks.values()}
        assert len(replicated) == 1, out
        (full,) = replicated
        assert all(0.4 * full < local < 0.6 * full for local, _ in ranks.values()), f"{name}: {ranks}"
        assert sum(local for local, _ in ranks.values()) >= full - 0.01, f"{name}: {ranks}"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_with_and_without_expert_parallelism_agree():
    """The GPU default model (bf16 compute, NCCL): FSDP2 alone and --ep 2 from the same weights; the first
    step's losses agree to bf16 rounding, and each GPU reports its peak memory."""
    losses = {}
    for name, extra in (("fsdp", ()), ("ep", ("--ep", "2"))):
        out = run_example(*extra, timeout_s=900)
        losses[name] = [float(m[2]) for m in STEP_LINE.finditer(out)]
        assert len(losses[name]) == STEPS and "max_memory_allocated" in out, out
    assert abs(losses["fsdp"][0] - losses["ep"][0]) <= 2e-3 * max(1.0, abs(losses["fsdp"][0])), losses
