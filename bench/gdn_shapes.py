"""Which dtypes and head sizes the Triton GDN path runs correctly on this GPU (Triton 3.6 miscompiles
some Hopper configurations, docs/gdn_kernels.md). Each configuration runs fwd + bwd with exports and
injected export gradients in its own process (an illegal memory access poisons the CUDA context), against
the fp64 reference, with the kernels called past the CUDA guard (`config.triton_supports`), which should
admit only the rows marked ok.

    PYTHONUNBUFFERED=1 python bench/gdn_shapes.py            # H200, ~2 minutes (one compile per row)
    python bench/gdn_shapes.py --stages bfloat16 32 32         # which kernel a wrong row comes from
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys

CONFIGS = [("bfloat16", 128, 128), ("bfloat16", 64, 64), ("bfloat16", 32, 32), ("bfloat16", 16, 16),
           ("bfloat16", 128, 256), ("float16", 128, 128), ("float32", 128, 128), ("float32", 16, 16)]


def check(dtype_name: str, kd: int, vd: int, device: str = "cuda") -> dict:
    """In this process: max relative (Frobenius) error over o, exports and every gradient."""
    import torch

    from harts_compiler.codegen.kernels.chunk_gdn import chunk_gated_delta_rule_reference, plan_single_call
    from harts_compiler.codegen.kernels.chunk_gdn.config import triton_supports
    from harts_compiler.codegen.kernels.chunk_gdn.l2norm import l2norm_fused
    from harts_compiler.codegen.kernels.chunk_gdn.tree import TreeGatedDeltaRuleFunction
    from harts_compiler.codegen.kernels.upload import to_device
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device).manual_seed(0)
    lengths, hk, hv = [200, 64, 130, 1], 2, 4
    rows = sum(lengths)
    tensors = [torch.randn(rows, hk, kd, device=device, generator=gen),
               torch.randn(rows, hk, kd, device=device, generator=gen),
               torch.randn(rows, hv, vd, device=device, generator=gen),
               -torch.rand(rows, hv, device=device, generator=gen) * 0.3,
               torch.rand(rows, hv, device=device, generator=gen),
               torch.randn(len(lengths), hv, kd, vd, device=device, generator=gen) * 0.05]
    cu = torch.tensor([0] + lengths, device=device).cumsum(0)
    exports = dict(export_seq=torch.tensor([0, 0, 2]), export_offset=torch.tensor([64, 192, 128]))
    weights = [torch.randn(rows, hv, vd, device=device, generator=gen, dtype=torch.float64),
               torch.randn(3, hv, kd, vd, device=device, generator=gen, dtype=torch.float64)]

    plan = to_device(plan_single_call(lengths, exports["export_seq"], exports["export_offset"]), device)

    def triton(q, k, v, g, beta, *, scale, initial_state, use_qk_l2norm, **_):
        # tree.gated_delta_rule without its triton_supports check: l2norm, then the plan's one Function
        if use_qk_l2norm:
            q, k = l2norm_fused(q), l2norm_fused(k)
        return TreeGatedDeltaRuleFunction.apply(q, k, v, g, beta, initial_state, float(scale), plan)

    def run(fn, cast):
        leaves = [t.to(cast if i not in (3, 5) else (torch.float64 if cast == torch.float64 else torch.float32))
                  .requires_grad_(True) for i, t in enumerate(tensors)]
        o, states = fn(*leaves[:5], scale=kd ** -0.5, initial_state=leaves[5], cu_seqlens=cu, use_qk_l2norm=True,
                       **exports)
        loss = (o.double() * weights[0]).sum() + (states.double() * weights[1]).sum()
        return [o, states, *torch.autograd.grad(loss, leaves)]
    got = run(triton, dtype)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    ref = run(chunk_gated_delta_rule_reference, torch.float64)
    errors = [float((a.detach().double() - b.detach()).norm() / b.detach().norm()) for a, b in zip(got, ref)]
    return dict(triton=triton_supports(dtype, kd, vd, cuda=torch.device(device).type == "cuda"),
                max_rel_err=max(errors))


def stage_errors(dtype_name: str, kd: int, vd: int, device: str = "cuda") -> dict:
    """Which kernel a wrong row comes from: each stage run in `dtype_name` on the fp32 run's inputs to that
    stage (cast), against the same stage in fp32, so an error does not spread to the stages after it.
    Relative (Frobenius) error per stage output, the worst over its outputs. The yardstick is the kernels' own
    fp32 run (TF32 dots on the GPU, ~1e-3), enough to find a stage that is wrong (the wrong rows are off by ~1)."""
    import numpy as np
    import torch

    from harts_compiler.codegen.kernels.chunk_gdn import prepare_gdn_index
    from harts_compiler.codegen.kernels.upload import to_device
    from harts_compiler.codegen.kernels.chunk_gdn.chunk_bwd import chunk_bwd
    from harts_compiler.codegen.kernels.chunk_gdn.state_bwd import state_bwd
    from harts_compiler.codegen.kernels.chunk_gdn.state_fwd import output_fwd, state_fwd
    from harts_compiler.codegen.kernels.chunk_gdn.wy_fwd import wy_fwd
    from harts_compiler.codegen.kernels.scaled16 import ScaledRows

    def decoded(grads):  # dq and dk travel block-scaled for 16-bit inputs (scaled16.py)
        return tuple(g.float() if isinstance(g, ScaledRows) else g for g in grads)
    low = getattr(torch, dtype_name)
    gen = torch.Generator(device).manual_seed(0)
    lengths, hk, hv, scale = [200, 64, 130, 1], 2, 4, kd ** -0.5
    rows = sum(lengths)
    q, k = (torch.nn.functional.normalize(torch.randn(rows, hk, kd, device=device, generator=gen), dim=-1)
            for _ in range(2))
    v = torch.randn(rows, hv, vd, device=device, generator=gen)
    g = -torch.rand(rows, hv, device=device, generator=gen) * 0.3
    beta = torch.rand(rows, hv, device=device, generator=gen)
    h0 = torch.randn(len(lengths), hv, kd, vd, device=device, generator=gen) * 0.05
    do = torch.randn(rows, hv, vd, device=device, generator=gen)
    index = to_device(prepare_gdn_index(np.cumsum([0] + lengths), [0, 2], [64, 128]), device)
    bank_grad = torch.randn(index.num_slots, hv, kd, vd, device=device, generator=gen)

    # per stage: (kernels, inputs as the fp32 run made them, positions the pipeline holds in the 16-bit dtype)
    gc, T, w, u = wy = wy_fwd(k, v, g, beta, index)
    h, v_new, bank = fwd = state_fwd(k, w, u, gc, h0, index)
    dh, dvn, dh0 = bwd = state_bwd(q, k, w, gc, do, bank_grad, scale, index)
    stages = {
        "wy_fwd (gc, T, w, u)": (lambda *a: wy_fwd(*a, index), (k, v, g, beta), {0, 1, 3}, wy),
        "state_fwd (h, v_new, bank)": (lambda *a: state_fwd(*a, index), (k, w, u, gc, h0), {0, 1, 2}, fwd),
        "output_fwd (o)": (lambda *a: (output_fwd(*a, scale, index),), (q, k, v_new, gc, h), {0, 1, 2, 4},
                           (output_fwd(q, k, v_new, gc, h, scale, index),)),
        "state_bwd (dh, dvn, dh0)": (lambda *a: state_bwd(*a, scale, index), (q, k, w, gc, do, bank_grad),
                                     {0, 1, 2, 4}, bwd),
        "chunk_bwd (dq, dk, dv, dbeta, dg)": (
            lambda *a: decoded(chunk_bwd(*a, scale, index)), (q, k, v, beta, gc, T, v_new, h, dh, do, dvn),
            {0, 1, 2, 3, 6, 7, 8, 9, 10}, chunk_bwd(q, k, v, beta, gc, T, v_new, h, dh, do, dvn, scale, index)),
    }
    errors = {}
    for name, (fn, inputs, low_positions, expect) in stages.items():
        got = fn(*(x.to(low) if i in low_positions else x for i, x in enumerate(inputs)))
        errors[name] = max(float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
                           for a, b in zip(got, expect))
    return errors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--stages", nargs=3, metavar=("DTYPE", "K", "V"),
                   help="per-kernel errors of one configuration (stage_errors), e.g. --stages bfloat16 32 32")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    if args.stages:
        for name, err in stage_errors(args.stages[0], int(args.stages[1]), int(args.stages[2]), args.device).items():
            print(f"{name:34s} {err:9.2e}")
        return
    if args.one:
        print(json.dumps(check(args.one[0], int(args.one[1]), int(args.one[2]), args.device)))
        return

    def child(config):
        proc = subprocess.run([sys.executable, __file__, "--one", *map(str, config)], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode:
            last = (proc.stderr.strip().splitlines() or ["?"])[-1]
            return config, dict(status="CRASH", detail=last[:110])
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        bound = 2e-2 if config[0] != "float32" else 5e-3
        result["status"] = "ok" if result["max_rel_err"] < bound else "WRONG"
        return config, result
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(child, CONFIGS))
    print(f"{'dtype':9s} {'K':>4s} {'V':>4s} {'guard':>6s} {'max rel err':>11s}  status")
    for (dtype, kd, vd), r in results:
        print(f"{dtype:9s} {kd:4d} {vd:4d} {str(r.get('triton', '-')):>6s} {r.get('max_rel_err', float('nan')):11.2e}  "
              f"{r['status']} {r.get('detail', '')}")


if __name__ == "__main__":
    main()
