"""Trees larger than the budget run as pieces (tiny models, fp64): every token is computed once (a plan statistic)
and each microbatch's whole rows, entropies, aux loss, expert loads and every parameter gradient equal
trajectory-wise training of the same trajectories, on adversarial trees with budgets that force 3+ pieces."""
import random

import numpy as np
import pytest
import torch

import harts_compiler as hc
from harts_compiler.codegen.pieces import build_piece_chain
from harts_compiler.ir import read_hir, structural_diff, write_hir
from harts_compiler.passes.cut_pieces import best_cuts
from harts_compiler.runtime import trajectory_wise
from harts_compiler.runtime.model import InvalidBatchError
from test_runtime_helpers import random_rollout_batch
from test_runtime_tree import rel, tiny_model

TOL = 1e-10
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _rand(rng, n):
    return [rng.randrange(100) for _ in range(n)]


def adversarial(name: str, C: int) -> list[list[int]]:
    rng = random.Random(name)
    if name == "branch on a chunk boundary":
        root = _rand(rng, 2 * C)
        return [root + _rand(rng, 7), root + _rand(rng, 9), root[:C] + _rand(rng, 5)]
    if name == "branch inside the first chunk":
        root = _rand(rng, C // 2)
        return [root + _rand(rng, 3 * C), root + _rand(rng, 2 * C), root[:3] + _rand(rng, C)]
    if name == "deep chain":
        out, base = [], _rand(rng, 3)
        for _ in range(12):
            base = base + _rand(rng, rng.randint(1, C + 3))
            out.append(list(base))
        return out
    if name == "wide fan-out":
        root = _rand(rng, C + 5)
        return [root + _rand(rng, rng.randint(1, 4)) for _ in range(300)]
    if name == "prefix and duplicates":
        root = _rand(rng, 3 * C + 1)
        return [root, root[:C + 2], list(root), root + _rand(rng, 4), root[:1]]
    if name == "one long trajectory":
        return [_rand(rng, 10 * 4 * C)]
    raise KeyError(name)


CASES = ["branch on a chunk boundary", "branch inside the first chunk", "deep chain", "wide fan-out",
         "prefix and duplicates", "one long trajectory"]


def pieced_plan(token_lists, C, budget):
    plan = hc.compile(hc.TreeBatch.from_trajectories(token_lists),
                      hc.CompileOptions(chunk_size=C, microbatch_tokens=budget))
    stats, pieces = plan.stats, plan.program.pieces
    assert pieces is not None and pieces.num_pieces >= 3
    # no token computed twice: what the pieces compute is every distinct token once, plus replay rows
    piece_tokens = int((pieces.piece_end - pieces.piece_start).sum())
    whole = plan.program.forest.tree_end - plan.program.forest.tree_start
    unsplit = int(whole[np.setdiff1d(np.arange(whole.size), pieces.piece_tree)].sum())
    assert piece_tokens + unsplit == plan.program.forest.num_tokens == stats["compact_tokens"]
    assert stats["planned_tokens"] == stats["compact_tokens"] + stats["replay_tokens"] + stats["cut_replay_rows"]
    return plan


def per_microbatch_reference(model, plan, token_lists, C, seed):
    """Trajectory-wise outputs and gradients of each microbatch's trajectories, and the plan's, for one weighted
    loss over log-probs, entropies and aux losses (the aux loss is per microbatch: compared where it is)."""
    forest = plan.program.forest
    gen = torch.Generator().manual_seed(seed)
    width = max(len(t) for t in token_lists)
    w_lp = torch.randn(len(token_lists), width, generator=gen, dtype=torch.float64)
    w_ent = torch.randn(len(token_lists), width, generator=gen, dtype=torch.float64)
    row = {tid: j for j, tid in enumerate(forest.traj_ids)}
    results = {}
    for mode in ("trajectory", "tree"):
        model.zero_grad(set_to_none=True)
        total, outs = 0.0, []
        for mb in plan.microbatches():
            if mode == "trajectory":
                ids = [forest.traj_ids[j] for j in np.flatnonzero(np.isin(
                    forest.node_tree[forest.traj_end_node], mb.trees)).tolist()]
                out = trajectory_wise(model, [token_lists[row[i]] for i in ids], chunk_size=C)
                out.trajectory_ids = ids
            else:
                out = model(mb)
            rows = torch.as_tensor([row[i] for i in out.trajectory_ids])
            w = out.logprobs.shape[1]
            loss = (out.logprobs * w_lp[rows, :w]).sum() + (out.entropy * w_ent[rows, :w]).sum()
            if out.aux_loss is not None:
                loss = loss + 0.7 * out.aux_loss
            loss.backward()
            outs.append(out)
            total += float(loss.detach())
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        results[mode] = (outs, grads, total)
    return results


@pytest.mark.parametrize("case", CASES)
def test_pieces_equal_trajectory_wise(case):
    C = 4
    token_lists = adversarial(case, C)
    distinct = hc.compile(hc.TreeBatch.from_trajectories(token_lists), hc.CompileOptions(chunk_size=C)).stats
    budget = max(C, -(-distinct["compact_tokens"] // (10 if case == "one long trajectory" else 4)))
    plan = pieced_plan(token_lists, C, budget)
    model = tiny_model(torch.float64, "tiny-qwen3-next")
    results = per_microbatch_reference(model, plan, token_lists, C, seed=len(case))
    (want, want_grads, want_total), (got, got_grads, got_total) = results["trajectory"], results["tree"]
    for w, g in zip(want, got):
        assert w.trajectory_ids == g.trajectory_ids
        assert torch.equal(w.lengths, g.lengths.cpu())
        assert rel(g.logprobs, w.logprobs) < TOL and rel(g.entropy, w.entropy) < TOL
        assert abs(float(g.aux_loss.detach() - w.aux_loss.detach())) < TOL * abs(float(w.aux_loss.detach()))
        assert torch.equal(g.expert_load, w.expert_load)
    assert abs(got_total - want_total) < TOL * abs(want_total)
    assert set(got_grads) == set(want_grads)
    worst = max((rel(got_grads[n], want_grads[n]), n) for n in want_grads)
    assert worst[0] < TOL, worst


@pytest.mark.parametrize("preset, C, seed", [("tiny-qwen3-next", 64, 1), ("tiny-qwen3.5-moe", 4, 2),
                                             ("tiny-kimi-linear", 4, 3), ("tiny-ling-3", 4, 4)])
def test_random_trees_in_pieces_every_family(preset, C, seed):
    rng = random.Random(seed)
    if C == 64:  # forks past position 60: cuts replay across chunk boundaries
        token_lists = [_rand(rng, 150)]
        for _ in range(9):
            base = rng.choice(token_lists)
            token_lists.append(base[:rng.randint(60, len(base))] + _rand(rng, rng.randint(5, 40)))
    else:
        token_lists = random_rollout_batch(rng, vocab=100, n_traj=12, max_len=40)
    distinct = hc.compile(hc.TreeBatch.from_trajectories(token_lists), hc.CompileOptions(chunk_size=C)).stats
    budget = max(C, int(distinct["compact_tokens"]) // 4)
    plan = pieced_plan(token_lists, C, budget)
    model = tiny_model(torch.float64, preset)
    results = per_microbatch_reference(model, plan, token_lists, C, seed)
    (want, want_grads, _), (got, got_grads, _) = results["trajectory"], results["tree"]
    for w, g in zip(want, got):
        assert rel(g.logprobs, w.logprobs) < TOL and rel(g.entropy, w.entropy) < TOL
        if w.aux_loss is not None:
            assert abs(float(g.aux_loss.detach() - w.aux_loss.detach())) < TOL * abs(float(w.aux_loss.detach()))
    worst = max((rel(got_grads[n], want_grads[n]), n) for n in want_grads)
    assert worst[0] < TOL, worst


def test_pieces_under_activation_checkpointing():
    token_lists = adversarial("branch on a chunk boundary", 4)
    plan = pieced_plan(token_lists, 4, 10)
    model = tiny_model(torch.float64, "tiny-qwen3-next")
    (mb,) = [mb for mb in plan.microbatches() if mb.runs_as_pieces]
    outs = []
    for checkpointing in (False, True):
        model.zero_grad(set_to_none=True)
        out = model(mb, activation_checkpointing=checkpointing)
        (out.logprobs.sum() + out.entropy.sum() + out.aux_loss).backward()
        outs.append((out.logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert torch.equal(outs[0][0], outs[1][0])
    assert max(rel(outs[1][1][n], outs[0][1][n]) for n in outs[0][1]) < 1e-13


def test_offloaded_piece_inputs_give_the_same_bits(monkeypatch):
    """offload_piece_inputs: the checkpointed layer inputs of every piece but the last go to host memory after its
    forward and come back for its backward; outputs and every gradient are bitwise those without it."""
    from harts_compiler.runtime.ops import offload
    token_lists = adversarial("deep chain", 4)
    plan = pieced_plan(token_lists, 4, 16)
    model = tiny_model(torch.float64, "tiny-qwen3-next")
    (mb,) = [mb for mb in plan.microbatches() if mb.runs_as_pieces]
    parked = []
    monkeypatch.setattr(offload.HostParkedInput, "park",
                        lambda self, park=offload.HostParkedInput.park: (parked.append(self), park(self)))
    outs = []
    for flag in (False, True):
        model.zero_grad(set_to_none=True)
        model.offload_piece_inputs = flag
        try:
            out = model(mb, activation_checkpointing=True)
        finally:
            model.offload_piece_inputs = False
        (out.logprobs.sum() + out.entropy.sum() + out.aux_loss).backward()
        outs.append((out.logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    pieces = len(mb.build_chain().indices)
    assert pieces >= 3 and len(parked) == (pieces - 1) * model.config.num_hidden_layers
    assert all(p.parked for p in parked)
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(outs[0][1][n], outs[1][1][n]) for n in outs[0][1])


@pytest.mark.parametrize("kind", ["conv", "replay", "kv"])
def test_carried_gradients_own_their_storage(kind):
    """A carried input's gradient is a copy of its rows, not a slice of the whole concatenated tensor's gradient:
    the producing piece holds it until every later piece's backward has run."""
    from types import SimpleNamespace

    from harts_compiler.runtime.ops.carry import LayerCarry
    rows = torch.tensor([0, 2])
    carried = torch.randn(3, 8, requires_grad=True)
    own = torch.randn(50, 8, requires_grad=True)
    piece = SimpleNamespace(conv_out=rows, replay_out=rows, kv_out=rows)
    if kind == "conv":  # the conv kernel reads the tail after the own rows (here: a concatenation that does so)
        out = torch.cat([own, LayerCarry(piece, {"conv": carried}).conv_rows([own])[1]])
    elif kind == "replay":  # q's rows appended by the conv, g's by the rounds' inputs
        carry = LayerCarry(piece, {"replay": (carried,) * 5})
        out = torch.cat([own, carry.conv_rows([own])[2][0]]) + carry.linear_inputs(*(own,) * 5)[0][3].sum()
    else:
        out = LayerCarry(piece, {"kv": (carried, carried)}).attention_keys(own, own)[0]
    (out * torch.randn_like(out)).sum().backward()
    grad = carried.grad
    assert grad.untyped_storage().nbytes() == grad.numel() * grad.element_size()


def test_a_piece_alone_is_refused_and_build_index_names_the_chain():
    token_lists = adversarial("deep chain", 4)
    plan = pieced_plan(token_lists, 4, 16)
    (mb,) = [mb for mb in plan.microbatches() if mb.runs_as_pieces]
    with pytest.raises(ValueError, match="runs as pieces"):
        mb.build_index()
    chain = build_piece_chain(plan.program, mb.trees[0])
    model = tiny_model(torch.float64, "tiny-qwen3-next")
    with pytest.raises(InvalidBatchError, match="one piece of a split tree"):
        model(chain.indices[1])


def test_cuts_are_the_fewest_pieces_with_the_shortest_context():
    # a 30-token root path, then branches of 10: with budget 64 the two cuts fall where the context is shortest
    position = np.concatenate([np.arange(30)] + [30 + np.arange(10)] * 9)
    cuts = best_cuts(position, 64, 4)
    assert cuts.size == -(-position.size // 64) - 1
    bounds = np.concatenate([[0], cuts, [position.size]])
    assert np.diff(bounds).max() <= 64 and np.all(position[cuts] == 30)
    # brute force over every pair of cuts on a small random tree shape
    rng = np.random.default_rng(0)
    position = np.concatenate([np.arange(rng.integers(1, 9)) + rng.integers(0, 5) for _ in range(6)])
    budget = 12
    k = -(-position.size // budget)
    best = min((sum(2 * int(position[c]) + int(position[c] % 4 != 0) for c in combo), combo)
               for combo in _cut_sets(position.size, budget, k))
    got = best_cuts(position, budget, 4)
    assert sum(2 * int(position[c]) + int(position[c] % 4 != 0) for c in got) == best[0]


def _cut_sets(T, budget, k):
    import itertools
    for combo in itertools.combinations(range(1, T), k - 1):
        bounds = (0,) + combo + (T,)
        if max(b - a for a, b in zip(bounds, bounds[1:])) <= budget:
            yield combo


def test_pieces_round_trip_through_hir(tmp_path):
    plan = pieced_plan(adversarial("wide fan-out", 4), 4, 120)
    path = write_hir(plan.program, tmp_path / "p.hir")
    back = read_hir(path)
    assert structural_diff(back, plan.program) is None
    back.verify()


def test_bad_budgets_are_rejected():
    token_lists = adversarial("deep chain", 4)
    for budget in (0, -5):
        with pytest.raises(hc.InputError, match="microbatch_tokens"):
            hc.compile(hc.TreeBatch.from_trajectories(token_lists),
                       hc.CompileOptions.checked(chunk_size=4, microbatch_tokens=budget))
    with pytest.raises(hc.InputError, match="microbatch_tokens"):
        hc.CompileOptions.checked(chunk_size=64, microbatch_tokens=32)


def _riders_batch(rng, C):
    """One tree a few tokens over the budget (two branching trajectories on a long root) and small branching
    trees (own first tokens: separate trees) that fit the room its smallest piece leaves."""
    root = [1] + _rand(rng, 9 * C)
    big = [root + _rand(rng, 2 * C + 1), root[:5 * C + 1] + _rand(rng, C + 2), root + _rand(rng, 3)]
    small = []
    for first in (120, 121, 122):  # _rand draws below 100
        stem = [first] + _rand(rng, C + 1)
        small += [stem + _rand(rng, C - 1), stem[:C] + _rand(rng, 2 * C), stem + _rand(rng, 2)]
    return big + small


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-kimi-linear"])
def test_whole_trees_riding_with_a_piece_equal_trajectory_wise(preset):
    import json

    C = 4
    token_lists = _riders_batch(random.Random(preset), C)
    whole = hc.compile(hc.TreeBatch.from_trajectories(token_lists), hc.CompileOptions(chunk_size=C))
    sizes = whole.program.forest.tree_end - whole.program.forest.tree_start
    budget = int(sizes.max()) - C - 2  # the big tree: two pieces, the smaller across a chunk boundary
    plan = hc.compile(hc.TreeBatch.from_trajectories(token_lists),
                      hc.CompileOptions(chunk_size=C, microbatch_tokens=budget))
    assert json.loads(dict(plan.program.notes)["schedule"])["riders"] >= 1
    (mb,) = [mb for mb in plan.microbatches() if mb.runs_as_pieces]
    assert len(mb.trees) > 1 and max(mb.piece_tokens) <= budget
    assert len(plan.microbatches()) < 1 + int((sizes < sizes.max()).sum())  # a cell fewer than without riders
    model = tiny_model(torch.float64, preset)
    results = per_microbatch_reference(model, plan, token_lists, C, seed=5)
    (want, want_grads, want_total), (got, got_grads, got_total) = results["trajectory"], results["tree"]
    for w, g in zip(want, got):
        order = [w.trajectory_ids.index(t) for t in g.trajectory_ids]
        assert sorted(order) == list(range(len(order)))
        assert rel(g.logprobs, w.logprobs[order]) < TOL and rel(g.entropy, w.entropy[order]) < TOL
        if w.aux_loss is not None:
            assert abs(float(g.aux_loss.detach() - w.aux_loss.detach())) < TOL * abs(float(w.aux_loss.detach()))
    assert abs(got_total - want_total) < TOL * abs(want_total)
    worst = max((rel(got_grads[n], want_grads[n]), n) for n in want_grads)
    assert worst[0] < TOL, worst


def test_piece_memory_model_and_its_offloaded_peak():
    """harts compile --model's piece memory: the first piece carries nothing, later ones their context; the
    offloaded peak is the full one less every earlier piece's layer inputs, which wait on the host."""
    from harts_compiler.commands import pieces_memory
    from harts_compiler.piece_memory import offloaded_bytes, piece_memory, predicted_peak
    from harts_compiler.runtime.config import ModelConfig, PRESETS
    token_lists = adversarial("deep chain", 4)
    plan = pieced_plan(token_lists, 4, 16)
    config = ModelConfig.from_dict(dict(PRESETS["tiny-qwen3-next"]))
    (mb,) = [mb for mb in plan.microbatches() if mb.runs_as_pieces]
    pieces = piece_memory(mb.build_chain(), config, 2)
    assert pieces[0].carried_bytes == 0 and all(p.carried_bytes > 0 for p in pieces[1:])
    assert offloaded_bytes(pieces) == sum(p.kept_bytes for p in pieces[:-1]) > 0
    full = predicted_peak(pieces)
    assert full == (sum(p.kept_bytes + p.carried_bytes for p in pieces) + max(p.transient_bytes for p in pieces))
    assert predicted_peak(pieces, offloaded=True) == full - offloaded_bytes(pieces)
    (report,) = pieces_memory(plan, config)
    assert report["predicted_peak_bytes"] == full and report["offloaded_host_bytes"] == offloaded_bytes(pieces)


@pytest.mark.parametrize("strided", [False, True])
def test_kept_rows_gradient_is_added_into_the_producers_own(strided):
    """The rows a later piece reads leave with their gradient added into the producing tensor's own gradient,
    equal to autograd's gather backward (which would build a zero tensor of the producer's size and add it)."""
    from harts_compiler.runtime.ops.carry import _keep_rows
    torch.manual_seed(0)
    base = torch.randn(40, 12, dtype=torch.float64, requires_grad=True)
    rows = torch.tensor([3, 7, 39])
    a, b = torch.randn(40, 9, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    other = torch.randn(40, 3, dtype=torch.float64)

    def loss(keep):
        x, kept = keep(base[:, 3:9] * 1.0)
        # concatenated by columns, x's own gradient arrives as a strided slice of the whole one's
        y = torch.cat([x, other], dim=1) if strided else torch.cat([x, other.sin()], dim=1).sin()
        return (y * a).sum() + (kept.cos() * b).sum()

    want = torch.autograd.grad(loss(lambda x: (x, x[rows])), base)[0]
    got = torch.autograd.grad(loss(lambda x: _keep_rows(x, rows)), base)[0]
    assert torch.equal(got, want)
