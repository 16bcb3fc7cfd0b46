"""`harts verify`: tree execution of a batch file against trajectory-wise, and its exit code."""
import dataclasses

import torch

from harts_compiler import TreeBatch
from harts_compiler.cli import main
from harts_compiler.verify import VerifyReport, worst_gradient_difference


def _batch(tmp_path):
    torch.manual_seed(0)
    root = torch.randint(0, 128, (70,)).tolist()
    token_lists = [root + torch.randint(0, 128, (n,)).tolist() for n in (5, 30, 61)]
    # a chunk-boundary branch, a prefix, a duplicate
    token_lists += [root[:64] + [1, 2, 3], root[:3], root + token_lists[0][70:]]
    path = tmp_path / "batch.jsonl"
    TreeBatch.from_trajectories(token_lists).save(path)
    return path


def test_verify_passes_on_a_tree_batch(tmp_path, capsys):
    path = _batch(tmp_path)
    assert main(["verify", str(path), "--model", "tiny-qwen3.5-moe", "--chunk-size", "4", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "verified" in out and "aux-loss" in out


def test_verify_fp32_with_checkpointing_and_microbatches(tmp_path, capsys):
    path = _batch(tmp_path)
    args = ["verify", str(path), "--dtype", "float32", "--checkpointing", "--microbatch-tokens", "150",
            "--threads", "1"]
    assert main(args) == 0
    assert "(bar 1e-05) ok" in capsys.readouterr().out


def test_report_fails_when_a_bar_is_missed():
    report = VerifyReport(trajectories=1, trajectory_tokens=10, compact_tokens=5, microbatches=1, rounds=1,
                          dtype=torch.float64, logprob_diff=0.0, entropy_diff=0.0, aux_diff=None,
                          expert_load_diff=None, grad_rel_diff=0.0, worst_param="-", tree_seconds=1.0,
                          trajectory_seconds=1.0)
    assert report.passed
    assert not dataclasses.replace(report, logprob_diff=1e-6).passed
    assert not dataclasses.replace(report, grad_rel_diff=1e-6).passed
    assert not dataclasses.replace(report, expert_load_diff=1.0).passed
    assert "VERIFY FAILED" in dataclasses.replace(report, entropy_diff=1.0).format()


def test_unknown_model_is_a_clear_error(tmp_path, capsys):
    path = _batch(tmp_path)
    assert main(["verify", str(path), "--model", "no-such-model"]) == 2
    assert "neither a preset" in capsys.readouterr().err


def test_worst_gradient_difference_names_the_worst_and_one_sided_gradients():
    want = {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([0.0, 2.0]), "frozen": None}
    got = {"a": torch.tensor([1.0, 0.1]), "b": torch.tensor([0.0, 2.4]), "frozen": None}
    diff, worst = worst_gradient_difference(got, want)
    assert worst == "b" and abs(diff - 0.2) < 1e-6
    assert worst_gradient_difference(want, want) == (0.0, "-")
    diff, worst = worst_gradient_difference({"a": want["a"]}, want)
    assert diff == float("inf") and "b" in worst
