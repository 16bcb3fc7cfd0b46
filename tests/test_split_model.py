"""Split trees through the model (tiny-qwen3-next, fp64): the plan's microbatches, assembled per
trajectory, give exactly the trajectory-wise log-probs, entropies, gradients, expert loads and
MoE aux loss, with budgets that cut trees into several parts, at chunk sizes 4 and 64."""
import random

import numpy as np
import pytest
import torch

import harts_compiler as hc
from harts_compiler.codegen.microbatch import build_microbatch_index
from harts_compiler.ir import Microbatches
from harts_compiler.runtime import trajectory_wise
from harts_compiler.runtime.distributed import assemble_rows, run_plan
from test_runtime_helpers import random_rollout_batch
from test_runtime_tree import rel, tiny_model

TOL = 1e-10


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def split_plan(token_lists, chunk_size, parts=3):
    """Compiled with a budget that cuts the largest tree into about `parts` parts."""
    batch = hc.TreeBatch.from_trajectories(token_lists)
    whole = hc.compile(batch, hc.CompileOptions(chunk_size=chunk_size)).program.forest
    budget = max(int(whole.traj_length.max()), int(whole.num_tokens) // parts)
    plan = hc.compile(batch, hc.CompileOptions(chunk_size=chunk_size, microbatch_tokens=budget))
    note = plan.program.note("split-oversize")
    assert note is not None and note["parts"] >= 2, note
    assert len(plan.microbatches()) >= 2
    return plan


def batch_for(chunk_size, seed):
    """At C=64: a 150-token root and forks past position 60 of earlier trajectories, so parts
    replay across chunk boundaries and need several rounds."""
    rng = random.Random(seed)
    if chunk_size == 4:
        return random_rollout_batch(rng, vocab=100, n_traj=10, max_len=40)
    batch = [[rng.randrange(100) for _ in range(150)]]
    for _ in range(9):
        base = rng.choice(batch)
        cut = rng.randint(60, len(base))
        batch.append(base[:cut] + [rng.randrange(100) for _ in range(rng.randint(5, 40))])
    return batch


def weights(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    width = int(lengths.max())
    return (torch.randn(len(lengths), width, generator=gen, dtype=torch.float64),
            torch.randn(len(lengths), width, generator=gen, dtype=torch.float64))


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunk_size, seed", [(4, 0), (64, 1)])
def test_split_plan_equals_trajectory_wise(chunk_size, seed):
    token_lists = batch_for(chunk_size, seed)
    plan = split_plan(token_lists, chunk_size)
    if chunk_size == 64:
        seqs = plan.program.sequences
        assert seqs.replay_tokens > 0 and int(seqs.tree_rounds.max()) >= 2
    model = tiny_model(torch.float64, "tiny-qwen3-next")
    ids = [str(j) for j in range(len(token_lists))]
    assert plan.program.forest.traj_ids == ids

    model.zero_grad(set_to_none=True)
    want = trajectory_wise(model, token_lists, chunk_size=chunk_size)
    w_lp, w_ent = weights(want.lengths, seed)
    ((want.logprobs * w_lp).sum() + (want.entropy * w_ent).sum()).backward()
    want_grads = grads(model)

    model.zero_grad(set_to_none=True)
    outputs = run_plan(model, plan)
    logprobs, lengths = assemble_rows(plan, outputs, "logprobs")
    entropy, _ = assemble_rows(plan, outputs, "entropy")
    ((logprobs * w_lp).sum() + (entropy * w_ent).sum()).backward()
    got_grads = grads(model)

    assert torch.equal(lengths, want.lengths)
    assert rel(logprobs.detach(), want.logprobs.detach()) < TOL
    assert rel(entropy.detach(), want.entropy.detach()) < TOL
    assert set(got_grads) == set(want_grads)
    worst = max((rel(got_grads[n], want_grads[n]), n) for n in want_grads)
    assert worst[0] < TOL, worst
    # MoE routing counted once per trajectory over the whole plan
    load = sum(out.expert_load for out in outputs)
    assert torch.equal(load, want.expert_load)


def test_all_parts_in_one_microbatch_give_the_batch_aux_loss_exactly():
    """The aux loss is not a sum over microbatches, so exactness is shown where it is defined:
    all parts of the split trees in one microbatch (shared paths recomputed, multiplicities of
    the parts) give the trajectory-wise aux loss, log-probs and gradients of the whole batch."""
    token_lists = batch_for(4, 2)
    plan = split_plan(token_lists, 4)
    program = plan.program
    n_trees = program.forest.num_trees
    one = Microbatches(dp_size=1, microbatch_tokens=0, mb_rank=np.zeros(1, np.int64),
                       mb_slot=np.zeros(1, np.int64), mb_tree_ptr=np.asarray([0, n_trees]),
                       mb_trees=np.arange(n_trees, dtype=np.int64))
    program = program.replace(microbatches=one)
    program.verify()
    index = build_microbatch_index(program, 0)
    model = tiny_model(torch.float64, "tiny-qwen3-next")

    model.zero_grad(set_to_none=True)
    want = trajectory_wise(model, token_lists, chunk_size=4)
    w_lp, _ = weights(want.lengths, 5)
    ((want.logprobs * w_lp).sum() + 0.7 * want.aux_loss).backward()
    want_grads = grads(model)

    model.zero_grad(set_to_none=True)
    got = model(index)
    order = [got.trajectory_ids.index(str(j)) for j in range(len(token_lists))]
    ((got.logprobs[order] * w_lp[:, :got.logprobs.shape[1]]).sum() + 0.7 * got.aux_loss).backward()
    assert index.num_tokens > program.forest.num_tokens - program.note("split-oversize")[
        "recomputed_tokens"]  # the recomputed paths are really there
    got_aux, want_aux = float(got.aux_loss.detach()), float(want.aux_loss.detach())
    assert abs(got_aux - want_aux) < TOL * abs(want_aux)
    assert rel(got.logprobs[order].detach(), want.logprobs.detach()) < TOL
    worst = max((rel(grads(model)[n], want_grads[n]), n) for n in want_grads)
    assert worst[0] < TOL, worst
