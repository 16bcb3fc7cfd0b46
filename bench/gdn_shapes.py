"""Which dtypes and head sizes the Triton GDN path runs correctly on this GPU (Triton 3.6 miscompiles
some Hopper configurations, GPU.md). Each configuration runs fwd + bwd with exports and injected
export gradients in its own process (an illegal memory access poisons the CUDA context), against the
fp64 reference; the wrapper's CUDA guard (`function.triton_supports`) should admit only the rows
marked ok.

    PYTHONUNBUFFERED=1 python bench/gdn_shapes.py            # H200, ~2 minutes (one compile per row)
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys

CONFIGS = [("bfloat16", 128, 128), ("bfloat16", 64, 64), ("bfloat16", 32, 32), ("bfloat16", 16, 16),
           ("bfloat16", 128, 256), ("float16", 128, 128), ("float32", 128, 128), ("float32", 16, 16)]


def check(dtype_name: str, kd: int, vd: int) -> dict:
    """In this process: max relative (Frobenius) error over o, exports and every gradient."""
    import torch

    from harts_compiler.codegen.kernels.chunk_gdn import chunk_gated_delta_rule_reference, prepare_gdn_index
    from harts_compiler.codegen.kernels.chunk_gdn.function import run_triton, triton_supports
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator("cuda").manual_seed(0)
    lengths, hk, hv = [200, 64, 130, 1], 2, 4
    rows = sum(lengths)
    tensors = [torch.randn(rows, hk, kd, device="cuda", generator=gen),
               torch.randn(rows, hk, kd, device="cuda", generator=gen),
               torch.randn(rows, hv, vd, device="cuda", generator=gen),
               -torch.rand(rows, hv, device="cuda", generator=gen) * 0.3,
               torch.rand(rows, hv, device="cuda", generator=gen),
               torch.randn(len(lengths), hv, kd, vd, device="cuda", generator=gen) * 0.05]
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0)
    exports = dict(export_seq=torch.tensor([0, 0, 2]), export_offset=torch.tensor([64, 192, 128]))
    weights = [torch.randn(rows, hv, vd, device="cuda", generator=gen, dtype=torch.float64),
               torch.randn(3, hv, kd, vd, device="cuda", generator=gen, dtype=torch.float64)]

    index = prepare_gdn_index(cu, exports["export_seq"], exports["export_offset"], device="cuda")

    def triton(q, k, v, g, beta, *, cu_seqlens, export_seq, export_offset, **kw):  # past the wrapper's guard
        return run_triton(q, k, v, g, beta, index=index, **kw)

    def run(fn, cast):
        leaves = [t.to(cast if i not in (3, 5) else (torch.float64 if cast == torch.float64 else torch.float32))
                  .requires_grad_(True) for i, t in enumerate(tensors)]
        o, states = fn(*leaves[:5], scale=kd ** -0.5, initial_state=leaves[5], cu_seqlens=cu, use_qk_l2norm=True,
                       **exports)
        loss = (o.double() * weights[0]).sum() + (states.double() * weights[1]).sum()
        return [o, states, *torch.autograd.grad(loss, leaves)]
    got = run(triton, dtype)
    torch.cuda.synchronize()
    ref = run(chunk_gated_delta_rule_reference, torch.float64)
    errors = [float((a.double() - b).norm() / b.norm()) for a, b in zip(got, ref)]
    return dict(triton=triton_supports(dtype, kd, vd), max_rel_err=max(errors))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(check(args.one[0], int(args.one[1]), int(args.one[2]))))
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
