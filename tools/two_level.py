"""Two-round execution of two-level trees (a root of P tokens, B branches) for kernel tests and benchmarks.

A test/benchmark fixture, outside the installed package: tests import it as `two_level` (tests/conftest.py
puts tools/ on sys.path), bench scripts after putting tools/ on sys.path.

Not the compiler's planner: a hand-made plan for the benchmarks' anchor trees ("P4096 B8 L3584"), following
docs/design.md section 6. Round 0 runs every root as one sequence and exports its state at the aligned
boundary b = floor(P / C) * C; round 1 runs every branch as a sequence that starts at b, replays the
root rows [b, P) and then its own rows, from the exported state. Trajectory mode runs each
root + branch as its own sequence. Inputs live on compact rows (every root and branch token once).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from harts_compiler.codegen.index import LinearRound


@dataclass
class TwoLevelPlan:
    compact_rows: int
    traj_rows: torch.Tensor          # [sum(P + L)] compact row of every trajectory row
    traj_cu: torch.Tensor            # [n_traj + 1] int32
    root_rows: torch.Tensor          # round 0 rows (compact)
    root_cu: torch.Tensor
    root_export_seq: torch.Tensor    # one export per tree with b > 0
    root_export_offset: torch.Tensor
    branch_rows: torch.Tensor        # round 1 rows (compact, replayed root rows included)
    branch_cu: torch.Tensor
    branch_init: list[int]           # per branch: index into round 0's exports, -1 = zero state
    branch_own: torch.Tensor         # round 1 packed rows whose outputs are kept ...
    branch_own_dst: torch.Tensor     # ... and the compact rows they are

    @property
    def trajectory_tokens(self) -> int:
        return int(self.traj_rows.numel())

    @property
    def ideal_speedup(self) -> float:
        return self.trajectory_tokens / self.compact_rows


def two_level_plan(trees: list[tuple[int, int, int]], chunk_size: int = 64, device="cpu") -> TwoLevelPlan:
    """trees: (P, B, L) per tree, laid out root then branches, tree after tree."""
    traj_rows, traj_len = [], []
    root_rows, root_len, exp_seq, exp_off = [], [], [], []
    branch_rows, branch_len, branch_init, own, own_dst = [], [], [], [], []
    cursor = 0
    for t, (P, B, L) in enumerate(trees):
        root = list(range(cursor, cursor + P))
        cursor += P
        b = (P // chunk_size) * chunk_size
        root_rows += root
        root_len.append(P)
        export = -1
        if b > 0:
            export = len(exp_seq)
            exp_seq.append(t)
            exp_off.append(b)
        for _ in range(B):
            branch = list(range(cursor, cursor + L))
            cursor += L
            traj_rows += root + branch
            traj_len.append(P + L)
            start = len(branch_rows)
            replay = root[b:]
            branch_rows += replay + branch
            branch_len.append(len(replay) + L)
            branch_init.append(export)
            own += range(start + len(replay), start + len(replay) + L)
            own_dst += branch

    def long(x):
        return torch.tensor(x, dtype=torch.int64, device=device)

    def cu(lengths):
        return torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)

    return TwoLevelPlan(
        compact_rows=cursor, traj_rows=long(traj_rows), traj_cu=cu(traj_len), root_rows=long(root_rows),
        root_cu=cu(root_len), root_export_seq=long(exp_seq), root_export_offset=long(exp_off),
        branch_rows=long(branch_rows), branch_cu=cu(branch_len), branch_init=branch_init, branch_own=long(own),
        branch_own_dst=long(own_dst))


def run_trajectories(fn, plan: TwoLevelPlan, q, k, v, g, beta, *, scale, **kw):
    """Every root + branch as its own sequence from a zero state; returns o on trajectory rows."""
    rows = plan.traj_rows
    n = plan.traj_cu.numel() - 1
    h0 = torch.zeros(n, v.shape[1], k.shape[2], v.shape[2], device=v.device, dtype=torch.float32)
    o, _ = fn(q[rows], k[rows], v[rows], g[rows], beta[rows], scale=scale, initial_state=h0,
              cu_seqlens=plan.traj_cu, **kw)
    return o


def run_tree(fn, plan: TwoLevelPlan, q, k, v, g, beta, *, scale, root_kw=None, branch_kw=None, **kw):
    """Two rounds; returns o on compact rows (replayed rows' outputs dropped, their gradients flow back)."""
    hv, kd, vd = v.shape[1], k.shape[2], v.shape[2]
    r = plan.root_rows
    h0 = torch.zeros(plan.root_cu.numel() - 1, hv, kd, vd, device=v.device, dtype=torch.float32)
    o_root, states = fn(q[r], k[r], v[r], g[r], beta[r], scale=scale, initial_state=h0, cu_seqlens=plan.root_cu,
                        export_seq=plan.root_export_seq, export_offset=plan.root_export_offset, **(root_kw or kw))
    zero = torch.zeros(1, hv, kd, vd, device=v.device, dtype=torch.float32)
    bank = torch.cat([states, zero])  # -1 picks the zero row
    init = bank[torch.tensor(plan.branch_init, device=v.device)]
    r = plan.branch_rows
    o_branch, _ = fn(q[r], k[r], v[r], g[r], beta[r], scale=scale, initial_state=init, cu_seqlens=plan.branch_cu,
                     **(branch_kw or kw))
    o = o_root.new_empty((plan.compact_rows,) + o_root.shape[1:])
    o = o.index_copy(0, plan.root_rows, o_root)
    return o.index_copy(0, plan.branch_own_dst, o_branch[plan.branch_own])


def two_level_round_specs(plan: TwoLevelPlan) -> list[LinearRound]:
    """The plan's two rounds for `chunk_gdn.plan_tree_gdn` (bank id e = round 0's export e)."""
    def host(t):
        return t.cpu().numpy().astype(np.int64)
    n_exports = plan.root_export_seq.numel()
    roots = host(plan.root_rows)
    none = np.zeros(0, np.int64)
    return [LinearRound(cu_seqlens=host(plan.root_cu), row_src=roots, own_rows=np.arange(roots.size),
                          own_dst=roots, init_state=np.full(plan.root_cu.numel() - 1, -1),
                          export_seq=host(plan.root_export_seq), export_offset=host(plan.root_export_offset),
                          export_bank=np.arange(n_exports)),
            LinearRound(cu_seqlens=host(plan.branch_cu), row_src=host(plan.branch_rows),
                          own_rows=host(plan.branch_own), own_dst=host(plan.branch_own_dst),
                          init_state=np.asarray(plan.branch_init, dtype=np.int64), export_seq=none,
                          export_offset=none, export_bank=none)]
