"""Throwaway A/B: Triton vs Gluon tree-attention dk/dv kernel on one H200, same run (delete after the A/B).

    python scratch/gluon_dkdv_ab.py [--rep-ms 200] [--no-check] [-v]

Builds P4096 B8 L3584 (32,768 tokens, 16/2 heads, D = DV = 256, bf16), runs the Triton forward for o and lse
and bwd_delta, then times the shipped Triton bwd_dkdv (``config_for(256).dkdv``) and the Gluon dk/dv kernel
(64-row sub-tiles, q / do rings of 2 stages: 3 do not fit in shared memory at D = 256; one 8-warp consumer
partition or two 4-warp ones) with
triton.testing.do_bench, and checks dk and dv against the fp32 oracle (autograd through the chunked reference).
A failing call prints one line and the script goes on.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import numpy as np
import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from tree_layouts import anchor_tree  # noqa: E402

from harts_compiler.codegen.kernels.tree_attention import (build_block_index, config_for,  # noqa: E402
                                                           tree_attention_fp32_oracle)
from harts_compiler.codegen.kernels.tree_attention.backward import bwd_delta, bwd_dkdv  # noqa: E402
from harts_compiler.codegen.kernels.tree_attention.forward import tree_attention_forward  # noqa: E402
from harts_compiler.codegen.kernels.upload import to_device  # noqa: E402


def rel(actual, expected) -> float:
    return ((actual.float() - expected).norm() / expected.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rep-ms", type=int, default=200)
    parser.add_argument("--no-check", action="store_true", help="skip the fp32 error check")
    parser.add_argument("-v", action="store_true", help="print the traceback of a failing kernel")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return
    print(f"device {torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}")
    layout = anchor_tree(4096, 8, 3584)
    n_tokens, hq, hkv, d = layout.num_tokens, 16, 2, 256
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(n_tokens, hq, d, generator=gen, device="cuda").bfloat16()
    k = torch.randn(n_tokens, hkv, d, generator=gen, device="cuda").bfloat16()
    v = torch.randn(n_tokens, hkv, d, generator=gen, device="cuda").bfloat16()
    do = torch.randn(n_tokens, hq, d, generator=gen, device="cuda").bfloat16()
    subtree_end = layout.subtree_end_tensor("cuda")
    scale = d ** -0.5
    shipped = config_for(256)
    host_end = subtree_end.cpu().numpy()
    tiles = list(dict.fromkeys([*shipped.tiles, (128, 64)]))
    index = to_device(build_block_index(host_end, *tiles[0]).with_tiles(host_end, tiles[1:]), "cuda")
    ends = layout.subtree_end.astype(np.int64)
    pairs = int((ends - np.arange(ends.size)).sum())
    flop = 2.0 * pairs * hq * (d + d + d + d)  # s = q k^T, dp = do v^T, dv += p^T do, dk += ds^T q

    o, lse = tree_attention_forward(q, k, v, subtree_end, index, scale, shipped.fwd)
    delta = bwd_delta(o, do)
    runs = {
        f"triton shipped {shipped.dkdv}": lambda: bwd_dkdv(q, k, v, do, lse, delta, subtree_end, index, scale,
                                                           shipped.dkdv),
    }
    try:
        from harts_compiler.codegen.kernels.tree_attention.backward_dkdv_gluon import bwd_dkdv_gluon
        for consumers in (1, 2):
            launch = dict(block_m=128, block_n=64, block_ms=64, stages=2, consumers=consumers)
            runs[f"gluon 128x64 sub 64, q/do ring 2, {consumers} consumer part."] = (
                lambda launch=launch: bwd_dkdv_gluon(q, k, v, do, lse, delta, subtree_end, index, scale, launch))
    except Exception as exc:  # noqa: BLE001
        print(f"gluon import failed: {exc!r}")

    dk_ref = dv_ref = None
    if not args.no_check:
        _, _, dk_ref, dv_ref = tree_attention_fp32_oracle(q, k, v, do, subtree_end, scale=scale)
    outputs = {}
    rows = []
    for name, fn in runs.items():
        try:
            dk, dv = fn()
            torch.cuda.synchronize()
            outputs[name] = (dk, dv)
            ms = triton.testing.do_bench(fn, warmup=50, rep=args.rep_ms)
            errs = (float("nan"),) * 2 if dk_ref is None else (rel(dk, dk_ref), rel(dv, dv_ref))
            rows.append((name, ms, flop / ms / 1e9, *errs))
        except Exception as exc:  # noqa: BLE001
            print(f"{name}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            if args.v:
                traceback.print_exc()
    print(f"\nP4096 B8 L3584: {n_tokens} tokens, {pairs / 1e6:.1f} M pairs/head, dk/dv {flop / 1e12:.2f} TFLOP")
    print(f"{'kernel':60s} {'ms':>8s} {'TFLOP/s':>8s} {'dk err':>9s} {'dv err':>9s}")
    for name, ms, tflops, dk_err, dv_err in rows:
        print(f"{name:60s} {ms:8.3f} {tflops:8.1f} {dk_err:9.2e} {dv_err:9.2e}")
    base = next((out for name, out in outputs.items() if name.startswith("triton")), None)
    for name, (dk, dv) in outputs.items():
        if base is not None and name.startswith("gluon"):
            print(f"{name} vs triton shipped: max |dk diff| {(dk.float() - base[0].float()).abs().max().item():.2e}"
                  f" max |dv diff| {(dv.float() - base[1].float()).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
