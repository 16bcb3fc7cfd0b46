"""Data-parallel step (`runtime/distributed.py`) == one process over the whole batch.

The reference runs the batch trajectory-wise in one process and computes the loss with
`ppo_clip_loss`'s own local normalisers from hand-built full-batch tensors, so it shares neither
the gather of per-trajectory inputs nor the global normalisers with the code under test.
The batch has one tree over the budget, which `cut-pieces` runs as pieces (asserted). The
sharded multi-process runs are in tests/test_fsdp.py, which reuses this reference.
"""
from __future__ import annotations

import datetime
import socket
import time

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import harts_compiler
from harts_compiler.objectives import ppo_clip_loss
from harts_compiler.runtime import trajectory_wise
from harts_compiler.runtime.distributed import data_parallel_step, slot_schedule
from harts_compiler.runtime.dp_inputs import TrajectoryInputs, group_advantages
from harts_compiler.runtime.dp_objective import PPOObjective
from harts_compiler.testing import random_token_lists
from test_runtime_tree import rel, tiny_model

CHUNK = 4
BUDGET = 40
TOL = 1e-10
CHILD_TIMEOUT_S = 120
# (preset, objective, sync): one run per row, all in the same two spawned processes
RUNS = [
    ("tiny-qwen3.5", PPOObjective(aggregation="token-mean", kl_coef=0.1, entropy_coef=0.01), "step"),
    ("tiny-qwen3.5", PPOObjective(aggregation="seq-mean-token-mean", dual_clip=3.0), "slot"),
    ("tiny-qwen3-next", PPOObjective(aggregation="seq-mean-token-sum", aux_loss_coef=0.5), "step"),
]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def tree_token_lists(n_trees: int = 4, seed: int = 0, oversize: bool = True) -> list[list[int]]:
    """With `oversize`, first one tree of 60-120 compact tokens that must run as pieces (the
    same tree whatever n_trees), then `n_trees` trees of 21-40 compact tokens (each fills a
    microbatch of BUDGET); distinct root tokens."""
    big_rng, rng = np.random.default_rng(seed + 1000), np.random.default_rng(seed)
    out = []
    shapes = [(big_rng, 60, 3 * BUDGET, 10, 30)] * int(oversize) + \
        [(rng, BUDGET // 2, BUDGET, 4, 14)] * n_trees
    for tree, (gen, low, high, n_traj, max_len) in enumerate(shapes):
        while True:
            lists = [[100 + tree] + t for t in random_token_lists(gen, n_traj=n_traj, vocab=6,
                                                                  max_len=max_len)]
            compact = len({tuple(t[:p + 1]) for t in lists for p in range(len(t))})
            if low < compact <= high and max(map(len, lists)) <= BUDGET:
                break
        out += lists
    return out


def token_lists_with_an_empty_slot() -> list[list[int]]:
    """The first generated batch (seed, then 3 or 4 fitting trees) whose 2-rank plan has an
    empty (rank, slot): that depends on how the split parts pack, so it is searched (the search
    is deterministic)."""
    for seed in range(40):
        for n_trees in (3, 4):
            token_lists = tree_token_lists(n_trees=n_trees, seed=seed)
            plan = compile_plan(token_lists, dp_size=2)
            if any(mb is None for r in range(2) for mb in slot_schedule(plan, r)):
                return token_lists
    raise AssertionError("no generated batch has an empty slot")


def compile_plan(token_lists, dp_size: int):
    batch = harts_compiler.TreeBatch.from_trajectories(token_lists)
    options = harts_compiler.CompileOptions(chunk_size=CHUNK, conv_width=4, dp_size=dp_size,
                                            microbatch_tokens=BUDGET)
    plan = harts_compiler.compile(batch, options)
    assert plan.program.note("cut-pieces")["pieces"] >= 2  # the oversize tree runs as pieces
    return plan


def loss_data(model, token_lists, seed: int = 1) -> dict:
    """Per-trajectory raw inputs: GRPO advantages, old/ref log-probs near the current policy,
    a random response mask (keyed by the trajectory ids "0", "1", ...)."""
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        out = trajectory_wise(model, token_lists, chunk_size=CHUNK)
    ids = [str(j) for j in range(len(token_lists))]
    lp = {i: out.logprobs[j, :len(t)].double().numpy() for j, (i, t) in enumerate(zip(ids, token_lists))}
    rewards = {i: float(rng.integers(0, 3)) for i in ids}
    groups = [t[0] for t in token_lists]  # GRPO group = tree (its root token)
    return dict(
        advantages=group_advantages(rewards, ids, groups),
        old_logprobs={i: lp[i] + 0.2 * rng.normal(size=lp[i].size) for i in ids},
        ref_logprobs={i: lp[i] + 0.2 * rng.normal(size=lp[i].size) for i in ids},
        response_mask={i: rng.random(lp[i].size) > 0.25 for i in ids})


def reference(model, token_lists, data, objective: PPOObjective, plan) -> tuple[float, dict]:
    """Loss and gradients of the whole batch, one process, trajectory-wise."""
    model.zero_grad(set_to_none=True)
    out = trajectory_wise(model, token_lists, chunk_size=CHUNK)
    rows, max_len = len(token_lists), out.logprobs.shape[1]

    def full(name, fill=0.0, dtype=torch.float64):
        grid = torch.full((rows, max_len), fill, dtype=dtype)
        for j, traj_id in enumerate(out.trajectory_ids):
            grid[j, :len(token_lists[j])] = torch.as_tensor(data[name][traj_id])
        return grid

    advantages = torch.tensor([data["advantages"][i] for i in out.trajectory_ids], dtype=torch.float64)
    loss = ppo_clip_loss(out.logprobs, full("old_logprobs"), advantages, out.lengths,
                         response_mask=full("response_mask", False, torch.bool),
                         clip_ratio_low=objective.clip_ratio_low, dual_clip=objective.dual_clip,
                         aggregation=objective.aggregation, ref_logprobs=full("ref_logprobs"),
                         kl_coef=objective.kl_coef, entropy=out.entropy,
                         entropy_coef=objective.entropy_coef).loss
    if objective.aux_loss_coef:
        # per-microbatch aux losses, weighted by trajectory tokens (dp_objective's semantics)
        forest = plan.program.forest
        traj_tree = forest.node_tree[forest.traj_end_node]
        total = sum(map(len, token_lists))
        for mb in plan.microbatches():
            members = [int(forest.traj_ids[j]) for j in np.flatnonzero(np.isin(traj_tree, mb.trees))]
            sub = [token_lists[j] for j in members]
            aux = trajectory_wise(model, sub, chunk_size=CHUNK).aux_loss
            loss = loss + objective.aux_loss_coef * sum(map(len, sub)) / total * aux
    loss.backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
             for n, p in model.named_parameters()}
    return float(loss.detach()), grads


def grads_of(model) -> dict:
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for n, p in model.named_parameters()}


def assert_grads_close(got: dict, want: dict, what: str):
    worst = max((rel(got[n], want[n]), n) for n in want)
    assert worst[0] < TOL, f"{what}: gradient of {worst[1]} rel {worst[0]:.3g}"


# ---- one process ------------------------------------------------------------------------------

def test_single_rank_step_over_several_slots_matches_trajectory_wise():
    token_lists = tree_token_lists()
    plan = compile_plan(token_lists, dp_size=1)
    assert len(slot_schedule(plan, 0)) >= 3
    assert_single_rank_step_exact(plan, token_lists)


def test_single_rank_step_with_a_tree_riding_in_a_piece_matches_trajectory_wise():
    token_lists = tree_token_lists(n_trees=0) + [[110, 1, 2, 3], [110, 1, 4]]  # 5 tokens: the smallest piece has room
    plan = compile_plan(token_lists, dp_size=1)
    assert plan.program.note("schedule")["riders"] == 1
    (mb,) = [mb for mb in plan.microbatches() if mb.runs_as_pieces]
    assert len(mb.trees) == 2
    assert_single_rank_step_exact(plan, token_lists)


def test_single_rank_step_with_offloaded_piece_inputs_matches_trajectory_wise(monkeypatch):
    """The step driver's detached pieces with checkpointing and the earlier pieces' layer inputs offloaded."""
    from harts_compiler.runtime.ops import offload
    parked = []
    monkeypatch.setattr(offload.HostParkedInput, "park",
                        lambda self, park=offload.HostParkedInput.park: (parked.append(1), park(self)))
    token_lists = tree_token_lists()
    assert_single_rank_step_exact(compile_plan(token_lists, dp_size=1), token_lists, offload=True)
    assert parked


def assert_single_rank_step_exact(plan, token_lists, offload: bool = False):
    for preset, objective, _ in RUNS:
        model = tiny_model(torch.float64, preset)
        data = loss_data(model, token_lists)
        want_loss, want_grads = reference(model, token_lists, data, objective, plan)
        model.zero_grad(set_to_none=True)
        model.offload_piece_inputs = offload
        try:
            result = data_parallel_step(model, plan, TrajectoryInputs.for_plan(plan, **data), objective,
                                        **({"activation_checkpointing": True} if offload else {}))
        finally:
            model.offload_piece_inputs = False
        assert abs(result.loss - want_loss) <= TOL * abs(want_loss)
        assert_grads_close(grads_of(model), want_grads, f"{preset} {objective.aggregation}")


def test_bad_inputs_and_topology_are_named():
    token_lists = tree_token_lists(n_trees=3)
    plan = compile_plan(token_lists, dp_size=2)
    model = tiny_model(torch.float64, "tiny-qwen3.5")
    data = loss_data(model, token_lists)
    with pytest.raises(KeyError, match="advantages: no entry for trajectory id '3'"):
        TrajectoryInputs.for_plan(plan, advantages={k: v for k, v in data["advantages"].items() if k != "3"})
    short = dict(data["old_logprobs"], **{"2": data["old_logprobs"]["2"][:-1]})
    with pytest.raises(ValueError, match=r"old_logprobs\['2'\]: shape"):
        TrajectoryInputs.for_plan(plan, advantages=data["advantages"], old_logprobs=short)
    extra = dict(data["advantages"], ghost=1.0)
    with pytest.raises(KeyError, match="ghost"):
        TrajectoryInputs.for_plan(plan, advantages=extra)
    inputs = TrajectoryInputs.for_plan(plan, advantages=data["advantages"])
    with pytest.raises(ValueError, match="dp_size=2 but the step runs on 1 rank"):
        data_parallel_step(model, plan, inputs)
    with pytest.raises(ValueError, match="sync must be one of"):
        data_parallel_step(model, plan, inputs, sync="never")


def test_normalisers_count_response_tokens_after_position_zero():
    inputs = TrajectoryInputs.from_mappings(
        ["a", "b", "c"], [3, 1, 2], advantages={"a": 1.0, "b": 0.0, "c": [0.0, 2.0]},
        response_mask={"a": [True, True, False], "b": [True], "c": [True, False]})
    assert inputs.counted_tokens().tolist() == [1, 0, 0]
    norm = inputs.normalisers()
    assert (norm.num_tokens, norm.num_sequences, norm.trajectory_tokens) == (1, 1, 6)
    rows = inputs.rows_for(["c", "a"], 4)
    assert rows.advantages.tolist() == [[0.0, 2.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]]
    assert rows.response_mask.tolist() == [[True, False, False, False], [True, True, False, False]]


# ---- two gloo processes -----------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _crashing_worker(rank: int, world_size: int, port: int, *unused):
    """Rank 1 dies before joining the group, so rank 0 blocks in init_process_group."""
    import torch.distributed as dist
    if rank == 1:
        raise RuntimeError("rank 1 crashed on purpose")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=600))


def run_ranks(worker, world_size: int, args: tuple, out_dir, timeout_s: float = CHILD_TIMEOUT_S) -> list:
    """Spawn `worker(rank, world_size, port, *args)` on `world_size` processes; fail (not hang) past `timeout_s`;
    each rank's results from `out_dir/rank<r>.pt`."""
    context = mp.start_processes(worker, args=(world_size, _free_port(), *args), nprocs=world_size, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1):  # raises with the child's traceback if one fails
            if time.monotonic() > deadline:
                pytest.fail(f"{world_size}-process gloo step did not finish in {timeout_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]  # our own file


def test_a_crashed_rank_fails_the_run_instead_of_hanging(tmp_path):
    start = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 crashed on purpose"):
        run_ranks(_crashing_worker, 2, (None, None, str(tmp_path)), tmp_path)
    assert time.monotonic() - start < CHILD_TIMEOUT_S
