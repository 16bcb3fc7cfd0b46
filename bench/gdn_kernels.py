"""Trajectory-wise GDN fwd+bwd kernel by kernel: ours against fla 0.6.0, and launch-config sweeps.

Answers "which of our kernels loses to which of fla's" before any kernel is rewritten: GPU ms per
kernel name (torch.profiler, summed over launches) for one fwd+bwd of each, on the trajectory rows
of the first anchor tree of gdn_cases.ANCHORS (8 sequences of 7,680 tokens = 61,440 tokens, H = 16, K = V = 128,
bf16, l2norm in the kernel), then fwd+bwd ms of ours under each `GDNKernelConfig` given with --sweep.

    PYTHONUNBUFFERED=1 python bench/gdn_kernels.py [--sweep] 2>&1 | tee $OUT/gdn_kernels.log
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from anchors import fla_single_call
from common import kernel_ms
from gdn_cases import CONFIG_VARIANTS, agentic_trees, make_inputs, single_call_plan
from gdn_profile import compare
from harts_compiler.codegen.kernels.chunk_gdn import GDNKernelConfig, gated_delta_rule

# profiled next to the default and fla, kernel by kernel (the one change whose per-kernel effect matters)
COMPARED = CONFIG_VARIANTS["scans_2w"]
# GDNKernelConfig changes timed with --sweep (each against the default in the same run)
SWEEP = [dict(scan_num_stages=2), dict(scan_num_stages=1), dict(scan_block_v=32),
         dict(wy_kkt_warps=2), dict(bwd_block_v=32), dict(out_warps=8), dict(gated_at_warps=4),
         dict(bwd_qk_warps=4)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[7680] * 8,
                        help="trajectory lengths (default: the P4096 B8 L3584 tree's 8 x 7,680)")
    parser.add_argument("--agentic", action="store_true",
                        help="the trajectories of bench/gdn.py's agentic batch instead (42, 3,676-5,644 tokens)")
    parser.add_argument("--sweep", action="store_true", help="also time ours under the configs of SWEEP")
    args = parser.parse_args()
    if args.agentic:
        args.lengths = [p + length for p, branches, length in agentic_trees() for _ in range(branches)]
    tensors, cu = make_inputs(args.lengths, seed=5)
    leaves = [t.detach().requires_grad_(True) for t in tensors[:5]]
    h0 = tensors[5]
    do = torch.randn_like(tensors[2])
    scale = 128 ** -0.5
    fla = fla_single_call("gdn")

    def ours_step(config):
        plan = single_call_plan(cu, config=config, device="cuda")  # planned once, outside the timed step
        return lambda: torch.autograd.grad(gated_delta_rule(
            *leaves, scale=scale, plan=plan, initial_states=h0, use_qk_l2norm=True)[0], leaves, do)

    steps = {"ours": ours_step(GDNKernelConfig()), COMPARED[0]: ours_step(COMPARED[1])}
    if fla is not None:
        steps["fla"] = lambda: torch.autograd.grad(fla(*leaves, scale=scale, initial_state=h0, cu_seqlens=cu,
                                                       use_qk_l2norm=True)[0], leaves, do)
    print(f"== GPU ms per kernel, one trajectory-wise fwd+bwd, {sum(args.lengths)} tokens ==")
    compare(steps, top=30)
    print("\n== fwd+bwd ms (do_bench median) ==")
    timings = {name: kernel_ms(step, torch.device("cuda")) for name, step in steps.items()}
    if args.sweep:
        for change in SWEEP:
            timings[f"ours {change}"] = kernel_ms(ours_step(dataclasses.replace(GDNKernelConfig(), **change)),
                                                  torch.device("cuda"))
    for name, ms in timings.items():
        print(f"{name:60s} {ms:8.3f}")


if __name__ == "__main__":
    main()
