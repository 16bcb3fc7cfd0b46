"""Trajectory metadata in the JSONL input (reward, group, advantage, per-position old/ref log-probs and
response mask, any other field) is accepted, checked, saved with the plan and turned into the loss inputs."""
import json

import numpy as np
import pytest
import torch

import harts_compiler as hc
from harts_compiler.errors import InputError
from harts_compiler.metadata import loss_inputs
from harts_compiler.objectives import grpo_advantages

LINES = [
    {"id": "a", "tokens": [1, 2, 3, 4], "reward": 1.0, "group": "p", "old_logprobs": [0, -0.5, -0.25, -1.0],
     "task": "t1"},
    {"id": "b", "tokens": [1, 2, 3, 5, 6], "reward": 0, "group": "p", "old_logprobs": [0, -1, -2, -3, -4],
     "finish": "stop"},
    {"id": "t", "nodes": [{"id": 0, "parent": None, "tokens": [7, 8]}, {"id": 1, "parent": 0, "tokens": [9]},
                          {"id": 2, "parent": 0, "tokens": [10, 11]}],
     "trajectories": [{"id": "c", "node": 1, "reward": 2.0, "old_logprobs": [0, -1, -1]},
                      {"id": "d", "node": 2, "reward": -1.0, "old_logprobs": [0, -2, -2, -2], "turns": 3}]},
]


def write(tmp_path, lines) -> str:
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_metadata_is_kept_per_trajectory_and_written_back(tmp_path):
    batch = hc.TreeBatch.load(write(tmp_path, LINES))
    assert batch.metadata_of(0) == {"reward": 1.0, "group": "p", "old_logprobs": [0, -0.5, -0.25, -1.0], "task": "t1"}
    assert batch.metadata_of(3)["group"] == "t"  # a tree's trajectories are one group unless told
    assert batch.metadata_of(3)["turns"] == 3 and batch.metadata_of(2)["reward"] == 2.0
    again = tmp_path / "again.jsonl"
    batch.save(again)
    reread = hc.TreeBatch.load(again)
    assert [reread.metadata_of(j) for j in range(4)] == [batch.metadata_of(j) for j in range(4)]


def test_loss_inputs_from_rewards_and_old_logprobs_survive_save_and_load(tmp_path):
    plan = hc.compile(hc.TreeBatch.load(write(tmp_path, LINES)), hc.CompileOptions(chunk_size=2))
    plan.save(tmp_path / "p.hir")
    loaded = hc.Plan.load(tmp_path / "p.hir")
    assert loaded.metadata == plan.metadata and loaded.identity == plan.identity
    inputs = loss_inputs(loaded)
    ids = inputs.trajectory_ids
    rewards = {"a": 1.0, "b": 0.0, "c": 2.0, "d": -1.0}
    groups = {"a": "p", "b": "p", "c": "t", "d": "t"}
    expected = grpo_advantages(torch.tensor([rewards[i] for i in ids], dtype=torch.float64), [groups[i] for i in ids])
    np.testing.assert_allclose(inputs.advantages, expected.numpy())
    rows = inputs.rows_for(["d", "a"], 5, dtype=torch.float64)
    assert rows.old_logprobs[0, :4].tolist() == [0, -2, -2, -2] and rows.old_logprobs[1, :4].tolist() == [0, -0.5,
                                                                                                          -0.25, -1]


def test_explicit_groups_and_advantages(tmp_path):
    lines = [{"id": str(k), "tokens": [1, k + 2], "reward": float(k), "group": "g"} for k in range(4)]
    inputs = loss_inputs(hc.compile(hc.TreeBatch.load(write(tmp_path, lines)), hc.CompileOptions()))
    assert inputs.advantages.mean() == pytest.approx(0) and np.all(np.diff(inputs.advantages) > 0)
    lines = [{"id": "x", "tokens": [1, 2], "advantage": [0.0, 0.5]}, {"id": "y", "tokens": [1, 3], "advantage": 2.0}]
    inputs = loss_inputs(hc.compile(hc.TreeBatch.load(write(tmp_path, lines)), hc.CompileOptions()))
    assert inputs.per_token_advantages


@pytest.mark.parametrize("line, message", [
    ({"id": "a", "tokens": [1, 2], "old_logprobs": [0.0]}, "field old_logprobs: 1 entries for 2 tokens"),
    ({"id": "a", "tokens": [1, 2], "reward": "high"}, "field reward"),
    ({"id": "a", "tokens": [1, 2], "response_mask": [1, 2]}, "field response_mask"),
    ({"id": "t", "nodes": [{"id": 0, "parent": None, "tokens": [1]}],
      "trajectories": [{"id": "c", "node": 0, "advantage": [1.0, 2.0]}]}, "trajectory 'c': field advantage"),
])
def test_bad_metadata_is_named(tmp_path, line, message):
    with pytest.raises(InputError, match=message):
        hc.TreeBatch.load(write(tmp_path, [line]))


def test_loss_inputs_need_the_same_fields_everywhere(tmp_path):
    lines = [{"id": "a", "tokens": [1, 2], "reward": 1.0, "group": "g"}, {"id": "b", "tokens": [1, 3]}]
    with pytest.raises(ValueError, match="'b': neither 'advantage' nor 'reward'"):
        loss_inputs(hc.compile(hc.TreeBatch.load(write(tmp_path, lines)), hc.CompileOptions()))
    lines = [{"id": "a", "tokens": [1, 2], "reward": 1.0}]
    with pytest.raises(ValueError, match="'a': a reward without a 'group'"):
        loss_inputs(hc.compile(hc.TreeBatch.load(write(tmp_path, lines)), hc.CompileOptions()))


def test_fields_other_stacks_use_are_named_not_silently_ignored(tmp_path):
    from harts_compiler.commands import plan_warnings
    lines = [{"id": "a", "tokens": [1, 2, 3], "reward": 1.0, "group": "g", "loss_mask": [0, 1, 1]},
             {"id": "b", "tokens": [1, 2, 4], "reward": 0.0, "group": "g", "loss_mask": [0, 1, 0],
              "old_log_probs": [0, -1, -1]}]
    plan = hc.compile(hc.TreeBatch.load(write(tmp_path, lines)), hc.CompileOptions(microbatch_tokens=64))
    hints = [w for w in plan_warnings(plan) if "plain metadata" in w]
    assert len(hints) == 2 and "'loss_mask' (2 trajectories)" in hints[0] and "'response_mask'" in hints[0]
    assert "'old_log_probs' (1 trajectories)" in hints[1] and "'old_logprobs'" in hints[1]
    with pytest.warns(UserWarning) as record:
        inputs = loss_inputs(plan)
    assert sorted(str(w.message).split()[1] for w in record) == ["'loss_mask'", "'old_log_probs'"]
    assert inputs.response_mask is None  # kept as metadata only, as the warning says
    # the field the loss reads, set beside the other stack's name: nothing to say
    for line in lines:
        line["response_mask"] = line["loss_mask"]
        line.pop("old_log_probs", None)
    plan = hc.compile(hc.TreeBatch.load(write(tmp_path, lines)), hc.CompileOptions(microbatch_tokens=64))
    assert not [w for w in plan_warnings(plan) if "plain metadata" in w]
