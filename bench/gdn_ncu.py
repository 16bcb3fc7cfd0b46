"""Hardware counters of the GDN (or KDA) kernels under Nsight Compute, and a summary of ncu's raw CSV.

One trajectory-wise fwd+bwd runs inside a CUDA profiler range; the summary gives each kernel's time, DRAM and L2
throughput, issue activity, resident warps and top stall reasons.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section WarpStateStats --section Occupancy --section LaunchStats --csv --page raw \\
        python3 bench/gdn_ncu.py [--lengths 7680 x 8] [--value-heads 32] > ncu.csv
    python3 bench/gdn_ncu.py --summarize ncu.csv

`--kda` profiles one KDA fwd+bwd instead (bench/kda.py's inputs: 32 heads of 128, 8 x 8,192 tokens by default).

The step runs twice first (Triton compiles, the allocator warms up), then once inside the range, so ncu profiles each
kernel of exactly one fwd+bwd. Stall reasons are cycles per issued instruction by reason (ncu's
smsp__average_warps_issue_stalled_*_per_issue_active): with few resident warps, latency shows up there rather
than as memory throughput.
"""
from __future__ import annotations

import argparse
import csv

STALL = "smsp__average_warps_issue_stalled_"
COLUMNS = [("us", "gpu__time_duration.sum", 1e-3),
           ("dram %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 1),
           ("L2 %", "lts__throughput.avg.pct_of_peak_sustained_elapsed", 1),
           ("issue %", "sm__issue_active.avg.pct_of_peak_sustained_elapsed", 1),
           ("warps %", "sm__warps_active.avg.pct_of_peak_sustained_active", 1),
           ("regs", "launch__registers_per_thread", 1)]


def summarize(path: str) -> None:
    """One line per profiled kernel of an `ncu --csv --page raw` file (lines before its header are ncu's notes)."""
    with open(path, newline="") as f:
        lines = [row for row in csv.reader(f)]
    start = next(i for i, row in enumerate(lines) if row[:1] == ["ID"])
    header, data = lines[start], lines[start + 2:]  # the row after the header holds units
    col = {name: i for i, name in enumerate(header)}
    stalls = [h for h in header if h.startswith(STALL) and h.endswith("_per_issue_active.ratio")]
    print(f"{'kernel':28s} " + " ".join(f"{label:>8s}" for label, _, _ in COLUMNS) + "  top stalls (cycles per issue)")
    for row in data:
        def value(name):
            return float(row[col[name]].replace(",", "") or 0)
        cells = " ".join(f"{value(metric) * scale:8.1f}" for _, metric, scale in COLUMNS)
        top = sorted(((value(h), h[len(STALL):-len("_per_issue_active.ratio")]) for h in stalls), reverse=True)[:3]
        print(f"{row[col['Kernel Name']][:28]:28s} {cells}  " + ", ".join(f"{n} {v:.1f}" for v, n in top))


def run_profiled(step) -> None:
    """`step` twice (Triton compiles, the allocator warms up), then once inside the profiler range."""
    import torch

    step()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def profile_gdn(lengths: list[int], value_heads: int) -> None:
    import torch
    from gdn_cases import make_inputs, planned_call, single_call_plan

    tensors, cu = make_inputs(lengths, hk=16, hv=value_heads)
    plan = single_call_plan(cu)
    leaves = [t.detach().requires_grad_(True) for t in tensors[:5]]
    do = torch.randn(sum(lengths), value_heads, 128, device="cuda").bfloat16()

    def step():
        o = planned_call(*leaves, scale=128 ** -0.5, initial_state=tensors[5], plan=plan, use_qk_l2norm=True)[0]
        torch.autograd.grad(o, leaves, do)  # not .backward(): no accumulation kernels into .grad
    run_profiled(step)


def profile_kda(lengths: list[int], heads: int) -> None:
    import torch
    from kda import make_inputs, ours_call

    from harts_compiler.codegen.kernels.chunk_gdn import plan_single_call
    from harts_compiler.codegen.kernels.chunk_kda import KDAKernelConfig
    from harts_compiler.codegen.kernels.upload import to_device

    device = torch.device("cuda")
    tensors, _ = make_inputs(lengths, heads, device)
    call = ours_call(to_device(plan_single_call(lengths), device), 128 ** -0.5, KDAKernelConfig())
    leaves = [t.detach().requires_grad_(True) for t in tensors]
    do = torch.randn_like(tensors[2])
    run_profiled(lambda: torch.autograd.grad(call(*leaves), leaves, do))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", help="sequence lengths (tokens; default 8 x 7,680, "
                        "with --kda 8 x 8,192)")
    parser.add_argument("--value-heads", type=int, default=32, help="GDN: 16 key heads; 32 value heads is "
                        "Qwen3-Next's. KDA: the heads")
    parser.add_argument("--kda", action="store_true", help="a KDA step instead of a GDN one")
    parser.add_argument("--summarize", metavar="CSV", help="print the summary of an ncu raw CSV instead")
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize)
    elif args.kda:
        profile_kda(args.lengths or [8192] * 8, args.value_heads)
    else:
        profile_gdn(args.lengths or [7680] * 8, args.value_heads)


if __name__ == "__main__":
    main()
