"""Offline resource report of the tree-attention kernels for Hopper (sm_90), no GPU needed.

Compiles each kernel for ``GPUTarget("cuda", 90, 32)`` with the same specialisation the JIT
gives 16-byte aligned pointers (without it Triton does not pipeline the K/V loads at all), and
reads shared memory, registers, stack and the SASS (wgmma count, local-memory spills) with the
``cuobjdump`` shipped in Triton's wheel. Used to pick launch configs before timing them on a GPU:

    python tools/attention_resources.py 256 16 2
"""
from __future__ import annotations

import sys

from hopper_resources import hopper_resources  # tools/, this script's folder

from harts_compiler.codegen.kernels.tree_attention.backward import tree_attn_bwd_dkdv_kernel, tree_attn_bwd_dq_kernel
from harts_compiler.codegen.kernels.tree_attention.configs import CONFIGS, KernelConfig


def _signature(kind: str, dtype: str) -> dict:
    ptr, f32p, i32p = f"*{dtype}", "*fp32", "*i32"
    if kind == "fwd":
        sig = dict(q=ptr, k=ptr, v=ptr, o=ptr, lse=f32p, subtree_end=i32p, q_ptr=i32p,
                   q_cols=i32p, q_full=i32p, q_order=i32p, scale_log2="fp32", T="i32")
    elif kind == "dq":
        sig = dict(q=ptr, k=ptr, v=ptr, do=ptr, dq=ptr, lse=f32p, delta=f32p, subtree_end=i32p,
                   q_ptr=i32p, q_cols=i32p, q_full=i32p, q_order=i32p, scale="fp32",
                   scale_log2="fp32", T="i32")
    else:
        sig = dict(q=ptr, k=ptr, v=ptr, do=ptr, dk=ptr, dv=ptr, lse=f32p, delta=f32p,
                   subtree_end=i32p, k_ptr=i32p, k_rows=i32p, k_full=i32p, k_order=i32p,
                   scale="fp32", scale_log2="fp32", T="i32")
    return sig


def compile_report(kind: str, head_dim: int, n_q_heads: int, n_kv_heads: int,
                   config: KernelConfig, dtype: str = "bf16") -> dict:
    """Compile one kernel ("fwd", "dq" or "dkdv") of `config` for sm_90; return its resources."""
    from harts_compiler.codegen.kernels.tree_attention.forward import tree_attn_fwd_kernel
    fn = {"fwd": tree_attn_fwd_kernel, "dq": tree_attn_bwd_dq_kernel,
          "dkdv": tree_attn_bwd_dkdv_kernel}[kind]
    launch = {"fwd": config.fwd, "dq": config.dq, "dkdv": config.dkdv}[kind]
    constexprs = dict(HQ=n_q_heads, HKV=n_kv_heads, D=head_dim, BM=launch["block_m"],
                      BN=launch["block_n"], INTERPRET=False)
    signature = _signature(kind, dtype)
    if kind != "fwd":
        constexprs["BMS"] = min(launch["block_ms"], launch["block_m"])
    signature.update({name: "constexpr" for name in constexprs})
    report = hopper_resources(fn, signature, constexprs, num_warps=launch["num_warps"],
                              num_stages=launch["num_stages"], aligned_pointers=True)
    return dict(kind=kind, **report)


def main(argv: list[str]) -> None:
    head_dim, n_q_heads, n_kv_heads = (int(a) for a in argv[:3]) if argv else (256, 16, 2)
    config = CONFIGS[max(64, head_dim)]
    for kind in ("fwd", "dq", "dkdv"):
        print(compile_report(kind, head_dim, n_q_heads, n_kv_heads, config))


if __name__ == "__main__":
    main(sys.argv[1:])
