"""Offline resource report of the Gluon tree-attention kernels for Hopper (sm_90), no GPU needed.

Compiles ``forward_gluon.tree_attn_fwd_gluon_kernel`` and ``backward_gluon.tree_attn_bwd_dq_gluon_kernel`` for
``GPUTarget("cuda", 90, 32)`` as the JIT would for 16-byte aligned torch tensors, and prints shared memory, the
launch register count (maxnreg), the per-partition register budgets (USETMAXREG in the SASS), stack, wgmma /
TMA / spill instruction counts. Gluon differs between Triton releases; for the GPU machine's 3.6 run it with
that wheel first on the path:

    PYTHONPATH=/tmp/t36site python tools/attention_gluon_resources.py 256 16 2 [256] [--sass out.sass] [--dq]
    PYTHONPATH=/tmp/t36site python tools/attention_gluon_resources.py 192 16 16 128 --dkdv --block-n 128

``--dq``: the dq kernel only (K ring 2, V ring 1 at 128 x 64; smem q + do + 3 key tiles).
``--dkdv``: the dk/dv kernel only (backward_dkdv_gluon.py: 64-key blocks, 64-row q / do sub-tiles in 2-stage
rings; smem K + V + 2 x (q + do) + p + ds tiles, + an fp32 p tile with two consumer partitions; one consumer, two,
two key-major). ``wgmma_waits`` equal to ``wgmma`` means ptxas serialised every wgmma; ``wgmma_serialized`` then
gives ptxas's reason (C7512: registers; C7514 / C7515: an instruction between a wgmma and its wait that reads or
writes its accumulator).
"""
from __future__ import annotations

import argparse
import sys

import torch
from hopper_resources import hopper_resources  # tools/, this script's folder
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

from harts_compiler.codegen.kernels.tree_attention import backward_dkdv_gluon as bkg
from harts_compiler.codegen.kernels.tree_attention import backward_gluon as bg
from harts_compiler.codegen.kernels.tree_attention import forward_gluon as fg

INT32_POINTERS = {"subtree_end", "q_ptr", "q_cols", "q_full", "q_order", "k_ptr", "k_rows", "k_full", "k_order"}


def descriptor(heads: int, rows: int, cols: int):
    """A host descriptor on a CPU tensor: only its type string is used."""
    return fg.gluon_descriptor(torch.empty(256, heads, cols, dtype=torch.bfloat16), rows, cols)


def qk_descriptors(head_dim: int, n_q_heads: int, n_kv_heads: int, q_rows: int, k_rows: int) -> tuple[dict, dict]:
    """The q / k column-tile descriptors (q_desc, q2_desc, k_desc, k2_desc) and their D1 / D2 constexprs."""
    d1, d2 = fg.column_tiles(head_dim)
    return (dict(q_desc=descriptor(n_q_heads, q_rows, d1), q2_desc=descriptor(n_q_heads, q_rows, d2 or d1),
                 k_desc=descriptor(n_kv_heads, k_rows, d1), k2_desc=descriptor(n_kv_heads, k_rows, d2 or d1)),
            dict(D1=d1, D2=d2))


def signature_of(fn, constexprs: dict, descriptors: dict, fp32_pointers=(), bf16_pointers=(),
                 fp32_scalars=()) -> dict:
    """The JIT signature of a Gluon kernel: constexprs, descriptor types, int32 index pointers, the named fp32 /
    bf16 pointers and fp32 scalars, every other argument an int32 scalar (TQ, TK, q_offset)."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in descriptors:
            signature[name] = mangle_type(descriptors[name])
        elif name in INT32_POINTERS:
            signature[name] = "*i32"
        elif name in fp32_pointers:
            signature[name] = "*fp32"
        elif name in bf16_pointers:
            signature[name] = "*bf16"
        elif name in fp32_scalars:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    return signature


def compile_report(head_dim: int = 256, n_q_heads: int = 16, n_kv_heads: int = 2, value_dim: int | None = None,
                   block_m: int = 128, block_n: int = 64, consumers: int = 1, stages: int = 2,
                   suffix_queries: bool = False, sass_out: str | None = None, maxnreg: int | None = None) -> dict:
    value_dim = value_dim or head_dim
    num_warps = block_m // (16 * consumers)
    fn = fg.tree_attn_fwd_gluon_kernel

    descriptors, tiles = qk_descriptors(head_dim, n_q_heads, n_kv_heads, block_m, block_n)
    descriptors["v_desc"] = descriptor(n_kv_heads, block_n, value_dim)
    constexprs = dict(HQ=n_q_heads, HKV=n_kv_heads, D=head_dim, **tiles, DV=value_dim, BM=block_m, BN=block_n,
                      STAGES=stages, HAS_OFFSET=suffix_queries, CONSUMERS=consumers, num_warps=num_warps)
    signature = signature_of(fn, constexprs, descriptors, ("lse",), ("o",), ("scale_log2",))
    report = hopper_resources(fn, signature, constexprs, num_warps=num_warps, num_stages=1, aligned_pointers=True,
                              source_cls=GluonASTSource, options=dict(maxnreg=maxnreg or fg.MAXNREG), sass_out=sass_out)
    return dict(kind="fwd_gluon", consumers=consumers, stages=stages, **report)


def compile_dq_report(head_dim: int = 256, n_q_heads: int = 16, n_kv_heads: int = 2, value_dim: int | None = None,
                      block_m: int = 128, block_n: int = 64, consumers: int = 1, k_stages: int = 2,
                      v_stages: int = 1, suffix_queries: bool = False, sass_out: str | None = None,
                      maxnreg: int | None = None) -> dict:
    """As compile_report, for the Gluon dq kernel (backward_gluon.py)."""
    value_dim = value_dim or head_dim
    num_warps = block_m // (16 * consumers)
    fn = bg.tree_attn_bwd_dq_gluon_kernel

    descriptors, tiles = qk_descriptors(head_dim, n_q_heads, n_kv_heads, block_m, block_n)
    descriptors.update(v_desc=descriptor(n_kv_heads, block_n, value_dim),
                       do_desc=descriptor(n_q_heads, block_m, value_dim))
    constexprs = dict(HQ=n_q_heads, HKV=n_kv_heads, D=head_dim, **tiles, DV=value_dim, BM=block_m, BN=block_n,
                      K_STAGES=k_stages, V_STAGES=v_stages, HAS_OFFSET=suffix_queries, CONSUMERS=consumers,
                      num_warps=num_warps)
    signature = signature_of(fn, constexprs, descriptors, ("lse", "delta"), ("dq",), ("scale", "scale_log2"))
    report = hopper_resources(fn, signature, constexprs, num_warps=num_warps, num_stages=1, aligned_pointers=True,
                              source_cls=GluonASTSource, options=dict(maxnreg=maxnreg or bg.MAXNREG),
                              sass_out=sass_out)
    return dict(kind="dq_gluon", consumers=consumers, k_stages=k_stages, v_stages=v_stages, **report)


def compile_dkdv_report(head_dim: int = 256, n_q_heads: int = 16, n_kv_heads: int = 2, value_dim: int | None = None,
                        block_m: int = 128, block_n: int = 64, block_ms: int = 64, stages: int = 2, consumers: int = 1,
                        suffix_queries: bool = False, sass_out: str | None = None, maxnreg: int | None = None,
                        key_major: bool = False) -> dict:
    """As compile_report, for the Gluon dk/dv kernel (backward_dkdv_gluon.py)."""
    value_dim = value_dim or head_dim
    fn = bkg.tree_attn_bwd_dkdv_gluon_kernel

    descriptors, tiles = qk_descriptors(head_dim, n_q_heads, n_kv_heads, block_ms, block_n)
    descriptors.update(v_desc=descriptor(n_kv_heads, block_n, value_dim),
                       do_desc=descriptor(n_q_heads, block_ms, value_dim))
    constexprs = dict(HQ=n_q_heads, HKV=n_kv_heads, D=head_dim, **tiles, DV=value_dim, BM=block_m, BN=block_n,
                      BMS=block_ms, STAGES=stages, HAS_OFFSET=suffix_queries, CONSUMERS=consumers,
                      KEY_MAJOR=key_major, num_warps=8 // consumers)
    signature = signature_of(fn, constexprs, descriptors, ("lse", "delta"), ("dk", "dv"),
                             ("scale", "scale_log2"))
    report = hopper_resources(fn, signature, constexprs, num_warps=8 // consumers, num_stages=1,
                              aligned_pointers=True, source_cls=GluonASTSource,
                              options=dict(maxnreg=maxnreg or bkg.MAXNREG), sass_out=sass_out)
    return dict(kind="dkdv_gluon", consumers=consumers, key_major=key_major, stages=stages, **report)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dims", type=int, nargs="*", metavar="N",
                        help="head_dim q_heads kv_heads [value_dim] (default 256 16 2, value_dim = head_dim)")
    parser.add_argument("--sass", metavar="PATH", help="write each kernel's SASS to PATH.<kernel>")
    parser.add_argument("--dq", action="store_true", help="the dq kernel only")
    parser.add_argument("--dkdv", action="store_true", help="the dk/dv kernel only")
    parser.add_argument("--block-n", type=int, default=64, help="keys per block (default 64, the shipped launches)")
    args = parser.parse_args(argv)
    if len(args.dims) not in (0, 3, 4):
        parser.error("dims: give head_dim q_heads kv_heads and optionally value_dim")
    head_dim, n_q_heads, n_kv_heads = args.dims[:3] if args.dims else (256, 16, 2)
    value_dim = args.dims[3] if len(args.dims) > 3 else head_dim
    sass_out, dq_only, dkdv_only = args.sass, args.dq, args.dkdv
    if not dq_only:
        for consumers, key_major in ((1, False), (2, False), (2, True)):
            for suffix in (False, True):
                print(dict(suffix_queries=suffix, **compile_dkdv_report(
                    head_dim, n_q_heads, n_kv_heads, value_dim, block_n=args.block_n, consumers=consumers,
                    suffix_queries=suffix, key_major=key_major,
                    sass_out=f"{sass_out}.dkdv.c{consumers}{'k' * key_major}" if sass_out and not suffix else None)))
    if dkdv_only:
        return
    for consumers in (1, 2):
        for suffix in (False, True):
            if not dq_only:
                print(dict(suffix_queries=suffix, **compile_report(
                    head_dim, n_q_heads, n_kv_heads, value_dim, block_n=args.block_n, consumers=consumers,
                    suffix_queries=suffix,
                    sass_out=f"{sass_out}.c{consumers}" if sass_out and not suffix else None)))
            print(dict(suffix_queries=suffix, **compile_dq_report(
                head_dim, n_q_heads, n_kv_heads, value_dim, block_n=args.block_n, consumers=consumers,
                suffix_queries=suffix,
                sass_out=f"{sass_out}.dq.c{consumers}" if sass_out and not suffix else None)))


if __name__ == "__main__":
    main(sys.argv[1:])
