"""Gated DeltaNet kernels on the H200: correctness vs the fp32 reference and fla 0.6.0, tree == trajectory
bitwise, and fwd+bwd timings (trajectory-wise ours vs fla; tree vs trajectory-wise on the anchor trees of
gdn_cases.ANCHORS and the agentic batch).

    PYTHONUNBUFFERED=1 python bench/gdn.py [--skip-check] [--variants] [--no-fla] [--out DIR] 2>&1 | tee $OUT/gdn.log

(do not pipe through grep: it holds the output back until the end). Prints one table per section (a
per-kernel profile of tree vs trajectory-wise from bench/gdn_profile.py among them); the
last lines are the summary. Needs CUDA (fla optional). Compiling our kernels and autotuning fla's on their first
call takes 2-3 minutes before the first numbers; a whole run takes at least 6 minutes (with --variants, 9).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))  # fixtures, offline tools
from anchors import fla_single_call  # noqa: E402
from common import kernel_ms, rel_error  # noqa: E402
from gdn_cases import CONFIG_VARIANTS, make_inputs, single_call_plan, tree_case, tree_cases  # noqa: E402
from gdn_profile import profile_section, timeline_section  # noqa: E402
from harts_compiler.codegen.kernels.chunk_gdn import (  # noqa: E402
    GDNKernelConfig,
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_reference,
    gated_delta_rule,
    plan_tree_gdn,
    prepare_gdn_index,
)
from harts_compiler.codegen.kernels.upload import to_device  # noqa: E402
from two_level import run_trajectories, run_tree, two_level_plan, two_level_round_specs  # noqa: E402

CUDA = torch.device("cuda")
GRAD_NAMES = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]


def fwd_bwd(fn, tensors, cu, seed=1, exports=None, d_exported=True, **kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    q, k, v, g, beta, h0 = leaves
    exports = exports or {}
    o, states = fn(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=h0, cu_seqlens=cu,
                   use_qk_l2norm=True, **exports, **kw)
    gen = torch.Generator(q.device).manual_seed(seed)
    do = torch.randn(o.shape, device=q.device, generator=gen).to(o.dtype)
    loss = (o.float() * do.float()).sum()
    if exports and d_exported:
        loss = loss + (states * torch.randn(states.shape, device=q.device, generator=gen)).sum()
    grads = torch.autograd.grad(loss, leaves)
    return {"o": o, "exported": states if exports else None, **dict(zip(GRAD_NAMES, grads))}


def check_against_reference(fla, log, config=None, only_exports=False, label="default"):
    print(f"\n== correctness: bf16 kernels vs fp32 reference (relative Frobenius error) [{label}] ==")
    # the fla-signature wrapper plans each call on the host: fine here, nothing is timed
    ours_fn = functools.partial(chunk_gated_delta_rule, config=config or GDNKernelConfig())
    cases = [
        ("varlen 32k, H16", [12345, 1, 63, 64, 65, 3000, 8191, 4096, 4943], 16, 16, None),
        ("lone 32k, H16", [32768], 16, 16, None),
        ("exports+inject, HK8 HV16", [5000, 130, 2048, 777], 8, 16,
         dict(export_seq=torch.tensor([0, 0, 2, 2, 3, 0]),
              export_offset=torch.tensor([64, 4992, 2048, 1024, 768, 64]))),
    ]
    if only_exports:
        cases = cases[-1:]
    worst_ratio = 0.0
    all_ok = True
    for name, lengths, hk, hv, exports in cases:
        tensors, cu = make_inputs(lengths, hk=hk, hv=hv, seed=len(lengths))
        ref = fwd_bwd(chunk_gated_delta_rule_reference, [t.float() for t in tensors], cu, exports=exports)
        ours = fwd_bwd(ours_fn, tensors, cu, exports=exports)
        theirs = fwd_bwd(fla, tensors, cu) if fla is not None and exports is None else None
        for key in ["o", "exported"] + GRAD_NAMES:
            if ref[key] is None:
                continue
            e_ours = rel_error(ours[key], ref[key])
            e_fla = rel_error(theirs[key], ref[key]) if theirs is not None else float("nan")
            ok = e_ours < 2e-2 and bool(torch.isfinite(ours[key]).all())
            all_ok &= ok
            if theirs is not None:
                worst_ratio = max(worst_ratio, e_ours / max(e_fla, 1e-12))
            print(f"{name:26s} {key:9s} ours {e_ours:9.2e}  fla {e_fla:9.2e}  {'ok' if ok else 'FAIL'}")
            log.append(dict(section="check", config=label, case=name, tensor=key, ours=e_ours, fla=e_fla, ok=ok))
        del ref, ours, theirs
        torch.cuda.empty_cache()
    print(f"all within bound: {all_ok}; worst ours/fla error ratio: {worst_ratio:.2f}")
    return all_ok, worst_ratio


def check_tree_bitwise(log, config=None):
    print("\n== tree (two rounds, replay) vs trajectory-wise, same kernels ==")
    plan = two_level_plan([(1000, 4, 777), (64, 3, 100), (4096, 2, 300), (37, 2, 50), (130, 1, 64)], device="cuda")
    tensors, _ = make_inputs([plan.compact_rows], seed=7)
    leaves = [t.detach().requires_grad_(True) for t in tensors[:5]]
    kw = dict(scale=128 ** -0.5, use_qk_l2norm=True)
    config = config or GDNKernelConfig()
    fn = functools.partial(chunk_gated_delta_rule, config=config)  # plans each call on the host (not timed)

    o_traj = run_trajectories(fn, plan, *leaves, **kw)
    per_round_bitwise = torch.equal(o_traj, run_tree(fn, plan, *leaves, **kw)[plan.traj_rows])
    tree_plan = to_device(plan_tree_gdn(two_level_round_specs(plan), plan.compact_rows, config=config), CUDA)
    o_tree = gated_delta_rule(*leaves, plan=tree_plan, **kw)[0]
    bitwise = torch.equal(o_traj, o_tree[plan.traj_rows]) and per_round_bitwise
    do = torch.randn(o_traj.shape, device="cuda").to(o_traj.dtype)
    g_traj = torch.autograd.grad((o_traj.float() * do.float()).sum(), leaves)
    d_tree = torch.zeros(o_tree.shape, device="cuda", dtype=torch.float32).index_add_(0, plan.traj_rows, do.float())
    g_tree = torch.autograd.grad((o_tree.float() * d_tree).sum(), leaves)
    errs = {n: rel_error(a, b) for n, a, b in zip(["dq", "dk", "dv", "dg", "dbeta"], g_tree, g_traj)}
    print(f"outputs bitwise equal: {bitwise} (one call per round: {per_round_bitwise}); "
          "gradient rel diff tree vs traj: "
          + ", ".join(f"{n} {e:.1e}" for n, e in errs.items()))
    log.append(dict(section="tree_bitwise", bitwise=bitwise, grads=errs))
    return bitwise


def timed(fn, leaves, outputs_grad):
    def step():
        outs = fn(*leaves)
        torch.autograd.grad(outs, leaves, outputs_grad(outs))
    return kernel_ms(step, CUDA, rep_ms=300, warmup_ms=50)


# launch configurations timed with --variants, each against the default in the same run
VARIANTS = list(CONFIG_VARIANTS.items())


def bench_trees(fla, log, config: GDNKernelConfig, label: str, only: list[str] | None = None):
    """Tree mode as the runtime runs it (every round in one Function, tree.py), next to one single-call plan
    per round with autograd gathers between them ('per round')."""
    print(f"\n== fwd+bwd ms, bf16 H16 K=V=128, l2norm in kernel [{label}] ==")
    cases = tree_cases(only)
    print(f"{'case':18s} {'traj tok':>9s} {'compact':>8s} {'ideal':>6s} {'ours traj':>9s} {'fla traj':>9s} "
          f"{'fla/ours':>8s} {'ours tree':>9s} {'speedup':>7s} {'of ideal':>8s} {'per round':>9s} {'of ideal':>8s}"
          f" {'bitwise':>7s}")
    rows = []
    for name, trees in cases:
        case = tree_case(trees, config)
        plan, compact, traj, do_traj, do_tree = case.plan, case.compact, case.traj, case.do_traj, case.do_tree
        h0, scale = case.h0, case.scale
        t_traj = timed(case.ours_traj, traj, lambda o: do_traj)
        t_tree = timed(case.ours_tree, compact, lambda o: do_tree)
        t_rounds = timed(case.ours_tree_rounds, compact, lambda o: do_tree)
        with torch.no_grad():
            bitwise = torch.equal(case.ours_tree(*compact)[plan.traj_rows], case.ours_traj(*traj))
        t_fla = float("nan")
        if fla is not None:
            def fla_traj(q, k, v, g, beta):
                return fla(q, k, v, g, beta, scale=scale, initial_state=h0, cu_seqlens=plan.traj_cu,
                           use_qk_l2norm=True)[0]
            t_fla = timed(fla_traj, traj, lambda o: do_traj)
        speedup = t_traj / t_tree
        row = dict(case=name, config=label, traj_tokens=plan.trajectory_tokens, compact=plan.compact_rows,
                   ideal=plan.ideal_speedup, ours_traj_ms=t_traj, fla_traj_ms=t_fla, ours_tree_ms=t_tree,
                   speedup=speedup, of_ideal=speedup / plan.ideal_speedup, per_round_tree_ms=t_rounds,
                   per_round_of_ideal=t_traj / t_rounds / plan.ideal_speedup, tree_bitwise=bitwise)
        rows.append(row)
        log.append(dict(section="bench", **row))
        print(f"{name:18s} {plan.trajectory_tokens:9d} {plan.compact_rows:8d} {plan.ideal_speedup:5.2f}x "
              f"{t_traj:9.2f} {t_fla:9.2f} {t_fla / t_traj:7.2f}x {t_tree:9.2f} {speedup:6.2f}x {row['of_ideal']:7.0%}"
              f" {t_rounds:9.2f} {row['per_round_of_ideal']:7.0%} {str(bitwise):>7s}")
        del case, compact, traj
        torch.cuda.empty_cache()
    return rows


def stage_breakdown(fla, log, trees=((4096, 8, 3584),)):
    """Per-kernel fwd/bwd milliseconds of ours on trajectory-wise rows, against fla's fwd and fwd+bwd."""
    from harts_compiler.codegen.kernels.chunk_gdn.chunk_bwd import chunk_bwd
    from harts_compiler.codegen.kernels.chunk_gdn.l2norm import l2norm_fused
    from harts_compiler.codegen.kernels.chunk_gdn.state_bwd import state_bwd
    from harts_compiler.codegen.kernels.chunk_gdn.state_fwd import output_fwd, state_fwd
    from harts_compiler.codegen.kernels.chunk_gdn.wy_fwd import wy_fwd
    plan = two_level_plan(list(trees), device="cuda")
    tensors, _ = make_inputs([plan.trajectory_tokens], seed=13)
    q, k, v, g, beta = (t.contiguous() for t in tensors[:5])
    cu = plan.traj_cu
    n = cu.numel() - 1
    h0 = torch.zeros(n, 16, 128, 128, device="cuda")
    index = to_device(prepare_gdn_index(cu.cpu()), CUDA)
    traj_plan = single_call_plan(cu, device=CUDA)
    scale = 128 ** -0.5
    q, k = l2norm_fused(q), l2norm_fused(k)
    gc, T, w, u = wy_fwd(k, v, g, beta, index)
    h, v_new, bank = state_fwd(k, w, u, gc, h0, index)
    do = torch.randn_like(v)
    dh, dvn, _ = state_bwd(q, k, w, gc, do, bank, scale, index)
    bench = lambda f: kernel_ms(f, CUDA, rep_ms=100, warmup_ms=20)  # noqa: E731
    stages = {
        "l2norm fwd (q,k)": bench(lambda: (l2norm_fused(tensors[0]), l2norm_fused(tensors[1]))),
        "wy_fwd (2 kernels)": bench(lambda: wy_fwd(k, v, g, beta, index)),
        "state_fwd (scan)": bench(lambda: state_fwd(k, w, u, gc, h0, index)),
        "output_fwd": bench(lambda: output_fwd(q, k, v_new, gc, h, scale, index)),
        "state_bwd (dv_local in the scan)": bench(lambda: state_bwd(q, k, w, gc, do, bank, scale, index)),
        "chunk_bwd (qk+wy)": bench(lambda: chunk_bwd(q, k, v, beta, gc, T, v_new, h, dh, do, dvn, scale, index)),
    }
    leaves = [t.detach().requires_grad_(True) for t in tensors[:5]]
    stages["ours fwd (planned call)"] = bench(lambda: gated_delta_rule(
        *leaves, scale=scale, plan=traj_plan, initial_states=h0, use_qk_l2norm=True))
    if fla is not None:
        stages["fla fwd"] = bench(lambda: fla(*leaves, scale=scale, initial_state=h0, cu_seqlens=cu,
                                              use_qk_l2norm=True))
    print(f"\n== stage ms, trajectory rows of {trees}, {plan.trajectory_tokens} tokens ==")
    for name, ms in stages.items():
        print(f"{name:28s} {ms:8.3f}")
    log.append(dict(section="stages", **stages))


def conv_section(log, rows=32768, channels=8192, width=4):
    """Tree-aware short conv: Triton kernel vs the plain-torch gather (the runtime's other CUDA option)."""
    from harts_compiler.codegen.kernels.causal_conv import (prepare_conv_index, tree_causal_conv,
                                                            tree_causal_conv_reference)
    pred = torch.arange(rows, device="cuda")[:, None] - (width - 1) + torch.arange(width - 1, device="cuda")
    pred = pred.masked_fill(pred < 0, -1)
    pred[rows // 2:rows // 2 + width - 1] = pred[:width - 1]  # a second sequence starting mid-way
    index = to_device(prepare_conv_index(pred), CUDA)  # successor lists: host-built once, uploaded
    x = torch.randn(rows, channels, device="cuda").bfloat16().requires_grad_(True)
    w = (torch.randn(channels, width, device="cuda") * 0.5).bfloat16().requires_grad_(True)
    dy = torch.randn(rows, channels, device="cuda").bfloat16()
    y_ref = tree_causal_conv_reference(x.float(), w.float(), pred)
    ref = [y_ref, *torch.autograd.grad((y_ref * dy.float()).sum(), [x, w])]
    print(f"\n== tree causal conv, T={rows}, Ch={channels}, W={width}, bf16 (rel err vs fp32; fwd+bwd ms) ==")
    for name, fn in (("triton", lambda: tree_causal_conv(x, w, pred, index=index)),
                     ("torch gather", lambda: tree_causal_conv_reference(x, w, pred))):
        y = fn()
        got = [y, *torch.autograd.grad((y.float() * dy.float()).sum(), [x, w])]
        errs = [rel_error(a, b) for a, b in zip(got, ref)]
        ms = kernel_ms(lambda: torch.autograd.grad(fn(), [x, w], dy), CUDA, rep_ms=100, warmup_ms=20)
        print(f"{name:13s} y {errs[0]:.1e} dx {errs[1]:.1e} dw {errs[2]:.1e}   {ms:.3f} ms")
        log.append(dict(section="conv", path=name, errors=errs, ms=ms))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--variants", nargs="*", metavar="WORD",
                        help="also time other launch configurations (gdn_cases.CONFIG_VARIANTS): all, or those "
                             "named by one of these words or whose labels contain one")
    parser.add_argument("--no-fla", action="store_true", help="skip fla (saves its ~1-2 min of autotuning)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--timeline", action="store_true",
                        help="with --trees-only: the tree step's kernels of the first selected case in time order, "
                             "with their streams, per config")
    parser.add_argument("--profile", action="store_true",
                        help="with --trees-only: GPU ms per kernel of the first selected case, per config")
    parser.add_argument("--checks-only", action="store_true",
                        help="only the correctness checks: bf16 vs the fp32 reference (and fla's error) at up to 32k "
                             "tokens, and tree == trajectory-wise bitwise")
    parser.add_argument("--trees-only", nargs="*", metavar="CASE",
                        help="only the tree timings, of the cases whose names contain one of these words")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    fla = None if args.no_fla else fla_single_call("gdn")
    log: list[dict] = []
    variants = [] if args.variants is None else [  # a word names a variant (its key) or occurs in its label
        (label, cfg) for key, (label, cfg) in VARIANTS
        if not args.variants or any(w == key or w in label for w in args.variants)]
    configs = [("default", GDNKernelConfig())] + variants
    if args.checks_only:
        results = [(label, *check_against_reference(fla, log, cfg, label=label), check_tree_bitwise(log, cfg))
                   for label, cfg in configs]
        print("\n== checks ==")
        for label, ok, worst, bitwise in results:
            print(f"[{label}] within bound {ok}, worst ours/fla error ratio {worst:.2f}, tree bitwise {bitwise}")
        return
    if args.trees_only is not None:
        for label, cfg in configs:
            bench_trees(fla if label == "default" else None, log, cfg, label, only=args.trees_only)
            if args.timeline:
                timeline_section(log, tree_cases(args.trees_only)[0][1], cfg, label)
            if args.profile:
                name, trees = tree_cases(args.trees_only)[0]
                print(f"[{label}] {name}")
                profile_section(log, trees=trees, config=cfg)
        return
    summary = {}
    # cheapest and most telling first, so a run stopped early has printed them
    conv_section(log)
    if not args.skip_check:
        summary["check_ok[exports]"] = check_against_reference(fla, log, only_exports=True)[0]
        summary["tree_bitwise"] = check_tree_bitwise(log)
    stage_breakdown(fla, log)
    summary["default"] = bench_trees(fla, log, configs[0][1], "default")
    profile_section(log)  # where the tree step's time goes, kernel by kernel
    if not args.skip_check:
        summary["check_ok"], summary["worst_ours_over_fla_error"] = check_against_reference(fla, log)
    for label, cfg in configs[1:]:
        if not args.skip_check:
            summary[f"check_ok[{label}]"] = check_against_reference(fla, log, cfg, only_exports=True,
                                                                      label=label)[0]
            summary[f"tree_bitwise[{label}]"] = check_tree_bitwise(log, cfg)
        summary[label] = bench_trees(None, log, cfg, label)
    with open(os.path.join(args.out, "gdn_bench.json"), "w") as f:
        json.dump(log, f, indent=1, default=str)
    print("\n== summary ==")
    for label, _ in configs:
        for r in summary[label]:
            print(f"[{label}] {r['case']}: ours traj {r['ours_traj_ms']:.2f} ms (fla {r['fla_traj_ms']:.2f}), "
                  f"tree {r['ours_tree_ms']:.2f} ms, {r['speedup']:.2f}x of ideal {r['ideal']:.2f}x = "
                  f"{r['of_ideal']:.0%}; "
                  f"per round {r['per_round_tree_ms']:.2f} ms = {r['per_round_of_ideal']:.0%}; "
                  f"tree == traj bitwise: {r['tree_bitwise']}")
    for key, value in summary.items():
        if not isinstance(value, list):
            print(key, value)


if __name__ == "__main__":
    main()
