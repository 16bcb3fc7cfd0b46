"""Gated DeltaNet against FlashQLA and fla 0.6.0 on the H200: trajectory-wise fwd+bwd, errors, and tree mode.

Three sections, every number from one run on the same inputs (bf16, K = V = 128, l2norm in the kernel, initial
states given and differentiated):
1. errors of each kernel against the fp32 reference (relative Frobenius, on every output and gradient), on the
   first sequences of each case (up to 16k tokens: the reference runs chunk by chunk);
2. fwd+bwd ms of ours, fla (its own kernels: FLA_FLASH_QLA=0) and FlashQLA on five trajectory-wise cases, with
   our speed relative to FlashQLA's;
3. tree mode: our fused rounds (every round in one autograd Function, as the runtime runs it) against rounds over
   FlashQLA calls (one varlen call for the roots with final states, one for the branches starting from them: what
   a framework builds from a public kernel), both against the fastest trajectory-wise kernel.

Needs CUDA, flash-qla 0.1.3 and optionally fla-core 0.6.0. TileLang compiles FlashQLA's kernels on their first
call at each head layout: on an H200 (TileLang 0.1.15) about a minute each for the H16/16 and H16/32 cases, after
which the other cases, the trees and the errors reuse them; with --no-fla, five runs that split the whole
benchmark between them took about 8 minutes together there.
`--cases` and the `--skip-*` flags split it into shorter runs:

    PYTHONUNBUFFERED=1 python bench/gdn_flashqla.py [--cases 0 2] [--skip-errors] [--skip-trees] [--profile] \
        2>&1 | tee $OUT/gdn_flashqla.log

--profile prints, per case, each kernel's GPU ms per kernel it launches (where FlashQLA's time goes
against ours). --no-fla leaves fla out (its autotuning adds a minute or more per case). --variants NAME ... adds
our kernels under other launch configurations (bench/gdn_cases.py) to sections 1-2, beside the default.
TileLang keeps its compiled kernels under TILELANG_CACHE_DIR (default ~/.tilelang/cache): pointing that at a saved
directory skips the compilation on a fresh machine.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from anchors import fla_single_call, import_flashqla, single_call  # noqa: E402
from common import kernel_ms, rel_error  # noqa: E402
from gdn import GRAD_NAMES  # noqa: E402
from gdn_cases import ANCHORS, CONFIG_VARIANTS, agentic_trees, make_inputs, single_call_plan, tree_case  # noqa: E402
from gdn_profile import device_ms_by_kernel, print_kernels  # noqa: E402
from harts_compiler.codegen.kernels.chunk_gdn import (  # noqa: E402
    GDNKernelConfig,
    chunk_gated_delta_rule_reference,
    gated_delta_rule,
)

CUDA = torch.device("cuda")
# (name, trajectory lengths, key heads, value heads): the cases FlashQLA is compared on
CASES = [
    ("8 x 7,680 H16/16", [7680] * 8, 16, 16),
    ("agentic 42 seqs H16/32", None, 16, 32),  # the trajectories of gdn_cases.agentic_trees()
    ("1 x 32,768 H16/32", [32768], 16, 32),
    ("64 x 1,024 H16/32", [1024] * 64, 16, 32),
    ("4 x 16,384 H16/32", [16384] * 4, 16, 32),
]
ERROR_TOKENS = 16384


def ours_call(plan):
    def call(q, k, v, g, beta, *, scale, initial_state, use_qk_l2norm=False, **_):
        return gated_delta_rule(q, k, v, g, beta, scale=scale, plan=plan, initial_states=initial_state,
                                use_qk_l2norm=use_qk_l2norm)
    return call


def case_lengths(lengths):
    return lengths if lengths is not None else [p + n for p, b, n in agentic_trees() for _ in range(b)]


def fwd_bwd_all(fn, tensors, cu, seed=1):
    """Outputs and the gradients of q, k, v, g, beta, h0 for a random output gradient."""
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    o = fn(*leaves[:5], scale=leaves[0].shape[-1] ** -0.5, initial_state=leaves[5], cu_seqlens=cu,
           use_qk_l2norm=True)[0]
    do = torch.randn(o.shape, device=o.device, generator=torch.Generator(o.device).manual_seed(seed)).to(o.dtype)
    return {"o": o, **dict(zip(GRAD_NAMES, torch.autograd.grad(o, leaves, do)))}


def error_section(kernels) -> dict:
    print(f"\n== errors vs the fp32 reference (relative Frobenius; first sequences up to {ERROR_TOKENS} tokens) ==")
    print(f"{'case':24s} {'tensor':6s} " + " ".join(f"{name:>9s}" for name in kernels))
    worst = {name: 0.0 for name in kernels}  # worst ratio of each kernel's error to the best other kernel's
    for name, lengths, hk, hv in CASES:
        lengths = case_lengths(lengths)
        keep = max(1, sum(1 for total in torch.tensor(lengths).cumsum(0).tolist() if total <= ERROR_TOKENS))
        tensors, cu = make_inputs(lengths[:keep], hk=hk, hv=hv, seed=3)
        ref = fwd_bwd_all(chunk_gated_delta_rule_reference, [t.float() for t in tensors], cu)
        runs = {k: fwd_bwd_all(fn(cu), tensors, cu) for k, fn in kernels.items()}
        for key in ["o"] + GRAD_NAMES:
            errors = {k: rel_error(run[key], ref[key]) for k, run in runs.items()}
            print(f"{name:24s} {key:6s} " + " ".join(f"{errors[k]:9.2e}" for k in kernels))
            for k in kernels:
                others = [e for other, e in errors.items() if other != k]
                if others:
                    worst[k] = max(worst[k], errors[k] / max(min(others), 1e-12))
        del ref, runs
        torch.cuda.empty_cache()
    print("worst error / best other kernel's error: " + ", ".join(f"{k} {v:.2f}" for k, v in worst.items()))
    return worst


def timing_section(kernels, profile=False) -> list[dict]:
    """fwd+bwd ms of each kernel per case; with `profile` also each one's GPU ms per kernel launched."""
    print("\n== trajectory-wise fwd+bwd ms (do_bench median) ==")
    print(f"{'case':24s} {'tokens':>7s} " + " ".join(f"{name:>9s}" for name in kernels) + f" {'ours/FQ speed':>13s}")
    rows = []
    for name, lengths, hk, hv in CASES:
        lengths = case_lengths(lengths)
        tensors, cu = make_inputs(lengths, hk=hk, hv=hv, seed=5)
        leaves = [t.detach().requires_grad_(True) for t in tensors]
        do = torch.randn_like(tensors[2])
        ms = {}
        for k, make in kernels.items():
            fn = make(cu)

            def step(fn=fn, leaves=leaves, cu=cu, do=do):
                o = fn(*leaves[:5], scale=128 ** -0.5, initial_state=leaves[5], cu_seqlens=cu, use_qk_l2norm=True)[0]
                torch.autograd.grad(o, leaves, do)
            ms[k] = kernel_ms(step, CUDA, rep_ms=300, warmup_ms=50)
            if profile:
                print_kernels(k, device_ms_by_kernel(step)[0])
        ratio = ms["flashqla"] / ms["ours"] if "flashqla" in ms else float("nan")
        rows.append(dict(case=name, tokens=sum(lengths), **ms, ours_vs_flashqla=ratio))
        print(f"{name:24s} {sum(lengths):7d} " + " ".join(f"{ms[k]:9.2f}" for k in kernels) + f" {ratio:12.2f}x")
        del tensors, leaves
        torch.cuda.empty_cache()
    return rows


def flashqla_rounds(flashqla, trees, scale):
    """Tree mode over public-kernel calls: roots in one varlen call (final states), branches in a second one
    starting from their root's final state; outputs back in compact order (root, branches, tree after tree)."""
    root_rows, branch_rows, branch_tree, root_len, branch_len = [], [], [], [], []
    cursor = 0
    for t, (P, B, L) in enumerate(trees):
        root_rows += range(cursor, cursor + P)
        root_len.append(P)
        cursor += P
        for _ in range(B):
            branch_rows += range(cursor, cursor + L)
            branch_len.append(L)
            branch_tree.append(t)
            cursor += L

    def cu(lengths):
        return torch.tensor([0] + lengths, device=CUDA).cumsum(0)
    root_idx, branch_idx = torch.tensor(root_rows, device=CUDA), torch.tensor(branch_rows, device=CUDA)
    order = torch.cat([root_idx, branch_idx]).argsort()
    root_cu, branch_cu, tree_of = cu(root_len), cu(branch_len), torch.tensor(branch_tree, device=CUDA)

    def run(q, k, v, g, beta):
        zero = q.new_zeros(len(root_len), v.shape[1], q.shape[-1], v.shape[-1], dtype=torch.float32)
        pick = [x.index_select(0, root_idx) for x in (q, k, v, g, beta)]
        o_root, final = flashqla(*pick, scale=scale, initial_state=zero, cu_seqlens=root_cu, use_qk_l2norm=True,
                                 output_final_state=True)
        pick = [x.index_select(0, branch_idx) for x in (q, k, v, g, beta)]
        o_branch, _ = flashqla(*pick, scale=scale, initial_state=final.index_select(0, tree_of).float(),
                               cu_seqlens=branch_cu, use_qk_l2norm=True)
        return torch.cat([o_root, o_branch]).index_select(0, order)
    return run


def tree_section(flashqla) -> list[dict]:
    print("\n== tree mode fwd+bwd ms: fused rounds (ours) vs rounds over FlashQLA calls ==")
    print(f"{'trees':24s} {'ideal':>6s} {'traj ours':>9s} {'traj FQ':>8s} {'tree ours':>9s} {'of ideal':>8s} "
          f"{'FQ rounds':>9s} {'of ideal':>8s} {'ours/FQ rounds':>14s}")
    cases = [(f"P{p} B{b} L{n}", [(p, b, n)]) for p, b, n in ANCHORS] + [("6 agentic trees", agentic_trees())]
    rows = []
    for name, trees in cases:
        case = tree_case(trees, GDNKernelConfig())
        plan, do_tree, do_traj = case.plan, case.do_tree, case.do_traj

        def timed(fn, leaves, do):
            return kernel_ms(lambda: torch.autograd.grad(fn(*leaves), leaves, do), CUDA, rep_ms=300, warmup_ms=50)
        t_traj = timed(case.ours_traj, case.traj, do_traj)
        t_tree = timed(case.ours_tree, case.compact, do_tree)
        t_fq_traj = t_fq_rounds = float("nan")
        if flashqla is not None:
            def fq_traj(q, k, v, g, beta, scale=case.scale, h0=case.h0, cu=plan.traj_cu):
                return flashqla(q, k, v, g, beta, scale=scale, initial_state=h0, cu_seqlens=cu, use_qk_l2norm=True)[0]
            t_fq_traj = timed(fq_traj, case.traj, do_traj)
            t_fq_rounds = timed(flashqla_rounds(flashqla, trees, case.scale), case.compact, do_tree)
        best_traj = min(t for t in (t_traj, t_fq_traj) if t == t)
        row = dict(case=name, ideal=plan.ideal_speedup, traj_ours_ms=t_traj, traj_flashqla_ms=t_fq_traj,
                   tree_ours_ms=t_tree, tree_of_ideal=best_traj / t_tree / plan.ideal_speedup,
                   flashqla_rounds_ms=t_fq_rounds,
                   flashqla_rounds_of_ideal=best_traj / t_fq_rounds / plan.ideal_speedup)
        rows.append(row)
        print(f"{name:24s} {plan.ideal_speedup:5.2f}x {t_traj:9.2f} {t_fq_traj:8.2f} {t_tree:9.2f} "
              f"{row['tree_of_ideal']:7.0%} {t_fq_rounds:9.2f} {row['flashqla_rounds_of_ideal']:7.0%} "
              f"{t_fq_rounds / t_tree:13.2f}x")
        del case
        torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-errors", action="store_true", help="leave out section 1")
    parser.add_argument("--skip-trees", action="store_true", help="leave out section 3")
    parser.add_argument("--cases", type=int, nargs="+", help="indices into CASES for sections 1-2 (default: all)")
    parser.add_argument("--profile", action="store_true", help="section 2 also prints GPU ms per kernel of each")
    parser.add_argument("--no-fla", action="store_true", help="leave fla out (saves its autotuning)")
    parser.add_argument("--variants", nargs="+", default=[], choices=sorted(CONFIG_VARIANTS),
                        help="also our kernels under these launch configurations (gdn_cases.CONFIG_VARIANTS), "
                             "in sections 1-2")
    args = parser.parse_args()
    if args.cases:
        CASES[:] = [CASES[i] for i in args.cases]
    flashqla, fla = single_call(import_flashqla()), None if args.no_fla else fla_single_call("gdn")
    kernels = {"ours": lambda cu: ours_call(single_call_plan(cu, device=CUDA))}
    for name in args.variants:
        config = CONFIG_VARIANTS[name][1]
        kernels[name] = lambda cu, config=config: ours_call(single_call_plan(cu, config=config, device=CUDA))
    if fla is not None:
        kernels["fla"] = lambda cu: fla
    if flashqla is not None:
        kernels["flashqla"] = lambda cu: flashqla
    worst = None if args.skip_errors else error_section(kernels)
    rows = timing_section(kernels, profile=args.profile)
    trees = [] if args.skip_trees else tree_section(flashqla)
    print("\n== summary ==")
    for row in rows:
        print(f"{row['case']:24s} ours {row['ours']:7.2f} ms, FlashQLA {row.get('flashqla', float('nan')):7.2f} ms: "
              f"ours at {row['ours_vs_flashqla']:.2f}x FlashQLA's speed")
    for row in trees:
        print(f"{row['case']:24s} tree ours {row['tree_of_ideal']:.0%} of ideal, FlashQLA rounds "
              f"{row['flashqla_rounds_of_ideal']:.0%}")
    if worst:
        print("worst error ratio vs the best other kernel: " + ", ".join(f"{k} {v:.2f}" for k, v in worst.items()))


if __name__ == "__main__":
    main()
