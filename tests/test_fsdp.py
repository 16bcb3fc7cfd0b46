"""FSDP2-sharded tree step (`runtime/fsdp.py` + `runtime/distributed.py`) == one process.

Spawned gloo ranks (2 and 4) shard fp64 tiny Qwen3-Next and Qwen3.5-MoE models per decoder layer
+ root on a CPU DeviceMesh and run the plan `harts compile --dp-size N` saved; the gradients,
gathered with `full_tensor()`, must equal the single-process trajectory-wise reference
(tests/test_distributed.py's, which shares none of the step's code) to 1e-12. The plans have
empty (rank, slot)s, where a rank runs the zero-loss padding microbatch, and one tree that
`cut-pieces` runs as pieces. The checkpoint test saves the sharded model + optimizer with
DCP after a step, loads it into a freshly sharded model and into a plain TreeModel, and exports
a `from_pretrained` directory.
"""
from __future__ import annotations

import copy
import datetime

import pytest
import torch

import harts_compiler
from harts_compiler.commands import compile_main
from harts_compiler.runtime.distributed import data_parallel_step, slot_schedule
from harts_compiler.runtime.dp_inputs import TrajectoryInputs
from harts_compiler.runtime.dp_objective import PPOObjective
from test_distributed import BUDGET, CHUNK, compile_plan, loss_data, reference, run_ranks, tree_token_lists
from test_runtime_tree import rel, tiny_model

TOL = 1e-12
CHILD_TIMEOUT_S = 150
# (preset, objective, sync)
RUNS = [
    ("tiny-qwen3-next", PPOObjective(aggregation="token-mean", kl_coef=0.1, entropy_coef=0.01), "step"),
    ("tiny-qwen3.5-moe", PPOObjective(aggregation="seq-mean-token-sum", aux_loss_coef=0.5), "slot"),
]

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def batch_with_empty_slots(dp_size: int) -> list[list[int]]:
    """The first generated batch whose dp_size-rank plan leaves some (rank, slot) empty."""
    for seed in range(40):
        for n_trees in (3, 4, 5):
            token_lists = tree_token_lists(n_trees=n_trees, seed=seed)
            plan = compile_plan(token_lists, dp_size=dp_size)
            if any(mb is None for r in range(dp_size) for mb in slot_schedule(plan, r)):
                return token_lists
    raise AssertionError(f"no generated batch has an empty slot on {dp_size} ranks")


def sharded(preset: str, mesh):
    from harts_compiler.runtime.fsdp import shard_model
    return shard_model(copy.deepcopy(tiny_model(torch.float64, preset)), mesh)


def _worker(rank, world_size, port, plan_path, inputs_per_run, out_dir, with_checkpoint):
    import torch.distributed as dist

    from harts_compiler.runtime import fsdp
    torch.set_num_threads(1)
    plan = harts_compiler.Plan.load(plan_path)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=60))
    try:
        mesh = fsdp.data_parallel_mesh(world_size, "cpu")
        results = []
        for (preset, objective, sync), inputs in zip(RUNS, inputs_per_run):
            model = sharded(preset, mesh)
            step = data_parallel_step(model, plan, inputs, objective, sync=sync, gather_metrics=True)
            result = dict(loss=step.loss, grads=fsdp.full_gradients(model), all_ranks=step.all_ranks,
                          bytes=fsdp.parameter_bytes(model))
            data_parallel_step(model, plan, inputs, objective, sync=sync, zero_grad=False)
            result["grads_twice"] = fsdp.full_gradients(model)
            results.append(result)
        if with_checkpoint:
            results.append(_checkpoint_round_trip(plan, inputs_per_run[0], mesh, out_dir))
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _checkpoint_round_trip(plan, inputs, mesh, out_dir) -> dict:
    import torch.distributed as dist

    from harts_compiler.runtime import checkpoint
    preset, objective, sync = RUNS[0]
    model = sharded(preset, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data_parallel_step(model, plan, inputs, objective)
    optimizer.step()
    checkpoint.save_checkpoint(f"{out_dir}/dcp", model, optimizer)
    restored = sharded(preset, mesh)
    restored_optimizer = torch.optim.AdamW(restored.parameters(), lr=1e-3)
    data_parallel_step(restored, plan, inputs, objective)
    restored_optimizer.step()  # creates the state DCP loads into; different weights after it
    checkpoint.load_checkpoint(f"{out_dir}/dcp", restored, restored_optimizer)
    # one more identical step on both: same weights and optimizer state give the same update
    for m, o in ((model, optimizer), (restored, restored_optimizer)):
        data_parallel_step(m, plan, inputs, objective)
        o.step()
    full, full_restored = checkpoint.full_state_dict(model), checkpoint.full_state_dict(restored)
    checkpoint.export_pretrained(model, f"{out_dir}/exported")
    dist.barrier()
    return dict(worst=max(rel(full_restored[n], full[n]) for n in full), saved_after_one_step=True)


def run_fsdp_ranks(world_size, plan_path, inputs_per_run, out_dir, with_checkpoint=False) -> list:
    return run_ranks(_worker, world_size, (plan_path, inputs_per_run, str(out_dir), with_checkpoint), out_dir,
                     timeout_s=CHILD_TIMEOUT_S)


def _compiled(tmp_path, token_lists, world_size):
    harts_compiler.TreeBatch.from_trajectories(token_lists).save(tmp_path / "batch.jsonl")
    plan_path = tmp_path / "plan.hir"
    assert compile_main([str(tmp_path / "batch.jsonl"), "--dp-size", str(world_size), "--chunk-size", str(CHUNK),
                         "--microbatch-tokens", str(BUDGET), "-o", str(plan_path)]) == 0
    plan = harts_compiler.Plan.load(plan_path)
    # the batch's first tree is larger than the budget (tree_token_lists), so the planner must cut it
    assert plan.stats["compact_tokens"] > BUDGET and len(plan.microbatches()) >= 2
    return plan_path, plan


def _assert_close(got: dict, want: dict, what: str):
    worst = max((rel(got[n], want[n]), n) for n in want)
    assert worst[0] < TOL, f"{what}: gradient of {worst[1]} rel {worst[0]:.3g}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_step_gives_the_gradients_of_one_process(tmp_path, world_size):
    token_lists = batch_with_empty_slots(world_size)
    plan_path, plan = _compiled(tmp_path, token_lists, world_size)
    schedules = [slot_schedule(plan, r) for r in range(world_size)]
    assert any(mb is None for s in schedules for mb in s), "the plan must have an empty slot"
    references, inputs_per_run = [], []
    for preset, objective, _ in RUNS:
        model = tiny_model(torch.float64, preset)
        data = loss_data(model, token_lists)
        inputs_per_run.append(TrajectoryInputs.for_plan(plan, **data))
        references.append(reference(model, token_lists, data, objective, plan))
    full_bytes = [sum(p.numel() * 8 for p in tiny_model(torch.float64, preset).parameters()) for preset, *_ in RUNS]

    ranks = run_fsdp_ranks(world_size, str(plan_path), inputs_per_run, tmp_path, with_checkpoint=world_size == 2)
    forest = plan.program.forest
    for run, ((preset, objective, sync), (want_loss, want_grads)) in enumerate(zip(RUNS, references)):
        what = f"{world_size} ranks {preset} {objective.aggregation} sync={sync}"
        for rank, results in enumerate(ranks):
            got = results[run]
            assert abs(got["loss"] - want_loss) <= TOL * abs(want_loss), what
            _assert_close(got["grads"], want_grads, f"{what} rank {rank}")
            _assert_close(got["grads_twice"], {n: 2 * g for n, g in want_grads.items()},
                          f"{what} rank {rank}, second step with zero_grad=False")
        # sharded: each rank holds about 1/N of the parameters (dim-0 shards, rounded up)
        assert sum(results[run]["bytes"] for results in ranks) >= full_bytes[run]
        assert max(results[run]["bytes"] for results in ranks) < 1.5 * full_bytes[run] / world_size
        metrics = ranks[0][run]["all_ranks"]
        assert {len(m.slots) for m in metrics} == {len(schedules[0])}  # lockstep slot count
        assert sum(m.compact_tokens for m in metrics) == forest.num_tokens
        empty = [s for m in metrics for s in m.slots if s.microbatch < 0]
        assert empty and all(s.padding and s.compact_tokens == 0 for s in empty)
    if world_size == 2:
        for results in ranks:
            assert results[-1]["worst"] < TOL  # DCP round trip: same weights after one more step
        from harts_compiler.runtime.model import TreeModel
        exported = TreeModel.from_pretrained(tmp_path / "exported", dtype=torch.float64)
        from harts_compiler.runtime.checkpoint import load_tree_model
        loaded = load_tree_model(tmp_path / "dcp", RUNS[0][0], dtype=torch.float64)
        assert set(dict(exported.named_parameters())) == set(dict(loaded.named_parameters()))
        assert any(rel(loaded.state_dict()[n], tiny_model(torch.float64, RUNS[0][0]).state_dict()[n]) > 0
                   for n in loaded.state_dict())  # the optimizer step moved the saved weights


def test_a_replicated_model_on_several_ranks_is_refused():
    token_lists = tree_token_lists(n_trees=3)
    plan = compile_plan(token_lists, dp_size=2)
    inputs = TrajectoryInputs.for_plan(plan, advantages={i: 0.0 for i in plan.program.forest.traj_ids})
    with pytest.raises(ValueError, match="dp_size=2 but the step runs on 1 rank"):
        data_parallel_step(tiny_model(torch.float64, "tiny-qwen3.5"), plan, inputs)
