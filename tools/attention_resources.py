"""Offline resource report of the tree-attention kernels for Hopper (sm_90), no GPU needed.

Compiles each kernel for ``GPUTarget("cuda", 90, 32)`` with the same specialisation the JIT
gives 16-byte aligned pointers (without it Triton does not pipeline the K/V loads at all), and
reads shared memory, registers, stack and the SASS (wgmma count, local-memory spills) with the
``cuobjdump`` shipped in Triton's wheel. Used to pick launch configs before timing them on a GPU:

    python tools/attention_resources.py 256 16 2          # Qwen3-Next full attention
    python tools/attention_resources.py 192 16 16 128     # Kimi Linear MLA (q/k 192, v 128)
"""
from __future__ import annotations

import sys

from hopper_resources import hopper_resources  # tools/, this script's folder

from harts_compiler.codegen.kernels.tree_attention.backward import tree_attn_bwd_dkdv_kernel, tree_attn_bwd_dq_kernel
from harts_compiler.codegen.kernels.tree_attention.configs import KernelConfig, config_for
from harts_compiler.codegen.kernels.tree_attention.forward import split_head_dim, tree_attn_fwd_kernel

KERNELS = {"fwd": tree_attn_fwd_kernel, "dq": tree_attn_bwd_dq_kernel, "dkdv": tree_attn_bwd_dkdv_kernel}
FP32_POINTERS = {"lse", "delta"}
INT32_POINTERS = {"subtree_end", "q_ptr", "q_cols", "q_full", "q_order", "k_ptr", "k_rows", "k_full", "k_order"}
FP32_SCALARS = {"scale", "scale_log2"}


def _signature(fn, dtype: str, descriptors: dict) -> dict:
    """Triton types of the kernel's runtime arguments, read from its own argument list (so this tool follows
    the kernels); `descriptors`: block shape of each tensor-descriptor argument. Constexprs are added by the caller."""
    runtime = [name for i, name in enumerate(fn.arg_names) if i not in fn.constexprs]
    types = {}
    for name in runtime:
        if name in descriptors:
            types[name] = f"tensordesc<{dtype}[{','.join(map(str, descriptors[name]))}]>"
        elif name in FP32_POINTERS:
            types[name] = "*fp32"
        elif name in INT32_POINTERS:
            types[name] = "*i32"
        elif name in FP32_SCALARS:
            types[name] = "fp32"
        elif name.isupper() or name == "q_offset":  # sizes: TQ, TK, q_offset
            types[name] = "i32"
        else:  # q, k, v, o, do, dq, dk, dv
            types[name] = f"*{dtype}"
    return types


def compile_report(kind: str, head_dim: int, n_q_heads: int, n_kv_heads: int, config: KernelConfig,
                   dtype: str = "bf16", value_dim: int | None = None, suffix_queries: bool = False) -> dict:
    """Compile one kernel ("fwd", "dq" or "dkdv") of `config` for sm_90; return its resources."""
    fn = KERNELS[kind]
    launch = {"fwd": config.fwd, "dq": config.dq, "dkdv": config.dkdv}[kind]
    first, rest = split_head_dim(head_dim)
    value_dim = value_dim or head_dim
    constexprs = dict(HQ=n_q_heads, HKV=n_kv_heads, D=head_dim, D1=first, D2=rest, DV=value_dim,
                      BM=launch["block_m"], BN=launch["block_n"], HAS_OFFSET=suffix_queries, INTERPRET=False)
    if kind == "fwd":  # score rows: block_m tokens of each of `heads` query heads
        constexprs["BM"] *= launch.get("heads", 1)
        constexprs["PACK"] = launch.get("heads", 1)
    else:
        constexprs["BMS"] = min(launch["block_ms"], launch["block_m"])
    bn, rows = launch["block_n"], constexprs.get("BMS")
    descriptors = {}  # as the host builds them: a kernel with a second tile argument takes descriptors
    if "k2" in fn.arg_names:
        descriptors.update(k=[bn, first], k2=[bn, rest or first], v=[bn, value_dim])
    if "q2" in fn.arg_names:
        descriptors.update(q=[rows, first], q2=[rows, rest or first], do=[rows, value_dim])
    signature = _signature(fn, dtype, descriptors)
    signature.update({name: "constexpr" for name in constexprs})
    report = hopper_resources(fn, signature, constexprs, num_warps=launch["num_warps"],
                              num_stages=launch["num_stages"], aligned_pointers=True)
    return dict(kind=kind, **report)


def main(argv: list[str]) -> None:
    """Arguments: head_dim n_q_heads n_kv_heads [value_dim] (default 256 16 2; MLA: 192 16 16 128)."""
    numbers = [int(a) for a in argv]
    head_dim, n_q_heads, n_kv_heads = numbers[:3] if numbers else (256, 16, 2)
    value_dim = numbers[3] if len(numbers) > 3 else head_dim
    config = config_for(head_dim, value_dim)
    for kind in KERNELS:
        print(compile_report(kind, head_dim, n_q_heads, n_kv_heads, config, value_dim=value_dim))


if __name__ == "__main__":
    main(sys.argv[1:])
