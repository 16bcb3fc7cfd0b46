"""Throwaway A/B: Triton vs Gluon tree-attention forward on one H200, same run (delete after the A/B).

    python scratch/gluon_fwd_ab.py [--rep-ms 200] [--no-check]

Builds P4096 B8 L3584 (32,768 tokens, 16/2 heads, D = DV = 256, bf16), times the shipped Triton forward
(64 tokens x 2 heads), the Triton forward at the Gluon kernel's tile (128 x 64, 8 warps, 2 stages) and the
Gluon forward with triton.testing.do_bench, and checks o's error against the fp32 oracle for each. A failing
Gluon call prints one line and the script goes on.
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

from harts_compiler.codegen.kernels.tree_attention import build_block_index, config_for  # noqa: E402
from harts_compiler.codegen.kernels.tree_attention.reference import tree_attention_reference_chunked  # noqa: E402
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
    subtree_end = layout.subtree_end_tensor("cuda")
    scale = d ** -0.5
    shipped = config_for(256)
    host_end = subtree_end.cpu().numpy()
    tiles = list(dict.fromkeys([*shipped.tiles, (128, 64)]))
    index = to_device(build_block_index(host_end, *tiles[0]).with_tiles(host_end, tiles[1:]), "cuda")
    ends = layout.subtree_end.astype(np.int64)
    pairs = int((ends - np.arange(ends.size)).sum())
    flop = 2.0 * pairs * hq * (d + d)

    runs = {
        "triton shipped (64x2 heads, 64)": lambda: tree_attention_forward(q, k, v, subtree_end, index, scale,
                                                                           shipped.fwd),
        "triton 128x64 w8 s2": lambda: tree_attention_forward(q, k, v, subtree_end, index, scale,
                                                              dict(block_m=128, block_n=64, num_warps=8,
                                                                   num_stages=2)),
    }
    try:
        from harts_compiler.codegen.kernels.tree_attention.forward_gluon import tree_attention_forward_gluon
        for consumers in (1, 2):
            launch = dict(block_m=128, block_n=64, num_stages=2, consumers=consumers)
            runs[f"gluon 128x64 ws, {consumers} consumer part."] = (
                lambda launch=launch: tree_attention_forward_gluon(q, k, v, subtree_end, index, scale, launch))
    except Exception as exc:  # noqa: BLE001
        print(f"gluon import failed: {exc!r}")

    o_ref = None
    if not args.no_check:
        torch.backends.cuda.matmul.allow_tf32 = False  # an fp32 oracle, not a tf32 one
        with torch.no_grad():
            o_ref = tree_attention_reference_chunked(q.float(), k.float(), v.float(), subtree_end, scale=scale)
    outputs = {}
    rows = []
    for name, fn in runs.items():
        try:
            o, lse = fn()
            torch.cuda.synchronize()
            outputs[name] = (o, lse)
            ms = triton.testing.do_bench(fn, warmup=50, rep=args.rep_ms)
            err = float("nan") if o_ref is None else ((o.float() - o_ref).norm() / o_ref.norm()).item()
            rows.append((name, ms, flop / ms / 1e9, err))
        except Exception as exc:  # noqa: BLE001
            print(f"{name}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            if args.v:
                traceback.print_exc()
    print(f"\nP4096 B8 L3584: {n_tokens} tokens, {pairs / 1e6:.1f} M pairs/head, fwd {flop / 1e12:.2f} TFLOP")
    print(f"{'kernel':34s} {'ms':>8s} {'TFLOP/s':>8s} {'o err vs fp32':>14s}")
    for name, ms, tflops, err in rows:
        print(f"{name:34s} {ms:8.3f} {tflops:8.1f} {err:14.2e}")
    base = outputs.get("triton 128x64 w8 s2")
    for name, (o, lse) in outputs.items():
        if base is not None and name.startswith("gluon"):
            print(f"{name} vs triton 128x64: max |o diff| {(o.float() - base[0].float()).abs().max().item():.2e}, "
                  f"max |lse diff| {(lse - base[1]).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
