"""`harts verify` in bounded memory: microbatched runs equal one-shot runs, the memory estimate refuses
what cannot fit, and bad input is one line with exit 2."""
import json

import pytest
import torch

from harts_compiler import CompileOptions, TreeBatch, compile
from harts_compiler.cli import main
from harts_compiler.runtime.trajectory import trajectory_packs
from harts_compiler.verify import load_model, verify_plan, worst_gradient_difference
from harts_compiler.verify_memory import Footprint, activation_bytes, parse_memory_size


def _token_lists():
    gen = torch.Generator().manual_seed(1)
    randint = lambda n: torch.randint(0, 128, (n,), generator=gen).tolist()  # noqa: E731
    root = randint(40)
    lists = [root + randint(n) for n in (7, 25, 33)]
    lists += [root[:16] + randint(9), root[:5], list(lists[1]), randint(20)]  # fork on a chunk edge, prefix, duplicate
    return lists


@pytest.fixture
def batch_file(tmp_path):
    path = tmp_path / "batch.jsonl"
    TreeBatch.from_trajectories(_token_lists()).save(path)
    return path


def _verify(model, batch, *, tree_tokens, pack_tokens):
    plan = compile(batch, CompileOptions.for_model(model, chunk_size=8, microbatch_tokens=tree_tokens))
    return verify_plan(model, batch, plan, microbatch_tokens=pack_tokens)


def _assert_same_gradients(got, want):
    diff, worst = worst_gradient_difference(got, want)
    assert diff <= 1e-10, (diff, worst)


@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-qwen3-next"])
def test_microbatched_verify_accumulates_the_one_shot_gradients(preset):
    torch.set_num_threads(1)
    model = load_model(preset, torch.float64)
    batch = TreeBatch.from_trajectories(_token_lists())
    split = _verify(model, batch, tree_tokens=60, pack_tokens=50)  # no room for the small tree to ride
    assert split.microbatches > 1 and split.trajectory_packs > 2 and split.passed
    if preset == "tiny-qwen3.5":  # dense: the one-shot objective is the same sum of microbatch objectives
        reference = _verify(model, batch, tree_tokens=None, pack_tokens=10_000)
        assert reference.microbatches == 1 and reference.trajectory_packs == 1
    else:  # MoE: the aux loss enters only unsplit runs, so compare two different splits
        reference = _verify(model, batch, tree_tokens=100, pack_tokens=120)
        assert reference.aux_diff is None and reference.trajectory_packs != split.trajectory_packs
    for mode in (0, 1):  # tree mode, trajectory-wise
        _assert_same_gradients(split.gradients[mode], reference.gradients[mode])
    # and the check can fail: a different objective seed gives different gradients
    other = verify_plan(model, batch, compile(batch, CompileOptions.for_model(model, chunk_size=8)), seed=1,
                        microbatch_tokens=10_000)
    assert worst_gradient_difference(other.gradients[1], reference.gradients[1])[0] > 1e-3


def test_memory_estimate_refuses_in_one_line(batch_file, capsys):
    assert main(["verify", str(batch_file), "--memory-limit", "64M", "--threads", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--memory-limit is 64 MiB" in err and "--microbatch-tokens" in err and "needs about" in err
    assert "--dtype float32" in err  # float64 run: float32 would halve it
    assert main(["verify", str(batch_file), "--memory-limit", "64M", "--dtype", "bfloat16", "--threads", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs about" in err and "--dtype float32" not in err  # a bf16 run is not helped by float32


def test_the_float64_reference_of_a_16_bit_run_is_counted(batch_file):
    """A bf16 run holds bf16 parameters and gradients and a float64 copy with its own: above the float32 run."""
    from harts_compiler import TreeBatch
    from harts_compiler.runtime.trajectory import pack_index, trajectory_token_lists
    from harts_compiler.verify_memory import estimate_memory, footprint
    lists, ids = trajectory_token_lists(TreeBatch.load(batch_file))
    pack = footprint(pack_index(lists, ids, list(range(len(lists))), chunk_size=64, conv_width=4))
    args = dict(trajectories=len(lists), max_length=max(map(len, lists)), checkpointing=False)
    half = load_model("tiny-qwen3-next", torch.bfloat16)
    plain = estimate_memory(half, 64, [pack], [pack], **args)
    with_reference = estimate_memory(half, 64, [pack], [pack], reference_dtype=torch.float64, **args)
    params = sum(p.numel() for p in half.parameters())
    assert with_reference.resident - plain.resident >= 3 * params * 8
    assert with_reference.trajectory_peak > plain.trajectory_peak


def test_estimate_grows_with_the_microbatch():
    config = load_model("tiny-qwen3-next", torch.float64).config
    small, big = (activation_bytes(config, 8, 64, Footprint(n, 3 * n), checkpointing=False) for n in (1000, 4000))
    assert 3.5 < big / small < 4.5
    # ~280 KB per trajectory token measured for tiny-qwen3-next fp64 (chunk 64); the estimate is on the safe side
    per_token = activation_bytes(config, 8, 64, Footprint(4000, 4000), checkpointing=False) / 4000
    assert 280e3 < per_token < 450e3
    assert activation_bytes(config, 8, 64, Footprint(4000, 4000), checkpointing=True) < 4000 * per_token


def test_trajectory_packs_keep_order_and_budget():
    assert trajectory_packs([3, 4, 10, 1, 1, 2], 5) == [[0], [1], [2], [3, 4, 5]]
    assert trajectory_packs([], 5) == []
    assert parse_memory_size("1.5G") == int(1.5 * 2**30) and parse_memory_size("512m") == 512 * 2**20


def _one_line_exit_2(args, capsys, *needles):
    assert main(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    for needle in needles:
        assert needle in lines[0]


def test_bad_input_is_one_line_with_exit_2(tmp_path, batch_file, capsys):
    _one_line_exit_2(["verify", str(tmp_path / "missing.jsonl")], capsys, "missing.jsonl")
    _one_line_exit_2(["verify", str(tmp_path)], capsys, "directory")
    (tmp_path / "checkpoint").mkdir()
    _one_line_exit_2(["verify", str(batch_file), "--model", str(tmp_path / "checkpoint")], capsys, "config.json")
    _one_line_exit_2(["verify", str(batch_file), "--model", "no-such-model"], capsys, "neither a preset")
    _one_line_exit_2(["verify", str(batch_file), "--threads", "-1"], capsys, "--threads")
    _one_line_exit_2(["verify", str(batch_file), "--microbatch-tokens", "0"], capsys, "--microbatch-tokens")
    _one_line_exit_2(["verify", str(batch_file), "--memory-limit", "lots"], capsys, "--memory-limit")


def test_token_ids_outside_the_vocabulary_are_one_line(tmp_path, capsys):
    path = tmp_path / "wide.jsonl"
    path.write_text("".join(json.dumps({"id": f"t{i}", "tokens": [1, 2, 500 + i, 3]}) + "\n" for i in range(30)))
    _one_line_exit_2(["verify", str(path), "--model", "tiny-qwen3-next"], capsys,
                     "trajectory 't0'", "tokens[2]", "vocab_size 128", "29 more trajectories")
