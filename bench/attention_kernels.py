"""Tree attention kernel by kernel on Hopper: the Triton launches against the Gluon ones, same run.

    python bench/attention_kernels.py                        # P4096 B8 L3584, 16/2 heads, head dim 256
    python bench/attention_kernels.py --anchor 16384,8,2048

Times the forward, dq and dk/dv kernels of the shipped Triton config and of the Gluon kernels (the shipped
Gluon launches and the other consumer partitioning of each), all on one block index and the same bf16 inputs,
and reports ms, TFLOP/s over visible pairs and the error of each kernel's output against the fp32 oracle, plus
the largest difference from the Triton kernel's output. This is where the ``gluon`` launches in
``configs.py`` come from; ``bench/attention.py`` times the shipped path against cuDNN and FA2.
Needs an sm_90 GPU and a Triton with Gluon's Hopper API.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from attention import Shape, device_block_index, random_qkv, rel  # noqa: E402
from common import format_table, kernel_ms  # noqa: E402
from harts_compiler.codegen.kernels.tree_attention import config_for, tree_attention_fp32_oracle  # noqa: E402
from harts_compiler.codegen.kernels.tree_attention.backward import bwd_delta, bwd_dkdv, bwd_dq  # noqa: E402
from harts_compiler.codegen.kernels.tree_attention.forward import tree_attention_forward  # noqa: E402
from tree_layouts import anchor_tree  # noqa: E402


def variants(gluon: dict) -> dict:
    """Per kernel: the shipped Gluon launch and the same launch with the other consumer partitioning."""
    return {kind: [launch, dict(launch, consumers=3 - launch["consumers"])] for kind, launch in gluon.items()}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--anchor", default="4096,8,3584", help="root P, branches B, branch length L")
    parser.add_argument("--heads", default="16,2", help="query heads, KV heads")
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--rep-ms", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm_90 (Hopper) GPU")
        return 2
    from harts_compiler.codegen.kernels.tree_attention import backward_dkdv_gluon, backward_gluon, forward_gluon

    device, dtype = torch.device("cuda"), torch.bfloat16
    hq, hkv = (int(x) for x in args.heads.split(","))
    shape = Shape(hq, hkv, args.head_dim, args.head_dim)
    layout = anchor_tree(*(int(x) for x in args.anchor.split(",")))
    config = config_for(shape.d)
    if config.gluon is None:
        print(f"head dim {shape.d}: the config names no Gluon launches")
        return 2
    gluon = variants(config.gluon)
    subtree_end = layout.subtree_end_tensor(device)
    q, k, v, do = random_qkv(layout.num_tokens, shape, 0, device, dtype)
    scale = shape.d ** -0.5
    tiles = [*config.tiles, *((g["block_m"], g["block_n"]) for launches in gluon.values() for g in launches)]
    index = device_block_index(subtree_end, tiles, layout.num_tokens)
    ends = layout.subtree_end.astype(np.int64)
    pairs = int((ends - np.arange(ends.size)).sum())
    mac = pairs * hq * shape.d  # one q k^T (or p v, ...) over the visible pairs
    flop = {"fwd": 2.0 * 2 * mac, "dq": 2.0 * 3 * mac, "dkdv": 2.0 * 4 * mac}  # dq: s, dp, dq; dk/dv: s, dp, dv, dk

    torch.backends.cuda.matmul.allow_tf32 = False  # an fp32 oracle, not a tf32 one
    ref = tree_attention_fp32_oracle(q, k, v, do, subtree_end, scale=scale, query_chunk=512)
    o, lse = tree_attention_forward(q, k, v, subtree_end, index, scale, config.fwd)
    delta = bwd_delta(o, do)
    grad_args = (q, k, v, do, lse, delta, subtree_end, index, scale)
    runs = [("fwd", "triton", config.fwd, lambda: tree_attention_forward(q, k, v, subtree_end, index, scale,
                                                                         config.fwd)[:1]),
            ("dq", "triton", config.dq, lambda: [bwd_dq(*grad_args, config.dq)]),
            ("dkdv", "triton", config.dkdv, lambda: list(bwd_dkdv(*grad_args, config.dkdv)))]
    for launch in gluon["fwd"]:
        runs.append(("fwd", "gluon", launch, lambda launch=launch: forward_gluon.tree_attention_forward_gluon(
            q, k, v, subtree_end, index, scale, launch)[:1]))
    for launch in gluon["dq"]:
        runs.append(("dq", "gluon", launch, lambda launch=launch: [backward_gluon.bwd_dq_gluon(*grad_args, launch)]))
    for launch in gluon["dkdv"]:
        runs.append(("dkdv", "gluon", launch,
                     lambda launch=launch: list(backward_dkdv_gluon.bwd_dkdv_gluon(*grad_args, launch))))
    refs = {"fwd": ref[:1], "dq": ref[1:2], "dkdv": ref[2:]}
    rows, triton_out = [], {}
    for kind, kernels, launch, run in runs:
        out = run()
        triton_out.setdefault(kind, out)  # the Triton run of each kernel comes first
        ms = kernel_ms(run, device, rep_ms=args.rep_ms)
        rows.append(dict(kernel=kind, impl=kernels, launch=str(launch), ms=ms, tflops=flop[kind] / ms / 1e9,
                         err=" ".join(f"{rel(a, b):.2e}" for a, b in zip(out, refs[kind])),
                         diff=" ".join(f"{(a.float() - b.float()).abs().max().item():.1e}"
                                       for a, b in zip(out, triton_out[kind]))))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; anchor {args.anchor}: {layout.num_tokens} "
          f"tokens, {pairs / 1e6:.1f} M visible pairs a head, {hq}/{hkv} heads, head dim {shape.d}, bf16")
    print(format_table(rows, [("kernel", "kernel"), ("impl", "impl"), ("launch", "launch"), ("ms", "ms"),
                              ("tflops", "TFLOP/s"), ("err", "err vs fp32"), ("diff", "max |diff| vs Triton")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
