"""`harts verify`: tree execution of a batch file against trajectory-wise, and its exit code."""
import dataclasses

import pytest
import torch

from harts_compiler import TreeBatch
from harts_compiler.cli import main
from harts_compiler.verify import VerifyReport, worst_gradient_difference


def _token_lists():
    torch.manual_seed(0)
    root = torch.randint(0, 128, (70,)).tolist()
    token_lists = [root + torch.randint(0, 128, (n,)).tolist() for n in (5, 30, 61)]
    # a chunk-boundary branch, a prefix, a duplicate
    return token_lists + [root[:64] + [1, 2, 3], root[:3], root + token_lists[0][70:]]


def _batch(tmp_path):
    path = tmp_path / "batch.jsonl"
    TreeBatch.from_trajectories(_token_lists()).save(path)
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


def test_verify_bfloat16_measures_both_modes_against_float64(tmp_path, capsys):
    path = _batch(tmp_path)
    args = ["verify", str(path), "--dtype", "bfloat16", "--chunk-size", "4", "--threads", "1", "--quiet"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "error against a float64 trajectory-wise run" in out and "within 2x on every measure" in out


def test_verify_bfloat16_fails_a_tree_mode_further_from_float64(tmp_path, capsys, monkeypatch):
    """The bar can fail: tree-mode log-probs moved by 0.05 (about 20x a bfloat16 run's error here) are refused."""
    import harts_compiler.runtime.distributed as distributed
    assemble = distributed.assemble_rows

    def shifted(plan, outputs, field):
        rows, *rest = assemble(plan, outputs, field)
        return (rows + 0.05 if field == "logprobs" else rows, *rest)
    monkeypatch.setattr(distributed, "assemble_rows", shifted)
    path = _batch(tmp_path)
    assert main(["verify", str(path), "--dtype", "bfloat16", "--chunk-size", "4", "--threads", "1", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "log-prob   tree" in out and "MISSED" in out and "VERIFY FAILED" in out


def test_half_report_judges_each_measure_against_trajectory_wise():
    from harts_compiler.verify_report import ModeErrors, ReferenceErrors
    traj = ModeErrors(logprob=1e-2, entropy=1e-3, gradient=1e-2, worst_param="w")
    reference = ReferenceErrors(tree=traj, trajectory=traj, factor=2.0)
    report = VerifyReport(trajectories=1, trajectory_tokens=10, compact_tokens=5, microbatches=1, rounds=1,
                          dtype=torch.bfloat16, logprob_diff=1e-2, entropy_diff=0.0, aux_diff=None,
                          expert_load_diff=None, grad_rel_diff=0.0, worst_param="-", tree_seconds=1.0,
                          trajectory_seconds=1.0, reference=reference, against_reference=True)
    assert report.passed
    assert not dataclasses.replace(report, reference=None).passed  # nothing measured: nothing verified
    worse = dataclasses.replace(reference, tree=dataclasses.replace(traj, gradient=2.1e-2))
    assert not dataclasses.replace(report, reference=worse).passed
    exact = ModeErrors(logprob=0.0, entropy=0.0, gradient=0.0, worst_param="-")
    floor = ReferenceErrors(tree=dataclasses.replace(exact, logprob=5e-7), trajectory=exact, factor=2.0)
    assert all(ok for *_, ok in floor.checks())  # below the floors no ratio is taken


def test_bad_devices_and_factors_are_clear_errors(tmp_path, capsys):
    path = _batch(tmp_path)
    for flags, expect in ((["--device", "tpu"], "expected cpu, cuda or cuda:N"),
                          (["--device", "cuda:64"], "CUDA device(s)"),
                          (["--error-factor", "0.5"], "--error-factor must be a number >= 1")):
        assert main(["verify", str(path), *flags]) == 2
        err = capsys.readouterr().err
        assert expect in err and err.count("\n") == 1, err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_verify_a_checkpoint_on_the_gpu_kernels(tmp_path, capsys, dtype):
    """`harts verify --device cuda` on a checkpoint whose head dims run the Triton / Gluon kernels in bfloat16 (float32
    runs the torch paths, whose CUDA reductions follow the packing): tree mode as close to float64 as
    trajectory-wise training."""
    from harts_compiler.runtime import TreeModel
    from harts_compiler.runtime.checkpoint import export_pretrained
    from test_runtime_gpu import GPU_CONFIG
    export_pretrained(TreeModel.from_config(GPU_CONFIG, seed=0, dtype=torch.float32), tmp_path / "ckpt")
    TreeBatch.from_trajectories(_token_lists()).save(tmp_path / "batch.jsonl")
    args = ["verify", str(tmp_path / "batch.jsonl"), "--model", str(tmp_path / "ckpt"), "--device", "cuda",
            "--dtype", dtype, "--quiet"]
    assert main(args) == 0
    assert "error against a float64 trajectory-wise run" in capsys.readouterr().out
