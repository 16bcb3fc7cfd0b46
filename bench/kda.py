"""Kimi Delta Attention kernels on the H200: trajectory-wise fwd+bwd ms of ours against fla's chunk_kda
(fla-core 0.6.0, `from fla.ops.kda import chunk_kda`), and both one's errors against the fp32 reference, in one
run. H = 32 heads, K = V = 128 (Kimi Linear), bf16 q, k, v, beta, fp32 g (a log decay per key channel,
logsigmoid of N(0, 1)), l2norm in the kernel, an fp32 initial state per sequence that takes gradients.

    PYTHONUNBUFFERED=1 python bench/kda.py [--cases 8x8192 1x32768 64x1024] [--no-fla] [--heads-checked 2] [--profile] \
        [--sweep] 2>&1 | tee $OUT/kda.log
    TRITON_INTERPRET=1 python bench/kda.py --device cpu --tiny --no-fla      (a CPU smoke run, ~1 minute)

Errors are norm-relative per output / gradient, on the first --heads-checked heads (heads are independent,
and the fp32 reference materialises [chunks, heads, 64, 64, K] decay tensors). Needs CUDA; without fla (not
importable) only our columns are printed. Triton compiles our kernels (and autotunes fla's) on their first call,
so the first numbers come after about 5 minutes.

--sweep also runs ours under each launch-config change of SWEEP (same inputs, after the default): fwd+bwd ms,
the GPU ms of the kernels whose time moved by more than 2% against the default's, and the worst error
ratio to the default's (a change must not cost accuracy). Each change compiles the kernels it touches again
(about 30 s each). Per-kernel GPU times come from torch's profiler.
"""
from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.nn.functional as F

from anchors import fla_single_call
from common import kernel_ms, rel_error
from gdn_profile import device_ms_by_kernel, print_kernels
from harts_compiler.codegen.kernels.chunk_gdn import plan_single_call
from harts_compiler.codegen.kernels.chunk_kda import (KDAKernelConfig, chunk_kimi_delta_attention_reference,
                                                      kimi_delta_attention)
from harts_compiler.codegen.kernels.upload import to_device

CASES = {"8x8192": [8192] * 8, "1x32768": [32768], "64x1024": [1024] * 64}
TINY = {"8x8192": [80] * 2, "1x32768": [130], "64x1024": [64] * 3}  # --tiny: the same shapes of case, CPU-sized
NAMES = ["o", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
# KDAKernelConfig changes timed with --sweep
SWEEP = [dict(diag_bwd_heads=2, diag_bwd_warps=2), dict(diag_bwd_heads=8, diag_bwd_warps=8),
         dict(diag_bwd_heads=8, diag_bwd_warps=4), dict(intra_bwd_warps=4), dict(intra_bwd_warps=8),
         dict(intra_block_k=16),
         dict(intra_block_k=16, intra_fwd_warps=4), dict(intra_fwd_warps=4),
         dict(intra_fwd_warps=8), dict(intra_fwd_warps=1), dict(diag_warps=1, diag_heads=1),
         dict(diag_warps=2, diag_heads=2), dict(diag_warps=8, diag_heads=8), dict(diag_bwd_heads=1, diag_bwd_warps=1),
         dict(diag_warps=1), dict(diag_warps=2), dict(diag_bwd_warps=1), dict(diag_bwd_warps=2),
         dict(solve_warps=2), dict(solve_warps=4), dict(wy_bwd_warps=8), dict(bwd_inter_warps=4)]


def make_inputs(lengths, heads, device, dim=128, seed=0):
    gen = torch.Generator(device).manual_seed(seed)
    rows = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=gen)
    q, k, v = (randn(rows, heads, dim).bfloat16() for _ in range(3))
    g = F.logsigmoid(randn(rows, heads, dim))
    beta = torch.sigmoid(randn(rows, heads)).bfloat16()
    h0 = randn(len(lengths), heads, dim, dim) * 0.05
    cu = torch.tensor([0] + list(lengths), device=device).cumsum(0).to(torch.int32)
    return [q, k, v, g, beta, h0], cu


def grads_of(call, tensors, do, upcast=False):
    """(o, dq, dk, dv, dg, dbeta, dh0) of one fwd+bwd of `call(q, k, v, g, beta, h0)` against output grad `do`."""
    leaves = [(t.float() if upcast else t).detach().requires_grad_(True) for t in tensors]
    o = call(*leaves)
    return [o, *torch.autograd.grad(o, leaves, do.to(o.dtype))]


def ours_call(plan, scale, config):
    return lambda q, k, v, g, beta, h0: kimi_delta_attention(
        q, k, v, g, beta, scale=scale, plan=plan, initial_states=h0, use_qk_l2norm=True, config=config)[0]


def run_case(lengths, heads, dim, fla, heads_checked, device, profile=False, sweep=()):
    """({label: fwd+bwd ms}, {label: errors}, {label: {kernel: (GPU ms, launches)}}) of ours, fla (when
    given) and ours under each config change of `sweep` (label: the change as text). Device ms per kernel (CUDA
    only) for every label with `profile`, else for ours and the sweep's."""
    tensors, cu = make_inputs(lengths, heads, device, dim)
    scale = tensors[0].shape[-1] ** -0.5
    plan = to_device(plan_single_call(lengths), device)  # planned once, outside the timed step
    calls = {"ours": ours_call(plan, scale, KDAKernelConfig())}
    if fla is not None:
        calls["fla"] = lambda q, k, v, g, beta, h0: fla(q, k, v, g, beta, scale=scale, initial_state=h0,
                                                        cu_seqlens=cu, use_qk_l2norm=True)[0]
    for change in sweep:
        calls[str(change)] = ours_call(plan, scale, dataclasses.replace(KDAKernelConfig(), **change))
    profiled = set(calls) if profile else {"ours", *map(str, sweep)} if sweep else set()
    profiled = profiled if device.type == "cuda" else set()
    do = torch.randn(tensors[2].shape, device=device, generator=torch.Generator(device).manual_seed(1)).bfloat16()

    # errors on the first heads, against the fp32 reference on those heads alone
    part = [t[:, :heads_checked] for t in tensors[:5]] + [tensors[5][:, :heads_checked]]

    def reference(q, k, v, g, beta, h0):
        return chunk_kimi_delta_attention_reference(q, k, v, g, beta, scale=scale, initial_state=h0, cu_seqlens=cu,
                                                    use_qk_l2norm=True)[0]
    want = grads_of(reference, part, do[:, :heads_checked], upcast=True)
    errors = {}
    for label, call in calls.items():
        got = grads_of(call, tensors, do)
        errors[label] = [rel_error(a[:, :heads_checked], b) for a, b in zip(got, want)]
        del got
    del want
    if device.type == "cuda":
        torch.cuda.empty_cache()

    timings, kernel_times = {}, {}
    for label, call in calls.items():
        leaves = [t.detach().requires_grad_(True) for t in tensors]
        step = lambda: torch.autograd.grad(call(*leaves), leaves, do)  # noqa: E731
        timings[label] = kernel_ms(step, device)
        if label in profiled:
            kernel_times[label] = device_ms_by_kernel(step)[0]
    return timings, errors, kernel_times


def print_sweep(sweep, timings, errors, kernel_times):
    """One line per change: fwd+bwd ms, the kernels whose GPU ms moved > 2% (default's in brackets), and the
    worst error ratio to the default's."""
    print(f"sweep (ours, default {timings['ours']:.3f} ms):")
    default = kernel_times.get("ours", {})
    for change in sweep:
        label = str(change)
        moved = [f"{name} {ms:.3f} ({default[name][0]:.3f})" for name, (ms, _) in kernel_times.get(label, {}).items()
                 if name in default and abs(ms - default[name][0]) > 0.02 * default[name][0]]
        worst = max(e / max(d, 1e-30) for e, d in zip(errors[label], errors["ours"]))
        print(f"  {label:70s} {timings[label]:8.3f} ms  errors x{worst:.3f}  " + "  ".join(moved))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--heads-checked", type=int, default=2, help="heads compared with the fp32 reference")
    parser.add_argument("--no-fla", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile", action="store_true", help="also print GPU ms per kernel of each")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU-sized lengths, 2 heads of 16 (a smoke run: TRITON_INTERPRET=1 --device cpu)")
    parser.add_argument("--sweep", action="store_true", help="also run ours under each config change of SWEEP")
    args = parser.parse_args()
    device = torch.device(args.device)
    fla = None if args.no_fla else fla_single_call("kda")
    cases, dim = (TINY, 16) if args.tiny else (CASES, 128)
    if args.tiny:
        args.heads, args.heads_checked = 2, 2
    print(f"KDA fwd+bwd, H={args.heads}, K=V={dim}, bf16, l2norm in the kernel; errors: |x - ref| / |ref| on "
          f"{args.heads_checked} heads vs the fp32 reference")
    print(f"{'case':10s} {'ours ms':>9s} {'fla ms':>9s} {'ours/fla':>9s}   errors: ours (fla)")
    for name in args.cases:
        sweep = SWEEP if args.sweep else ()
        timings, errors, kernel_times = run_case(cases[name], args.heads, dim, fla, args.heads_checked, device,
                                                 profile=args.profile, sweep=sweep)
        for label in ("ours", "fla"):
            if args.profile and label in kernel_times:
                print_kernels(label, kernel_times[label])
        fla_ms = timings.get("fla")
        ratio = f"{timings['ours'] / fla_ms:9.3f}" if fla_ms else f"{'-':>9s}"
        cells = [f"{e:.2e}" + (f" ({f:.2e})" if "fla" in errors else "")
                 for e, f in zip(errors["ours"], errors.get("fla", errors["ours"]))]
        fla_col = f"{fla_ms:9.3f}" if fla_ms else f"{'-':>9s}"
        print(f"{name:10s} {timings['ours']:9.3f} {fla_col} {ratio}   " + "  ".join(
            f"{n} {c}" for n, c in zip(NAMES, cells)))
        if sweep:
            print_sweep(sweep, timings, errors, kernel_times)


if __name__ == "__main__":
    main()
