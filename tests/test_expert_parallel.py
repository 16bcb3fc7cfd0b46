"""Expert parallelism (`runtime/expert_parallel.py`) == one process, exactly.

Two spawned gloo ranks shard fp64 tiny MoE models with `shard_expert_parallel` on a ("dp", "ep") =
(1, 2) mesh (each rank holds half the routed experts, tokens cross ranks by all-to-all; and once on
(2, 1), where FSDP2 shards the experts over "dp" and sums their gradients there) and run the
plan `harts compile --dp-size 2` saved, through the unchanged `data_parallel_step`. The gradients,
gathered with `full_tensor()`, and the loss (with the MoE aux loss, whose router statistics stay on the
token's rank) must equal the single-process trajectory-wise reference of tests/test_distributed.py to
1e-12. The plan has an empty (rank, slot), where one rank runs the padding microbatch and still joins
every all-to-all of the other's real microbatch, and a tree larger than the budget that runs as
pieces. Also: both DTensor expert shards are disjoint halves, the per-rank bytes shrink, a DCP
checkpoint of the EP model loads into a plain TreeModel.
"""
from __future__ import annotations

import datetime

import pytest
import torch

import harts_compiler
from harts_compiler.runtime.distributed import data_parallel_step, slot_schedule
from harts_compiler.runtime.dp_inputs import TrajectoryInputs
from harts_compiler.runtime.dp_objective import PPOObjective
from test_distributed import BUDGET, CHUNK, loss_data, reference, run_ranks, tree_token_lists
from harts_compiler.runtime.expert_parallel import expert_modules
from test_runtime_tree import rel, tiny_model

TOL = 1e-12
CHILD_TIMEOUT_S = 150
WORLD = 2
# (preset, objective, sync, ep): Qwen3-Next's SparseMoeBlock with its aux loss; Kimi's grouped-routing
# block; and the (dp, ep) = (2, 1) mesh, where the experts' own fully_shard sums their gradients over "dp"
RUNS = [
    ("tiny-qwen3-next", PPOObjective(aggregation="token-mean", kl_coef=0.1, aux_loss_coef=0.5), "step", 2),
    ("tiny-kimi-linear", PPOObjective(aggregation="seq-mean-token-sum"), "slot", 2),
    ("tiny-qwen3-next", PPOObjective(aggregation="seq-mean-token-mean", aux_loss_coef=0.5), "slot", 1),
]

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def plan_with_an_empty_slot(tmp_path):
    """A tree over the budget (the planner cuts it into pieces, run forward and backward piece by piece)
    and two fitting trees, whose 2-rank plan leaves a (rank, slot) empty. Compiled and saved; (plan path,
    plan, token lists)."""
    token_lists = tree_token_lists(n_trees=2)
    options = harts_compiler.CompileOptions(chunk_size=CHUNK, conv_width=4, dp_size=WORLD, microbatch_tokens=BUDGET)
    plan = harts_compiler.compile(harts_compiler.TreeBatch.from_trajectories(token_lists), options)
    assert any(mb is None for r in range(WORLD) for mb in slot_schedule(plan, r)), "the plan must have an empty slot"
    return plan.save(tmp_path / "plan.hir"), plan, token_lists


def _worker(rank, world_size, port, plan_path, inputs_per_run, out_dir):
    import copy

    import torch.distributed as dist

    from harts_compiler.runtime import checkpoint, fsdp
    from harts_compiler.runtime.expert_parallel import expert_parallel_mesh, shard_expert_parallel
    torch.set_num_threads(1)
    plan = harts_compiler.Plan.load(plan_path)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=60))
    try:
        meshes = {ep: expert_parallel_mesh(world_size, ep, "cpu") for ep in {run[-1] for run in RUNS}}
        results = []
        for (preset, objective, sync, ep), inputs in zip(RUNS, inputs_per_run):
            model = shard_expert_parallel(copy.deepcopy(tiny_model(torch.float64, preset)), meshes[ep])
            step = data_parallel_step(model, plan, inputs, objective, sync=sync, gather_metrics=True)
            experts = expert_modules(model)[0]
            results.append(dict(
                loss=step.loss, grads=fsdp.full_gradients(model), all_ranks=step.all_ranks,
                bytes=fsdp.parameter_bytes(model), local_experts=experts.gate_up_proj.to_local().detach().clone()))
            del model, step  # before the next layout's collectives
        model = shard_expert_parallel(copy.deepcopy(tiny_model(torch.float64, RUNS[0][0])), meshes[WORLD])
        checkpoint.save_checkpoint(f"{out_dir}/dcp", model)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_expert_parallel_step_gives_the_gradients_of_one_process(tmp_path):
    plan_path, plan, token_lists = plan_with_an_empty_slot(tmp_path)
    references, inputs_per_run = [], []
    for preset, objective, *_ in RUNS:
        model = tiny_model(torch.float64, preset)
        data = loss_data(model, token_lists)
        inputs_per_run.append(TrajectoryInputs.for_plan(plan, **data))
        references.append(reference(model, token_lists, data, objective, plan))

    ranks = run_ranks(_worker, WORLD, (str(plan_path), inputs_per_run, str(tmp_path)), tmp_path,
                      timeout_s=CHILD_TIMEOUT_S)
    for run, ((preset, objective, sync, ep), (want_loss, want_grads)) in enumerate(zip(RUNS, references)):
        for rank, results in enumerate(ranks):
            got = results[run]
            what = f"{preset} ep={ep} sync={sync} rank {rank}"
            assert abs(got["loss"] - want_loss) <= TOL * abs(want_loss), what
            worst = max((rel(got["grads"][n], want_grads[n]), n) for n in want_grads)
            assert worst[0] < TOL, f"{what}: gradient of {worst[1]} rel {worst[0]:.3g}"
            assert any("experts" in n and got["grads"][n].abs().max() > 0 for n in want_grads), what
        # ep=2: each rank holds its own half of the experts (the two halves of the full tensor); ep=1: FSDP's
        # dim-0 shards of all the experts
        full = expert_modules(tiny_model(torch.float64, preset))[0].gate_up_proj
        halves = [results[run]["local_experts"] for results in ranks]
        assert all(h.shape[0] == full.shape[0] // WORLD for h in halves)
        assert torch.equal(torch.cat(halves), full.detach())
        full_bytes = sum(p.numel() * 8 for p in tiny_model(torch.float64, preset).parameters())
        assert max(results[run]["bytes"] for results in ranks) < 0.6 * full_bytes
        empty = [s for m in ranks[0][run]["all_ranks"] for s in m.slots if s.microbatch < 0]
        assert empty and all(s.padding for s in empty)

    from harts_compiler.runtime.checkpoint import load_tree_model
    loaded = load_tree_model(tmp_path / "dcp", RUNS[0][0], dtype=torch.float64)
    want = tiny_model(torch.float64, RUNS[0][0]).state_dict()
    assert max(rel(loaded.state_dict()[n], want[n]) for n in want) == 0.0  # global shapes, usual names


def test_experts_must_divide_over_the_ep_ranks():
    from harts_compiler.runtime.expert_parallel import ExpertParallelExperts

    class FakeMesh:
        def size(self):
            return 3

    experts = tiny_model(torch.float64, "tiny-qwen3-next").model.layers[0].mlp.experts
    with pytest.raises(ValueError, match="num_experts=4 is not divisible by ep=3"):
        ExpertParallelExperts(experts, FakeMesh())
