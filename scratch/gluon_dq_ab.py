"""Throwaway A/B: Triton vs Gluon tree-attention dq kernel on one H200, same run (delete after the A/B).

    python scratch/gluon_dq_ab.py [--rep-ms 200] [--no-check] [-v]

Builds P4096 B8 L3584 (32,768 tokens, 16/2 heads, D = DV = 256, bf16), runs the Triton forward for o and lse
and bwd_delta, then times the shipped Triton bwd_dq (``config_for(256).dq``), Triton bwd_dq at 128 x 64 with 8
warps and 2 stages, and the Gluon dq (1 and 2 consumer partitions) with triton.testing.do_bench, and checks
dq's error against the fp32 oracle (autograd through the chunked reference). A failing call prints one line
and the script goes on.
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
from harts_compiler.codegen.kernels.tree_attention.backward import bwd_delta, bwd_dq  # noqa: E402
from harts_compiler.codegen.kernels.tree_attention.forward import tree_attention_forward  # noqa: E402
from harts_compiler.codegen.kernels.upload import to_device  # noqa: E402


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
    flop = 2.0 * pairs * hq * (d + d + d)  # s = q k^T, dp = do v^T, dq += ds k

    o, lse = tree_attention_forward(q, k, v, subtree_end, index, scale, shipped.fwd)
    delta = bwd_delta(o, do)
    runs = {
        f"triton shipped {shipped.dq}": lambda: bwd_dq(q, k, v, do, lse, delta, subtree_end, index, scale,
                                                       shipped.dq),
        "triton 128x64 w8 s2": lambda: bwd_dq(q, k, v, do, lse, delta, subtree_end, index, scale,
                                              dict(block_m=128, block_n=64, num_warps=8, num_stages=2,
                                                   block_ms=128)),
    }
    try:
        from harts_compiler.codegen.kernels.tree_attention.backward_gluon import bwd_dq_gluon
        for consumers in (1, 2):
            launch = dict(block_m=128, block_n=64, k_stages=2, v_stages=1, consumers=consumers)
            runs[f"gluon 128x64 K2/V1, {consumers} consumer part."] = (
                lambda launch=launch: bwd_dq_gluon(q, k, v, do, lse, delta, subtree_end, index, scale, launch))
    except Exception as exc:  # noqa: BLE001
        print(f"gluon import failed: {exc!r}")

    dq_ref = None
    if not args.no_check:
        dq_ref = tree_attention_fp32_oracle(q, k, v, do, subtree_end, scale=scale)[1]
    outputs = {}
    rows = []
    for name, fn in runs.items():
        try:
            dq = fn()
            torch.cuda.synchronize()
            outputs[name] = dq
            ms = triton.testing.do_bench(fn, warmup=50, rep=args.rep_ms)
            err = float("nan") if dq_ref is None else ((dq.float() - dq_ref).norm() / dq_ref.norm()).item()
            rows.append((name, ms, flop / ms / 1e9, err))
        except Exception as exc:  # noqa: BLE001
            print(f"{name}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            if args.v:
                traceback.print_exc()
    print(f"\nP4096 B8 L3584: {n_tokens} tokens, {pairs / 1e6:.1f} M pairs/head, dq {flop / 1e12:.2f} TFLOP")
    print(f"{'kernel':60s} {'ms':>8s} {'TFLOP/s':>8s} {'dq err vs fp32':>15s}")
    for name, ms, tflops, err in rows:
        print(f"{name:60s} {ms:8.3f} {tflops:8.1f} {err:15.2e}")
    base = outputs.get("triton 128x64 w8 s2")
    for name, dq in outputs.items():
        if base is not None and name.startswith("gluon"):
            print(f"{name} vs triton 128x64: max |dq diff| {(dq.float() - base.float()).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
