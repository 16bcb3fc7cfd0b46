"""Tree attention kernel by kernel on Hopper: the Triton launches against the Gluon ones, same run.

    python bench/attention_kernels.py                        # P4096 B8 L3584, gqa (16/2 heads, head dim 256)
    python bench/attention_kernels.py --shape mla --anchor 16384,8,2048

Times the forward, dq and dk/dv kernels of the shipped Triton config and of the Gluon kernels (the shipped
Gluon launches, the other consumer partitioning of each, ring depths one deeper / shallower and the dk/dv
kernel's other orientation of two consumers, key-major or query-major; a launch that
does not fit in shared memory is reported as such), all on one block index and the same bf16 inputs,
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
from attention import SHAPES, device_block_index, random_qkv  # noqa: E402
from common import format_table, kernel_ms, rel_error  # noqa: E402
from harts_compiler.codegen.kernels.tree_attention import config_for, tree_attention_fp32_oracle  # noqa: E402
from harts_compiler.codegen.kernels.tree_attention.backward import bwd_delta, bwd_dkdv, bwd_dq  # noqa: E402
from harts_compiler.codegen.kernels.tree_attention.forward import tree_attention_forward  # noqa: E402
from tree_layouts import anchor_tree  # noqa: E402


RING = {"fwd": "num_stages", "dq": "k_stages", "dkdv": "stages"}  # the ring depth each Gluon launch names


def variants(gluon: dict) -> dict:
    """Per kernel: the shipped Gluon launch, the other consumer partitioning, its ring one deeper and (above the
    minimum of 2) one shallower; dq also with its V ring one deeper, dk/dv also with two consumers in the other
    orientation."""
    out = {}
    for kind, launch in gluon.items():
        ring = RING[kind]
        other = dict(launch, consumers=3 - launch["consumers"])
        if kind == "dkdv":  # key-major needs two consumers: the other partitioning is query-major
            other["key_major"] = False
        alts = [launch, other, dict(launch, **{ring: launch[ring] + 1})]
        if launch[ring] > 2:
            alts.append(dict(launch, **{ring: launch[ring] - 1}))
        if kind == "dq":
            alts.append(dict(launch, v_stages=launch["v_stages"] + 1))
        if kind == "dkdv":
            alts.append(dict(launch, consumers=2, key_major=not launch.get("key_major", False)))
        out[kind] = alts
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--anchor", default="4096,8,3584", help="root P, branches B, branch length L")
    parser.add_argument("--shape", default="gqa", choices=sorted(SHAPES))
    parser.add_argument("--rep-ms", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm_90 (Hopper) GPU")
        return 2
    from harts_compiler.codegen.kernels.tree_attention import backward_dkdv_gluon, backward_gluon, forward_gluon

    device, dtype = torch.device("cuda"), torch.bfloat16
    shape = SHAPES[args.shape]
    hq, hkv = shape.hq, shape.hkv
    layout = anchor_tree(*(int(x) for x in args.anchor.split(",")))
    config = config_for(shape.d, shape.dv)
    if config.gluon is None:
        print(f"{args.shape}: the config names no Gluon launches")
        return 2
    gluon = variants(config.gluon)
    subtree_end = layout.subtree_end_tensor(device)
    q, k, v, do = random_qkv(layout.num_tokens, shape, 0, device, dtype)
    scale = shape.d ** -0.5
    tiles = [*config.tiles, *((g["block_m"], g["block_n"]) for launches in gluon.values() for g in launches)]
    index = device_block_index(subtree_end, tiles, layout.num_tokens)
    ends = layout.subtree_end.astype(np.int64)
    pairs = int((ends - np.arange(ends.size)).sum())
    qk, pv = pairs * hq * shape.d, pairs * hq * shape.dv  # multiply-adds of one q k^T / one p v over the pairs
    # fwd: s, o; dq: s, dp, dq; dk/dv: s, dp, dv, dk (2 flop a multiply-add)
    flop = {"fwd": 2.0 * (qk + pv), "dq": 2.0 * (2 * qk + pv), "dkdv": 2.0 * (2 * qk + 2 * pv)}

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
        try:
            out = run()
        except Exception as exc:  # a ring too deep for shared memory: reported, the rest still runs
            rows.append(dict(kernel=kind, impl=kernels, launch=str(launch), err=f"failed: {type(exc).__name__}"))
            continue
        triton_out.setdefault(kind, out)  # the Triton run of each kernel comes first
        ms = kernel_ms(run, device, rep_ms=args.rep_ms)
        rows.append(dict(kernel=kind, impl=kernels, launch=str(launch), ms=ms, tflops=flop[kind] / ms / 1e9,
                         err=" ".join(f"{rel_error(a, b):.2e}" for a, b in zip(out, refs[kind])),
                         diff=" ".join(f"{(a.float() - b.float()).abs().max().item():.1e}"
                                       for a, b in zip(out, triton_out[kind]))))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; anchor {args.anchor}: {layout.num_tokens} "
          f"tokens, {pairs / 1e6:.1f} M visible pairs a head, {args.shape}: {hq}/{hkv} heads, head dims "
          f"{shape.d}/{shape.dv}, bf16")
    print(format_table(rows, [("kernel", "kernel"), ("impl", "impl"), ("launch", "launch"), ("ms", "ms"),
                              ("tflops", "TFLOP/s"), ("err", "err vs fp32"), ("diff", "max |diff| vs Triton")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
