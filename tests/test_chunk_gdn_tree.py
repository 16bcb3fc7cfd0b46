"""The multi-round tree Function (codegen/kernels/chunk_gdn/tree.py) under TRITON_INTERPRET=1 (tests/conftest.py
sets it without CUDA), at chunk size 64 on the DESIGN.md section 11 trees: outputs bit-equal to one
Triton call per round, and outputs and every input gradient equal to the fp64 reference over the rounds."""
from __future__ import annotations

import dataclasses
import os
import random

import numpy as np
import pytest
import torch

from harts_compiler.codegen.kernels.chunk_gdn import (GDNKernelConfig, chunk_gated_delta_rule,
                                                      chunk_gated_delta_rule_reference)
from harts_compiler.codegen.kernels.chunk_gdn.index import NO_SHIFT
from harts_compiler.codegen.kernels.chunk_gdn.tree import TreeRoundSpec, plan_tree_gdn, tree_gated_delta_rule
from harts_compiler.codegen.kernels.chunk_gdn.two_level import (run_trajectories, run_tree, two_level_plan,
                                                                two_level_round_specs)
from harts_compiler.runtime.ops.linear_attention import (gated_delta_rule_rounds, plan_linear_rounds,
                                                         tree_round_specs)
from test_runtime_helpers import naive_tree_index, random_rollout_batch
from test_runtime_tree import tricky_batches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or TRITON_INTERPRET=1")
C = 64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter: fp32 at 16-column heads; CUDA: a configuration its guard admits (function.triton_supports)
DTYPE, DIM = (torch.float32, 16) if DEVICE == "cpu" else (torch.bfloat16, 64)


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


def feeding_config(rows_in_kernels) -> GDNKernelConfig:
    """gathers (False), row maps (True), + affine scan rows ("affine"), + affine chunk rows ("chunks")."""
    return GDNKernelConfig(tree_rows_in_kernels=bool(rows_in_kernels),
                           tree_affine_scan_rows=rows_in_kernels in ("affine", "chunks"),
                           tree_affine_chunk_rows=rows_in_kernels == "chunks")


def batches():
    cases = {name: batch for name, batch in tricky_batches(C).items()
             if name in ("branch_on_chunk_boundary", "replay_across_short_nodes", "prefix_and_duplicate_trajectories")}
    cases["random forks"] = random_rollout_batch(random.Random(3), vocab=3, n_traj=6, max_len=150)
    return cases


@pytest.mark.parametrize("rows_in_kernels", [False, True, "affine", "chunks"],
                         ids=["gathers", "row-maps", "affine-scans", "affine-chunks"])
@pytest.mark.parametrize("name", list(batches()))
def test_tree_function_equals_rounds(name, rows_in_kernels):
    """The ways of feeding the packed layout: gathered copies, the kernels reading through row maps, the
    scans reading rows after each sequence's first chunk at row + shift (tree_affine_scan_rows), and the
    chunk-parallel kernels reading chunks without replayed rows at row + shift too (tree_affine_chunk_rows)."""
    batch = batches()[name]
    index = naive_tree_index(batch, chunk_size=C)
    tensors = inputs(index.num_tokens, seed=len(name))
    weights = torch.randn(index.num_tokens, 2, DIM, generator=torch.Generator().manual_seed(5),
                          dtype=torch.float64).to(DEVICE)
    plan = plan_tree_gdn(tree_round_specs(index), index.num_tokens, chunk_size=C, device=DEVICE,
                         config=feeding_config(rows_in_kernels))
    assert (plan.rows is not None) == bool(rows_in_kernels)
    if rows_in_kernels in ("affine", "chunks"):  # the runtime's rounds: replays fill at most a first chunk
        assert plan.rows.seq_shift is not None
    assert (rows_in_kernels == "chunks") == (plan.rows is not None and plan.rows.chunk_shift is not None)
    index = index.to(DEVICE)
    rounds = plan_linear_rounds(index, use_triton=False)
    kw = dict(scale=0.25, use_qk_l2norm=True)

    def fused(q, k, v, g, beta):
        return tree_gated_delta_rule(q, k, v, g, beta, plan=plan, **kw)

    def per_round(kernel, state_dtype):
        return lambda *x: gated_delta_rule_rounds(*x, index, rounds, state_dtype=state_dtype, kernel=kernel, **kw)

    got = run(fused, tensors, weights)
    if rows_in_kernels:  # the same values reach the same kernels: equal to the gathered copies bit for bit
        gathered = run(lambda *x: tree_gated_delta_rule(*x, plan=dataclasses.replace(plan, rows=None), **kw),
                       tensors, weights)
        assert all(torch.equal(a, b) for a, b in zip(got, gathered)), "row maps differ from the gathers"
    triton_rounds = run(per_round(chunk_gated_delta_rule, torch.float32), tensors, weights)
    reference = run(per_round(chunk_gated_delta_rule_reference, torch.float64), [t.double() for t in tensors], weights)
    assert torch.equal(got[0], triton_rounds[0]), "outputs differ from one Triton call per round"
    for name_, a, b in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], got, reference):
        assert_close(a, b, name_)
    assert len(index.rounds) > 1, "a single round would not test the hand-offs"


@pytest.mark.parametrize("rows_in_kernels", [False, True, "affine", "chunks"],
                         ids=["gathers", "row-maps", "affine-scans", "affine-chunks"])
def test_replays_and_shared_starts_are_summed(rows_in_kernels):
    """A root whose tail chunk is replayed by three branches that all start from its exported state."""
    root, branch = 70, 20
    T = root + 3 * branch
    replay = np.arange(C, root)
    rounds = [TreeRoundSpec(cu_seqlens=np.array([0, root]), row_src=np.arange(root), own_rows=np.arange(root),
                            own_dst=np.arange(root), init_state=np.array([-1]), export_seq=np.array([0]),
                            export_offset=np.array([C]), export_bank=np.array([7])),
              TreeRoundSpec(cu_seqlens=np.arange(4) * (root - C + branch),
                            row_src=np.concatenate([np.r_[replay, root + b * branch + np.arange(branch)]
                                                    for b in range(3)]),
                            own_rows=np.concatenate([b * (root - C + branch) + root - C + np.arange(branch)
                                                     for b in range(3)]),
                            own_dst=root + np.arange(3 * branch), init_state=np.array([7, 7, 7]),
                            export_seq=np.zeros(0, np.int64), export_offset=np.zeros(0, np.int64),
                            export_bank=np.zeros(0, np.int64))]
    plan = plan_tree_gdn(rounds, T, chunk_size=C, device=DEVICE, config=feeding_config(rows_in_kernels))
    assert (rows_in_kernels in ("affine", "chunks")) == (plan.rows is not None and plan.rows.seq_shift is not None)
    if rows_in_kernels == "chunks":  # the root's two chunks at row + 0, each branch's (replays first) through maps
        assert (plan.rows.chunk_shift == NO_SHIFT).tolist() == [False, False, True, True, True]
    assert plan.replay_bounds.diff().tolist() == [3] * (root - C) and plan.rounds[1].start_counts.tolist() == [3]
    tensors = inputs(T, seed=1)
    weights = torch.randn(T, 2, DIM, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(DEVICE)
    got = run(lambda *x: tree_gated_delta_rule(*x, scale=0.3, plan=plan, use_qk_l2norm=True), tensors, weights)

    def trajectories(q, k, v, g, beta):  # each root + branch on its own, from zero states, fp64 reference
        rows = torch.cat([torch.cat([torch.arange(root), root + b * branch + torch.arange(branch)])
                          for b in range(3)]).to(DEVICE)
        cu = (torch.arange(4) * (root + branch)).to(DEVICE)
        o, _ = chunk_gated_delta_rule_reference(q[rows], k[rows], v[rows], g[rows], beta[rows], scale=0.3,
                                                initial_state=q.new_zeros(3, 2, DIM, DIM),
                                                cu_seqlens=cu, chunk_size=C, use_qk_l2norm=True)
        own = torch.cat([torch.arange(root), torch.cat([root + b * (root + branch) + torch.arange(branch)
                                                        for b in range(3)])]).to(DEVICE)
        return o[own]
    again = run(lambda *x: tree_gated_delta_rule(*x, scale=0.3, plan=plan, use_qk_l2norm=True), tensors, weights)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "two runs differ: a sum is not deterministic"
    expect = run(trajectories, [t.double() for t in tensors], weights)
    for a, b in zip(got, expect):
        assert_close(a, b)


def test_aligned_branch_points_skip_the_gathers():
    """A tree whose branches fork on a chunk boundary replays nothing: the packed layout is the compact one
    (identity_layout, no gathers). Results equal the gathered path bit for bit, gradients included, even on
    a non-contiguous v (the runtime's is a view), one call per round bit for bit in the outputs, and the
    fp64 trajectory-wise reference in every gradient."""
    plan2 = two_level_plan([(2 * C, 3, 70)], device=DEVICE)
    plan = plan_tree_gdn(two_level_round_specs(plan2), plan2.compact_rows, chunk_size=C, device=DEVICE)
    assert plan.identity_layout
    tensors = inputs(plan2.compact_rows, seed=4)
    weights = torch.randn(plan2.compact_rows, 2, DIM, generator=torch.Generator().manual_seed(3),
                          dtype=torch.float64).to(DEVICE)
    kw = dict(scale=0.3, use_qk_l2norm=True)
    got = run(lambda *x: tree_gated_delta_rule(*x, plan=plan, **kw), tensors, weights)
    gathered = run(lambda *x: tree_gated_delta_rule(*x, plan=dataclasses.replace(plan, identity_layout=False), **kw),
                   tensors, weights)
    assert all(torch.equal(a, b) for a, b in zip(got, gathered)), "identity layout differs from the gathers"

    def strided_v(q, k, v, g, beta):  # v as every other head of a wider tensor
        wide = torch.stack([v, torch.full_like(v, float("nan"))], dim=2).flatten(1, 2)
        return tree_gated_delta_rule(q, k, wide[:, ::2], g, beta, plan=plan, **kw)
    assert all(torch.equal(a, b) for a, b in zip(run(strided_v, tensors, weights), got)), "non-contiguous v"
    rounds = run(lambda *x: run_tree(chunk_gated_delta_rule, plan2, *x, **kw), tensors, weights)
    assert torch.equal(got[0], rounds[0]), "outputs differ from one Triton call per round"

    first_row = np.unique(plan2.traj_rows.cpu().numpy(), return_index=True)[1]  # trajectory row of each token

    def trajectories(q, k, v, g, beta):
        o = run_trajectories(chunk_gated_delta_rule_reference, plan2, q, k, v, g, beta, chunk_size=C, **kw)
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
    kw = dict(scale=0.3, use_qk_l2norm=True)
    plans = {lanes: plan_tree_gdn(specs, plan2.compact_rows, chunk_size=C, device=DEVICE,
                                  config=GDNKernelConfig(tree_scan_lanes=lanes)) for lanes in (1, 2, 8)}
    assert [len(plans[n].rounds) for n in (1, 2, 8)] == [2, 4, 6] and plans[8].num_lanes == 3
    by_lane = {}
    for launch in plans[8].rounds:  # each lane: its tree's root, then that tree's branches
        by_lane.setdefault(launch.lane, []).append(launch.num_seqs)
    assert sorted(by_lane.values()) == [[1, 2], [1, 3], [1, 4]]
    assert all(launch.round_seqs == (3 if launch.num_seqs == 1 else 9) for launch in plans[8].rounds)
    tensors = inputs(plan2.compact_rows, seed=6)
    weights = torch.randn(plan2.compact_rows, 2, DIM, generator=torch.Generator().manual_seed(7),
                          dtype=torch.float64).to(DEVICE)
    results = {n: run(lambda *x: tree_gated_delta_rule(*x, plan=plan, **kw), tensors, weights)
               for n, plan in plans.items()}
    for n in (2, 8):
        assert all(torch.equal(a, b) for a, b in zip(results[n], results[1])), f"{n} lanes differ from one"
    rounds = run(lambda *x: run_tree(chunk_gated_delta_rule, plan2, *x, **kw), tensors, weights)
    assert torch.equal(results[8][0], rounds[0]), "outputs differ from one Triton call per round"
    with pytest.raises(ValueError, match="tree_scan_lanes"):
        GDNKernelConfig(tree_scan_lanes=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="detects host synchronisation on CUDA")
def test_tree_step_never_waits_for_the_device():
    """No host <-> device synchronisation in the tree Function's forward or backward (after a warm-up that
    compiles the kernels): a sync would leave the GPU idle while the host issues the next launches."""
    plan2 = two_level_plan([(150, 3, 40), (70, 2, 90), (100, 4, 20)], device=DEVICE)
    plan = plan_tree_gdn(two_level_round_specs(plan2), plan2.compact_rows, chunk_size=C, device=DEVICE)
    leaves = [t.requires_grad_(True) for t in inputs(plan2.compact_rows, seed=10)]

    def step():
        o = tree_gated_delta_rule(*leaves, scale=0.3, plan=plan, use_qk_l2norm=True)
        return torch.autograd.grad(o, leaves, torch.ones_like(o))
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_bad_plans_are_named():
    ok = dict(cu_seqlens=np.array([0, 4]), row_src=np.arange(4), own_rows=np.arange(4), own_dst=np.arange(4),
              init_state=np.array([-1]), export_seq=np.zeros(0, np.int64), export_offset=np.zeros(0, np.int64),
              export_bank=np.zeros(0, np.int64))
    with pytest.raises(ValueError, match=r"rounds\[0\].init_state must hold a bank id or -1"):
        plan_tree_gdn([TreeRoundSpec(**{**ok, "init_state": np.array([-2])})], 4)
    with pytest.raises(ValueError, match=r"rounds\[0\].init_state: bank id 3"):
        plan_tree_gdn([TreeRoundSpec(**{**ok, "init_state": np.array([3])})], 4)
    with pytest.raises(ValueError, match=r"rounds\[0\]: `export_offset\[0\]`=3"):
        plan_tree_gdn([TreeRoundSpec(**{**ok, "export_seq": np.array([0]), "export_offset": np.array([3]),
                                        "export_bank": np.array([0])})], 4)
    with pytest.raises(ValueError, match="token 3 is kept by no round"):
        plan_tree_gdn([TreeRoundSpec(**{**ok, "own_rows": np.arange(3), "own_dst": np.arange(3)})], 4)
    with pytest.raises(ValueError, match=r"rounds\[0\].row_src"):
        plan_tree_gdn([TreeRoundSpec(**{**ok, "row_src": np.array([0, 1, 2, 9])})], 4)
    exported = {**ok, "export_seq": np.array([0]), "export_offset": np.array([64]), "export_bank": np.array([2])}
    long = {**exported, "cu_seqlens": np.array([0, 64]), "row_src": np.arange(64), "own_rows": np.arange(64),
            "own_dst": np.arange(64)}
    again = {**ok, "cu_seqlens": np.array([0, 0]), "row_src": np.zeros(0, np.int64), "own_rows": np.zeros(0, np.int64),
             "own_dst": np.zeros(0, np.int64), "export_seq": np.zeros(0, np.int64)}
    # a zero-length sequence cannot export
    with pytest.raises(ValueError, match=r"rounds\[1\]: `export_offset\[0\]`=64"):
        plan_tree_gdn([TreeRoundSpec(**long), TreeRoundSpec(**{**again, "export_seq": np.array([0]),
                                                               "export_offset": np.array([64]),
                                                               "export_bank": np.array([2])})], 64)
    with pytest.raises(ValueError, match="export_bank id -1"):
        plan_tree_gdn([TreeRoundSpec(**{**long, "export_bank": np.array([-1])})], 64)
    with pytest.raises(ValueError, match="chunk_size 64 built in"):
        plan_tree_gdn([TreeRoundSpec(**ok)], 4, chunk_size=32)
    with pytest.raises(ValueError, match=r"rounds\[0\].cu_seqlens must be 1-D"):
        plan_tree_gdn([TreeRoundSpec(**{**ok, "cu_seqlens": np.array([[0, 4]])})], 4)
    plan = plan_tree_gdn([TreeRoundSpec(**ok)], 4, device=DEVICE)
    with pytest.raises(ValueError, match="plan was built for 4 tokens"):
        tree_gated_delta_rule(*inputs(5, 0), scale=1.0, plan=plan)


def test_a_bank_id_names_one_state():
    """Two rounds exporting different states under one bank id: rejected (a later start would be ambiguous)."""
    first = TreeRoundSpec(cu_seqlens=np.array([0, 128]), row_src=np.arange(128), own_rows=np.arange(128),
                          own_dst=np.arange(128), init_state=np.array([-1]), export_seq=np.array([0]),
                          export_offset=np.array([64]), export_bank=np.array([5]))
    second = TreeRoundSpec(cu_seqlens=np.array([0, 64]), row_src=np.arange(128, 192), own_rows=np.arange(64),
                           own_dst=np.arange(128, 192), init_state=np.array([5]), export_seq=np.array([0]),
                           export_offset=np.array([64]), export_bank=np.array([5]))
    with pytest.raises(ValueError, match="export_bank id 5 .* already names another exported state"):
        plan_tree_gdn([first, second], 192)


def test_rounds_fall_back_where_the_kernels_do_not_run():
    """A plan with the tree Function attached still runs fp64 inputs, through the reference per round."""
    batch = batches()["branch_on_chunk_boundary"]
    index = naive_tree_index(batch, chunk_size=C)
    plan = plan_linear_rounds(index, use_triton=False)
    fused = dataclasses.replace(plan, tree=plan_tree_gdn(tree_round_specs(index), index.num_tokens, chunk_size=C))
    tensors = [t.double().cpu() for t in inputs(index.num_tokens, seed=2)]
    kw = dict(scale=0.25, state_dtype=torch.float64, use_qk_l2norm=True)
    torch.testing.assert_close(gated_delta_rule_rounds(*tensors, index, fused, **kw),
                               gated_delta_rule_rounds(*tensors, index, plan, **kw), rtol=0, atol=0)


def test_without_cuda_or_the_interpreter_the_error_says_so(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    plan = plan_tree_gdn([TreeRoundSpec(cu_seqlens=np.array([0, 4]), row_src=np.arange(4), own_rows=np.arange(4),
                                        own_dst=np.arange(4), init_state=np.array([-1]),
                                        export_seq=np.zeros(0, np.int64), export_offset=np.zeros(0, np.int64),
                                        export_bank=np.zeros(0, np.int64))], 4)
    with pytest.raises(ValueError, match="need CUDA or TRITON_INTERPRET=1"):
        tree_gated_delta_rule(*[t.cpu() for t in inputs(4, 0)], scale=1.0, plan=plan)
