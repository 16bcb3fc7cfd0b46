"""The GDN plan Function (codegen/kernels/chunk_gdn/tree.py) under TRITON_INTERPRET=1 (tests/conftest.py sets it
without CUDA), at chunk size 64 on the docs/design.md section 11 trees: outputs bit-equal to one Triton call per
round, and outputs and every input gradient equal to the fp64 reference over the same plan."""
from __future__ import annotations

import os
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from harts_compiler.codegen.index import LinearRound
from harts_compiler.codegen.kernels.chunk_gdn import (GDNKernelConfig, chunk_gated_delta_rule,
                                                      chunk_gated_delta_rule_reference, gated_delta_rule,
                                                      plan_gated_delta_rule_reference, plan_tree_gdn)
from harts_compiler.codegen.kernels.chunk_gdn.index import NO_SHIFT
from harts_compiler.codegen.kernels.chunk_gdn.tree import gated_at_of
from harts_compiler.codegen.kernels.upload import to_device
from test_runtime_helpers import run_without_device_reads, naive_tree_index, random_rollout_batch
from test_runtime_tree import tricky_batches
from two_level import run_trajectories, run_tree, two_level_plan, two_level_round_specs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or TRITON_INTERPRET=1")
C = 64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter: fp32 at 16-column heads; CUDA: a configuration its guard admits (config.triton_supports)
DTYPE, DIM = (torch.float32, 16) if DEVICE == "cpu" else (torch.bfloat16, 64)
KW = dict(scale=0.25, use_qk_l2norm=True)


def inputs(T, seed, hk=1, hv=2, kd=DIM, vd=DIM):
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(T, hk, kd, generator=gen), torch.randn(T, hk, kd, generator=gen),
               torch.randn(T, hv, vd, generator=gen), -torch.rand(T, hv, generator=gen) * 0.2,
               torch.rand(T, hv, generator=gen)]
    return [t.to(DEVICE, DTYPE if i != 3 else torch.float32) for i, t in enumerate(tensors)]


def assert_close(got, expect, name=""):
    """fp32 under the interpreter: to 2e-4; bf16 on the GPU: 1e-2 of the norm (fla's own error is 1e-3..5e-3)."""
    got, expect = got.detach().double().cpu(), expect.detach().cpu()
    if DEVICE == "cpu":
        torch.testing.assert_close(got, expect, rtol=2e-4, atol=2e-5, msg=name)
    else:
        assert float((got - expect).norm() / expect.norm()) < 1e-2, name


def run(fn, tensors, weights):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    o = fn(*leaves)
    return [o, *torch.autograd.grad((o.double() * weights).sum(), leaves)]


def device_plan(rounds, num_tokens, **config):
    return to_device(plan_tree_gdn(rounds, num_tokens, chunk_size=C, config=GDNKernelConfig(**config)), DEVICE)


def fused(plan):
    return lambda *x: gated_delta_rule(*x, plan=plan, **KW)[0]


def reference(plan):  # the same plan in plain torch, in fp64
    return lambda *x: plan_gated_delta_rule_reference(*x, plan=plan, state_dtype=torch.float64, **KW)[0]


def per_round_triton(index):
    """One `chunk_gated_delta_rule` call per round, with autograd gathers between them (the kernels' other
    entry point): the outputs the fused Function must reproduce bit for bit."""
    def call(q, k, v, g, beta):
        hv, kd, vd = v.shape[1], k.shape[2], v.shape[2]
        bank, out = {}, torch.empty_like(v)
        for rnd in index.rounds:
            src = torch.as_tensor(rnd.row_src, device=v.device)
            zero = torch.zeros(hv, kd, vd, device=v.device)
            init = torch.stack([bank[int(b)] if b >= 0 else zero for b in rnd.init_state])
            o, exported = chunk_gated_delta_rule(q[src], k[src], v[src], g[src], beta[src], initial_state=init,
                                                 cu_seqlens=torch.as_tensor(rnd.cu_seqlens),
                                                 export_seq=torch.as_tensor(rnd.export_seq),
                                                 export_offset=torch.as_tensor(rnd.export_offset), **KW)
            bank.update({int(b): s for b, s in zip(rnd.export_bank, exported)})
            out = out.index_copy(0, torch.as_tensor(rnd.own_dst, device=v.device),
                                 o[torch.as_tensor(rnd.own_rows, device=v.device)])
        return out
    return call


def batches():
    cases = {name: batch for name, batch in tricky_batches(C).items()
             if name in ("branch_on_chunk_boundary", "replay_across_short_nodes", "prefix_and_duplicate_trajectories")}
    cases["random forks"] = random_rollout_batch(random.Random(3), vocab=3, n_traj=6, max_len=150)
    return cases


@pytest.mark.parametrize("name", list(batches()))
def test_plan_function_equals_rounds(name):
    index = naive_tree_index(batches()[name], chunk_size=C)
    tensors = inputs(index.num_tokens, seed=len(name))
    weights = torch.randn(index.num_tokens, 2, DIM, generator=torch.Generator().manual_seed(5),
                          dtype=torch.float64).to(DEVICE)
    plan = device_plan(index.rounds, index.num_tokens)
    got = run(fused(plan), tensors, weights)
    rounds = run(per_round_triton(index), tensors, weights)
    assert torch.equal(got[0], rounds[0]), "outputs differ from one Triton call per round"
    expect = run(reference(plan), [t.double() for t in tensors], weights)
    for name_, a, b in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], got, expect):
        assert_close(a, b, name_)
    assert len(index.rounds) > 1, "a single round would not test the hand-offs"


def test_compiled_plan_function_equals_rounds():
    """A GRPO-like group as the compiler plans it (not a hand-made plan): one response continues the prompt's
    sequence, the others replay the prompt's partial chunk from its exported state a round later; the Function
    equals one Triton call per round and the fp64 reference."""
    import harts_compiler as hc
    prompt = list(range(1, 101))  # a partial second chunk: every response that starts a sequence replays 36 rows
    batch = hc.TreeBatch.from_trajectories([prompt + [1000 + r] * n for r, n in enumerate((40, 150, 230))])
    plan = hc.compile(batch, hc.CompileOptions(chunk_size=C))
    seqs = plan.program.sequences
    assert seqs.num_sequences == 3 and int(seqs.seq_round.max()) == 1
    assert sorted(np.diff(seqs.replay_ptr).tolist()) == [0, 36, 36]
    index = plan.microbatches()[0].build_index()
    tensors = inputs(index.num_tokens, seed=21)
    weights = torch.randn(index.num_tokens, 2, DIM, generator=torch.Generator().manual_seed(6),
                          dtype=torch.float64).to(DEVICE)
    gdn_plan = device_plan(index.rounds, index.num_tokens)
    got = run(fused(gdn_plan), tensors, weights)
    assert torch.equal(got[0], run(per_round_triton(index), tensors, weights)[0])
    expect = run(reference(gdn_plan), [t.double() for t in tensors], weights)
    for name, a, b in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], got, expect):
        assert_close(a, b, name)


def test_replays_and_shared_starts_are_summed():
    """A root whose tail chunk is replayed by three branches that all start from its exported state."""
    root, branch = 70, 20
    T = root + 3 * branch
    replay = np.arange(C, root)
    rounds = [LinearRound(cu_seqlens=np.array([0, root]), row_src=np.arange(root), own_rows=np.arange(root),
                          own_dst=np.arange(root), init_state=np.array([-1]), export_seq=np.array([0]),
                          export_offset=np.array([C]), export_bank=np.array([7])),
              LinearRound(cu_seqlens=np.arange(4) * (root - C + branch),
                          row_src=np.concatenate([np.r_[replay, root + b * branch + np.arange(branch)]
                                                  for b in range(3)]),
                          own_rows=np.concatenate([b * (root - C + branch) + root - C + np.arange(branch)
                                                   for b in range(3)]),
                          own_dst=root + np.arange(3 * branch), init_state=np.array([7, 7, 7]),
                          export_seq=np.zeros(0), export_offset=np.zeros(0), export_bank=np.zeros(0))]
    plan = device_plan(rounds, T)
    # the root's two chunks at row + 0, each branch's (replays first) through the maps
    assert (plan.rows.chunk_shift.cpu() == NO_SHIFT).tolist() == [False, False, True, True, True]
    assert plan.replay_bounds.diff().tolist() == [3] * (root - C)
    assert plan.launches[1].start_bounds.diff().tolist() == [3]
    tensors = inputs(T, seed=1)
    weights = torch.randn(T, 2, DIM, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(DEVICE)
    got = run(fused(plan), tensors, weights)

    def trajectories(q, k, v, g, beta):  # each root + branch on its own, from zero states, fp64 reference
        rows = torch.cat([torch.cat([torch.arange(root), root + b * branch + torch.arange(branch)])
                          for b in range(3)]).to(DEVICE)
        o, _ = chunk_gated_delta_rule_reference(q[rows], k[rows], v[rows], g[rows], beta[rows],
                                                initial_state=q.new_zeros(3, 2, DIM, DIM),
                                                cu_seqlens=torch.arange(4) * (root + branch), chunk_size=C, **KW)
        own = torch.cat([torch.arange(root), torch.cat([root + b * (root + branch) + torch.arange(branch)
                                                        for b in range(3)])]).to(DEVICE)
        return o[own]
    again = run(fused(plan), tensors, weights)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "two runs differ: a sum is not deterministic"
    expect = run(trajectories, [t.double() for t in tensors], weights)
    for a, b in zip(got, expect):
        assert_close(a, b)


def test_narrow_rounds_read_dv_local_full_width_rounds_form_it():
    """A wide first round (three roots) and a narrow second one (one branch): the branch's backward scan reads
    dv_local from a buffer that starts at its own packed rows, the roots' scans form theirs. Every output and
    gradient equals the plan's whose launches all run at full width, bit for bit."""
    roots = np.array([0, 128, 198, 288])
    T = 338
    rounds = [LinearRound(cu_seqlens=roots, row_src=np.arange(288), own_rows=np.arange(288), own_dst=np.arange(288),
                          init_state=np.full(3, -1), export_seq=np.array([0]), export_offset=np.array([128]),
                          export_bank=np.array([5])),
              LinearRound(cu_seqlens=np.array([0, 50]), row_src=288 + np.arange(50), own_rows=np.arange(50),
                          own_dst=288 + np.arange(50), init_state=np.array([5]), export_seq=np.zeros(0),
                          export_offset=np.zeros(0), export_bank=np.zeros(0))]
    vd = 2 * DIM
    # 3 x 2 heads programs: full width; 1 x 2: narrow. Every full-width launch forms dv_local, however short.
    mixed = device_plan(rounds, T, scan_block_v=vd, scan_min_programs=4, scan_local_dv_min_chunks=0)
    tensors = inputs(T, seed=4, vd=vd)
    full_width = [mixed.index.config.scan_full_width(launch.round_seqs, 2, vd, tensors[1].element_size())
                  for launch in mixed.launches]  # the roots' launches (one per lane), then the branch's
    assert all(full_width[:-1]) and not full_width[-1]
    full = device_plan(rounds, T, scan_block_v=vd, scan_min_programs=0, scan_local_dv_min_chunks=0)
    weights = torch.randn(T, 2, vd, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(DEVICE)
    for name, a, b in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], run(fused(mixed), tensors, weights),
                          run(fused(full), tensors, weights)):
        assert torch.equal(a, b), name


def test_launches_inside_the_gated_at_buffer_read_it():
    """The A^T buffer spans the chunks from the first to the last launch that cannot form dv_local; a launch inside
    that span reads it (computed anyway), one outside forms its own."""
    buffer = ("at", 10, (10, 20))
    assert gated_at_of(SimpleNamespace(chunks=(10, 12)), buffer) == ("at", 10)
    assert gated_at_of(SimpleNamespace(chunks=(18, 20)), buffer) == ("at", 10)
    assert gated_at_of(SimpleNamespace(chunks=(20, 25)), buffer) is None
    assert gated_at_of(SimpleNamespace(chunks=(0, 10)), buffer) is None
    assert gated_at_of(SimpleNamespace(chunks=(0, 3)), None) is None


def test_aligned_branch_points_need_no_maps():
    """A tree whose branches fork on a chunk boundary replays nothing: the packed layout is the compact one
    (identity_layout, no row maps). Outputs equal one call per round bit for bit, even on a non-contiguous v
    (the runtime's is a view), and the fp64 trajectory-wise reference in every gradient."""
    plan2 = two_level_plan([(2 * C, 3, 70)], device=DEVICE)
    plan = device_plan(two_level_round_specs(plan2), plan2.compact_rows)
    assert plan.identity_layout and plan.rows is None
    tensors = inputs(plan2.compact_rows, seed=4)
    weights = torch.randn(plan2.compact_rows, 2, DIM, generator=torch.Generator().manual_seed(3),
                          dtype=torch.float64).to(DEVICE)
    got = run(fused(plan), tensors, weights)

    def strided_v(q, k, v, g, beta):  # v as every other head of a wider tensor
        wide = torch.stack([v, torch.full_like(v, float("nan"))], dim=2).flatten(1, 2)
        return fused(plan)(q, k, wide[:, ::2], g, beta)
    assert all(torch.equal(a, b) for a, b in zip(run(strided_v, tensors, weights), got)), "non-contiguous v"
    rounds = run(lambda *x: run_tree(chunk_gated_delta_rule, plan2, *x, **KW), tensors, weights)
    assert torch.equal(got[0], rounds[0]), "outputs differ from one Triton call per round"
    first_row = np.unique(plan2.traj_rows.cpu().numpy(), return_index=True)[1]  # trajectory row of each token

    def trajectories(q, k, v, g, beta):
        o = run_trajectories(chunk_gated_delta_rule_reference, plan2, q, k, v, g, beta, chunk_size=C, **KW)
        return o[torch.as_tensor(first_row, device=o.device)]
    expect = run(trajectories, [t.double() for t in tensors], weights)
    for name_, a, b in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], got, expect):
        assert_close(a, b, name_)


def test_independent_trees_scan_on_lanes():
    """Three trees, their branch points off chunk boundaries: each tree's scans form one lane (a CUDA stream on
    the GPU; in order under the interpreter), and the results equal one launch per round bit for bit, every
    gradient included."""
    plan2 = two_level_plan([(150, 3, 40), (70, 2, 90), (100, 4, 20)], device=DEVICE)
    specs = two_level_round_specs(plan2)
    plans = {lanes: device_plan(specs, plan2.compact_rows, tree_scan_lanes=lanes) for lanes in (1, 2, 8)}
    assert [len(plans[n].launches) for n in (1, 2, 8)] == [2, 4, 6] and plans[8].num_lanes == 3
    by_lane = {}
    for launch in plans[8].launches:  # each lane: its tree's root, then that tree's branches
        by_lane.setdefault(launch.lane, []).append(launch.num_seqs)
    assert sorted(by_lane.values()) == [[1, 2], [1, 3], [1, 4]]
    assert all(launch.round_seqs == (3 if launch.num_seqs == 1 else 9) for launch in plans[8].launches)
    chunks = np.diff(plans[1].index.seq_chunk_start.cpu().numpy())
    for launch in plans[1].launches:  # each launch starts its longest sequences first
        own = chunks[launch.first_seq:launch.first_seq + launch.num_seqs][launch.scan_order.cpu().numpy()]
        assert sorted(launch.scan_order.tolist()) == list(range(launch.num_seqs)) and np.all(np.diff(own) <= 0)
    tensors = inputs(plan2.compact_rows, seed=6)
    weights = torch.randn(plan2.compact_rows, 2, DIM, generator=torch.Generator().manual_seed(7),
                          dtype=torch.float64).to(DEVICE)
    results = {n: run(fused(plan), tensors, weights) for n, plan in plans.items()}
    for n in (2, 8):
        assert all(torch.equal(a, b) for a, b in zip(results[n], results[1])), f"{n} lanes differ from one"
    rounds = run(lambda *x: run_tree(chunk_gated_delta_rule, plan2, *x, **KW), tensors, weights)
    assert torch.equal(results[8][0], rounds[0]), "outputs differ from one Triton call per round"
    with pytest.raises(ValueError, match="tree_scan_lanes"):
        GDNKernelConfig(tree_scan_lanes=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="detects host synchronisation on CUDA")
def test_plan_function_never_waits_for_the_device():
    """No host <-> device synchronisation in the Function's forward or backward (after a warm-up that compiles
    the kernels): a sync would leave the GPU idle while the host issues the next launches."""
    plan2 = two_level_plan([(150, 3, 40), (70, 2, 90), (100, 4, 20)], device=DEVICE)
    plan = device_plan(two_level_round_specs(plan2), plan2.compact_rows)
    leaves = [t.requires_grad_(True) for t in inputs(plan2.compact_rows, seed=10)]

    def step():
        o = fused(plan)(*leaves)
        return torch.autograd.grad(o, leaves, torch.ones_like(o))
    run_without_device_reads(step)


def _round(**changes):
    ok = dict(cu_seqlens=np.array([0, 4]), row_src=np.arange(4), own_rows=np.arange(4), own_dst=np.arange(4),
              init_state=np.array([-1]), export_seq=np.zeros(0), export_offset=np.zeros(0), export_bank=np.zeros(0))
    return LinearRound(**{**ok, **changes})


def test_bad_plans_are_named():
    for changes, message in [
            (dict(init_state=np.array([-2])), r"rounds\[0\].init_state must hold a bank id"),
            (dict(init_state=np.array([3])), r"rounds\[0\].init_state: bank id 3"),
            (dict(export_seq=np.array([0]), export_offset=np.array([3]), export_bank=np.array([0])),
             r"rounds\[0\]: `export_offset\[0\]`=3"),
            (dict(own_rows=np.arange(3), own_dst=np.arange(3)), "token 3 is kept by no round"),
            (dict(row_src=np.array([0, 1, 2, 9])), r"rounds\[0\].row_src")]:
        with pytest.raises(ValueError, match=message):
            plan_tree_gdn([_round(**changes)], 4)
    long = dict(cu_seqlens=np.array([0, 64]), row_src=np.arange(64), own_rows=np.arange(64), own_dst=np.arange(64),
                export_seq=np.array([0]), export_offset=np.array([64]), export_bank=np.array([2]))
    empty = dict(cu_seqlens=np.array([0, 0]), row_src=np.zeros(0), own_rows=np.zeros(0), own_dst=np.zeros(0),
                 export_seq=np.array([0]), export_offset=np.array([64]), export_bank=np.array([2]))
    with pytest.raises(ValueError, match=r"rounds\[1\]: `export_offset\[0\]`=64"):  # an empty sequence cannot export
        plan_tree_gdn([_round(**long), _round(**empty)], 64)
    with pytest.raises(ValueError, match="export_bank id -1"):
        plan_tree_gdn([_round(**{**long, "export_bank": np.array([-1])})], 64)
    with pytest.raises(ValueError, match="replays must fit in a sequence's first chunk"):
        plan_tree_gdn([_round(cu_seqlens=np.array([0, 130]), row_src=np.r_[np.arange(128), 0, 1],
                              own_rows=np.arange(128), own_dst=np.arange(128))], 128)
    plan = device_plan([_round()], 4)
    with pytest.raises(ValueError, match="plan was built for 4 tokens"):
        gated_delta_rule(*inputs(5, 0), scale=1.0, plan=plan)
    with pytest.raises(ValueError, match="the plan lives on the host"):
        gated_delta_rule(*inputs(4, 0), scale=1.0, plan=plan_tree_gdn([_round()], 4))
    with pytest.raises(ValueError, match="chunk_size 32"):
        gated_delta_rule(*inputs(4, 0), scale=1.0, plan=to_device(plan_tree_gdn([_round()], 4, chunk_size=32),
                                                                  DEVICE))


def test_a_bank_id_names_one_state():
    """Two rounds exporting different states under one bank id: rejected (a later start would be ambiguous)."""
    first = _round(cu_seqlens=np.array([0, 128]), row_src=np.arange(128), own_rows=np.arange(128),
                   own_dst=np.arange(128), export_seq=np.array([0]), export_offset=np.array([64]),
                   export_bank=np.array([5]))
    second = _round(cu_seqlens=np.array([0, 64]), row_src=np.arange(128, 192), own_rows=np.arange(64),
                    own_dst=np.arange(128, 192), init_state=np.array([5]), export_seq=np.array([0]),
                    export_offset=np.array([64]), export_bank=np.array([5]))
    with pytest.raises(ValueError, match="export_bank id 5 .* already names another exported state"):
        plan_tree_gdn([first, second], 192)


def test_without_cuda_or_the_interpreter_the_error_says_so(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    plan = to_device(plan_tree_gdn([_round()], 4), "cpu")
    with pytest.raises(ValueError, match="need CUDA or TRITON_INTERPRET=1"):
        gated_delta_rule(*[t.cpu() for t in inputs(4, 0)], scale=1.0, plan=plan)
