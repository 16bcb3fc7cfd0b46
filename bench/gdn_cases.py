"""Inputs, tree cases and config variants shared by the GDN benchmarks (bench/gdn*.py)."""
from __future__ import annotations

import random
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from harts_compiler.codegen.kernels.chunk_gdn import GDNKernelConfig, gated_delta_rule, plan_single_call, plan_tree_gdn
from harts_compiler.codegen.kernels.upload import to_device

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))  # fixtures, offline tools
from two_level import run_tree, two_level_plan, two_level_round_specs  # noqa: E402


# launch configurations the GDN benches time against the default (short name -> label, config): bench/gdn.py
# --variants (by label words), bench/gdn_batch.py --compare (by name), bench/gdn_kernels.py (2-warp scans)
CONFIG_VARIANTS: dict[str, tuple[str, GDNKernelConfig]] = {
    "scans_2w": ("scans 2 warps, 32 columns, 2 stages (16 below 264 programs)",
                 GDNKernelConfig(scan_block_v=32, scan_warps=2, scan_num_stages=2, scan_min_programs=264)),
    "scans_2st": ("scans 2 stages", GDNKernelConfig(scan_num_stages=2)),
    "scans_256": ("scans at least 256 programs", GDNKernelConfig(scan_min_programs=256)),
    "one_lane": ("one scan launch per round", GDNKernelConfig(tree_scan_lanes=1)),
    "pointers": ("scans load through pointers only (no TMA)", GDNKernelConfig(scan_tma_max_block_v=0)),
    "tma_wide": ("TMA scans at 64 columns too", GDNKernelConfig(scan_tma_max_block_v=64)),
    "qdo_bf16": ("backward scan q^T do in bf16 always", GDNKernelConfig(scan_q_do_precision="bf16")),
    "qdo_bf16x2": ("backward scan q^T do as bf16 hi + lo always", GDNKernelConfig(scan_q_do_precision="bf16x2")),
    # which backward scans form dv_local themselves (GDNKernelConfig.scan_local_dv_min_chunks; default 8 chunks)
    "dv_buffer": ("every backward scan reads dv_local's A^T from the buffer",
                  GDNKernelConfig(scan_local_dv_min_chunks=1 << 30)),
    "dv_min0": ("full-width backward scans form dv_local at any length", GDNKernelConfig(scan_local_dv_min_chunks=0)),
    "dv_min4": ("full-width backward scans form dv_local from 4 chunks", GDNKernelConfig(scan_local_dv_min_chunks=4)),
    "dv_min16": ("full-width backward scans form dv_local from 16 chunks",
                 GDNKernelConfig(scan_local_dv_min_chunks=16)),
}


# the benchmarks' anchor trees (P, B, L): a root of P tokens and B branches of L tokens each
ANCHORS = [(4096, 8, 3584), (16384, 8, 2048), (2048, 16, 1920)]


def tree_cases(only: list[str] | None = None) -> list[tuple[str, list]]:
    """(name, trees) of the anchors and the agentic batch, those whose names contain a word of `only`."""
    cases = [(f"P{p} B{b} L{l}", [(p, b, l)]) for p, b, l in ANCHORS] + [("agentic 6 trees", agentic_trees())]
    return [case for case in cases if not only or any(word in case[0] for word in only)]


def tree_batch(trees: list[tuple[int, int, int]], seed: int = 0, vocab_size: int = 32000):
    """The two-level trees (P, B, L) as a rollout batch for the compiler: per tree B trajectories that share P
    root tokens, then L tokens of their own. First tokens are distinct per tree and per branch, so the prefix
    forest has exactly these trees, each branching at P."""
    from harts_compiler import TreeBatch
    rng = np.random.default_rng(seed)
    trajectories = []
    for t, (prefix, branches, length) in enumerate(trees):
        root = rng.integers(len(trees), vocab_size, prefix)
        root[0] = t
        for j in range(branches):
            own = rng.integers(branches, vocab_size, length)
            own[0] = j
            trajectories.append(np.concatenate([root, own]))
    return TreeBatch.from_trajectories(trajectories)


def agentic_trees(count: int = 6, seed: int = 0) -> list[tuple[int, int, int]]:
    """The benchmarks' random agentic batch: (P, B, L) per tree with P in [256, 6000], B in [2, 12],
    L in [100, 3000] (bench/gdn.py's "agentic 6 trees")."""
    rng = random.Random(seed)
    return [(rng.randint(256, 6000), rng.randint(2, 12), rng.randint(100, 3000)) for _ in range(count)]


def make_inputs(lengths, hk=16, hv=16, kd=128, vd=128, seed=0, dtype=torch.bfloat16, device="cuda"):
    """Random inputs with Qwen3-Next-like gates: g = -exp(A) * dt, A in [0, 2.8], dt in [1e-3, 0.1]."""
    gen = torch.Generator(device).manual_seed(seed)
    rows = sum(lengths)

    def rand(*shape):
        return torch.rand(*shape, device=device, generator=gen)

    q = torch.randn(rows, hk, kd, device=device, generator=gen).to(dtype)
    k = torch.randn(rows, hk, kd, device=device, generator=gen).to(dtype)
    v = torch.randn(rows, hv, vd, device=device, generator=gen).to(dtype)
    g = -(rand(rows, hv) * 2.8).exp() * (rand(rows, hv) * 0.099 + 0.001)
    beta = torch.sigmoid(torch.randn(rows, hv, device=device, generator=gen)).to(dtype)
    h0 = torch.randn(len(lengths), hv, kd, vd, device=device, generator=gen) * 0.05
    cu = torch.tensor([0] + list(lengths), device=device).cumsum(0).to(torch.int32)
    return [q, k, v, g, beta, h0], cu


def single_call_plan(cu_seqlens, export_seq=(), export_offset=(), *, config: GDNKernelConfig | None = None,
                     device="cuda"):
    """The device plan of one packed varlen call (sequence i starts from initial state i, the exports are
    returned), built on the host once: timed loops call `gated_delta_rule` with it, where
    `chunk_gated_delta_rule` would read `cu_seqlens` and plan on every call."""
    host = [np.asarray(torch.as_tensor(x).cpu(), dtype=np.int64).reshape(-1) for x in (cu_seqlens, export_seq,
                                                                                      export_offset)]
    return to_device(plan_single_call(np.diff(host[0]), host[1], host[2], config=config), device)


def planned_call(q, k, v, g, beta, *, scale, initial_state, plan, use_qk_l2norm=False, **_):
    """`chunk_gated_delta_rule`'s call on a `single_call_plan`: the plan holds the sequences and exports, so
    the `cu_seqlens` / `export_seq` / `export_offset` a caller such as two_level.run_tree passes are not read."""
    return gated_delta_rule(q, k, v, g, beta, scale=scale, plan=plan, initial_states=initial_state,
                            use_qk_l2norm=use_qk_l2norm)


def tree_case(trees, config: GDNKernelConfig, seed: int = 11, device="cuda") -> SimpleNamespace:
    """Two-level trees (P, B, L) on the GPU at H = 16, K = V = 128, bf16: compact and trajectory leaves,
    output gradients, and the three callables over them -- trajectory-wise, tree (every round in one
    Function, tree.py, as the runtime runs it), and tree as one single-call plan per round with autograd
    gathers between them -- with every plan built and uploaded here, outside the timed calls."""
    plan = two_level_plan(list(trees), device=device)
    tensors, _ = make_inputs([plan.compact_rows], seed=seed, device=device)
    compact = [t.detach().requires_grad_(True) for t in tensors[:5]]
    traj = [t.detach()[plan.traj_rows].contiguous().requires_grad_(True) for t in tensors[:5]]
    h0 = torch.zeros(plan.traj_cu.numel() - 1, 16, 128, 128, device=device)
    scale = 128 ** -0.5
    traj_plan = single_call_plan(plan.traj_cu, config=config, device=device)
    root_plan = single_call_plan(plan.root_cu, plan.root_export_seq, plan.root_export_offset, config=config,
                                 device=device)
    branch_plan = single_call_plan(plan.branch_cu, config=config, device=device)
    tree_plan = to_device(plan_tree_gdn(two_level_round_specs(plan), plan.compact_rows, config=config), device)

    def ours_traj(q, k, v, g, beta):
        return gated_delta_rule(q, k, v, g, beta, scale=scale, plan=traj_plan, initial_states=h0,
                                use_qk_l2norm=True)[0]

    def ours_tree(q, k, v, g, beta):
        return gated_delta_rule(q, k, v, g, beta, scale=scale, plan=tree_plan, use_qk_l2norm=True)[0]

    def ours_tree_rounds(q, k, v, g, beta):
        return run_tree(planned_call, plan, q, k, v, g, beta, scale=scale,
                        root_kw=dict(use_qk_l2norm=True, plan=root_plan),
                        branch_kw=dict(use_qk_l2norm=True, plan=branch_plan))

    return SimpleNamespace(
        plan=plan, compact=compact, traj=traj, h0=h0, scale=scale,
        do_traj=torch.randn(plan.trajectory_tokens, 16, 128, device=device).bfloat16(),
        do_tree=torch.randn(plan.compact_rows, 16, 128, device=device).bfloat16(),
        ours_traj=ours_traj, ours_tree=ours_tree, ours_tree_rounds=ours_tree_rounds)
