"""Registers, spills and shared memory of the GDN, KDA, conv and RMS-norm kernels on Hopper, without a GPU.

Compiles each kernel ahead of time for sm_90a with the production constexprs (bf16, H=16, K=V=128,
BT=64) and reads ptxas's resource report. Spills and register pressure explain most slow kernels, and
it needs no GPU:  python bench/gdn_resources.py [--warps 2 4 8]
"""
from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

from harts_compiler.codegen.kernels.causal_conv import function as conv
from harts_compiler.codegen.kernels.chunk_gdn import chunk_bwd, l2norm, state_bwd, state_fwd, wy_fwd
from harts_compiler.codegen.kernels.chunk_kda import chunk_bwd as kda_chunk_bwd
from harts_compiler.codegen.kernels.chunk_kda import diag_bwd, intra_bwd, intra_fwd
from harts_compiler.codegen.kernels.chunk_kda import state_bwd as kda_state_bwd
from harts_compiler.codegen.kernels.chunk_kda import state_fwd as kda_state_fwd
from harts_compiler.codegen.kernels.moe_combine import kernels as moe_combine
from harts_compiler.codegen.kernels.rmsnorm import kernels as rmsnorm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))  # fixtures, offline tools
from hopper_resources import hopper_resources  # noqa: E402

# pointer arguments by name (everything else below is a scalar or a constexpr)
POINTERS = {
    "fp32": {"g", "gc", "T", "h0", "bank", "dh0", "bank_grad", "dq", "dk", "dw", "dgc", "dbeta", "dg",
             "scratch", "rstd", "dv_f32", "gpre", "dw_part", "side_dbeta", "side_dg", "Aqk", "dAqk", "dAkk", "dq_p",
             "dk_p", "dgc_p", "dbeta_p", "side_dk", "q_rstd", "k_rstd", "dq_inv", "dk_inv", "dy_inv",
             "dk_out_inv"},
    "i64": {"chunk_row_start", "chunk_row_end", "cu_seqlens", "seq_chunk_start", "pred", "succ_ptr", "succ_flat",
            "row_src", "row_own", "seq_export_start", "export_end_chunk", "export_end_slot", "seq_shift", "chunk_shift",
            "h0_row", "block_degree", "seq_order"},
    "i32": set(),
}
SCALARS = {"scale": "fp32", "eps": "fp32", "n_rows": "i32", "Ch": "i32", "max_deg": "i32", "sx": "i64", "st": "i64",
           "g_per": "i32", "g_stride": "i64", "rows_total": "i32"}
BASE = dict(HK=16, HV=16, K=128, V=128, BT=64, BV=64, BK=64, INTERPRET=False, D=128, BR=16, W=4, BC=64, G=1,
            SILU=True, GATHER=False, TMA=False, QDO=0, LOCAL_DV=False, HAS_TAIL=False, WEIGHTED=True, RSTD=True,
            SCALED=False, SCALED_OUT=False, NB=1)


# the scans' tensor descriptors (chunk_gdn/tma.py) with TMA=1: tile rows and columns by constexpr name
DESCRIPTORS = {"k_desc": ("BT", "K"), "w_desc": ("BT", "K"), "q_desc": ("BT", "K"), "u_desc": ("BT", "BV"),
               "do_desc": ("BT", "BV"), "at_desc": ("BT", "BT")}


def signature_of(fn, constexprs, overrides, data_kind="bf16"):
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif constexprs.get("TMA") and name in DESCRIPTORS:
            rows, cols = (constexprs[c] for c in DESCRIPTORS[name])
            sig[name] = f"tensordesc<{data_kind}[{rows},{cols}]>"
        elif name in overrides:
            sig[name] = overrides[name]
        elif name in SCALARS:
            sig[name] = SCALARS[name]
        else:
            kind = next((k for k, names in POINTERS.items() if name in names), data_kind)
            sig[name] = "*" + kind
    return sig


def resources(fn, num_warps, constexprs, overrides=None, num_stages=3, data_kind="bf16", aligned=False):
    params = inspect.signature(fn.fn).parameters
    # a name the overrides type as an argument is not BASE's constexpr of that name (the norms' weight W)
    consts = {k: v for k, v in {**BASE, **constexprs}.items() if k in params and k not in (overrides or {})}
    sig = signature_of(fn, consts, overrides or {}, data_kind)
    # aligned=False: pointers without the JIT's 16-byte divisibility hint (the worst case: any pointer);
    # aligned=True: as the JIT compiles for torch's allocations (vectorised loads)
    return hopper_resources(fn, sig, consts, num_warps=num_warps, num_stages=num_stages, aligned_pointers=aligned)


COMBINE_PTRS = {"POS": "*i64", "W": "*bf16", "DW": "*bf16", "hidden_dim": "i32"}
RMSNORM_PTRS = {"W": "*bf16", "G": "*bf16", "RSTD": "*fp32", "DW_PART": "*fp32", "n_rows": "i32", "dim": "i32",
                "eps": "fp32"}

# the backward scan's A^T buffer (dv_local = A^T do, in do's dtype) and its first chunk
GATED_AT_BUFFER = {"at": "*bf16", "at_chunk0": "i32"}

# the conv at its launch tiles (causal_conv.function)
CONV_FWD = {"BT": conv.FWD_BLOCK_T, "BC": conv.FWD_BLOCK_C}
CONV_BWD = {"BT": conv.BLOCK_T, "BC": conv.BLOCK_C}

KERNELS = [
    ("wy_kkt_solve", wy_fwd._wy_kkt_solve_kernel, {}, {"T": "*bf16"}),
    ("wy_wu", wy_fwd._wy_wu_kernel, {}, {"T": "*bf16"}),
    ("state_fwd scan", state_fwd._state_fwd_kernel, {}, None),
    ("output_fwd", state_fwd._output_kernel, {}, None),
    ("gated_at", state_bwd._gated_at_kernel, {}, {"at": "*bf16", "c_first": "i32"}),
    ("state_bwd scan", state_bwd._state_bwd_kernel, {"LOCAL_DV": True}, GATED_AT_BUFFER),
    ("state_bwd scan (A^T buffer)", state_bwd._state_bwd_kernel, {}, GATED_AT_BUFFER),
    ("chunk_bwd_qk", chunk_bwd._chunk_bwd_qk_kernel, {}, {"dw": "*bf16"}),
    ("wy_bwd", chunk_bwd._wy_bwd_kernel, {}, {"dk_out": "*bf16", "T": "*bf16", "dw": "*bf16", "scratch": "*bf16"}),
    ("l2norm fwd", l2norm._l2norm_fwd_kernel, {}, None),
    ("l2norm bwd", l2norm._l2norm_bwd_kernel, {}, None),
    # dq and dk as block-scaled fp16 (codegen/kernels/scaled16.py: the 16-bit inputs' path)
    ("chunk_bwd_qk scaled", chunk_bwd._chunk_bwd_qk_kernel, {"SCALED": True},
     {"dw": "*bf16", "dq": "*fp16", "dk": "*fp16"}),
    ("wy_bwd scaled", chunk_bwd._wy_bwd_kernel, {"SCALED": True, "SCALED_OUT": True},
     {"dk": "*fp16", "dk_out": "*fp16", "T": "*bf16", "dw": "*bf16", "scratch": "*bf16"}),
    ("l2norm bwd scaled", l2norm._l2norm_bwd_kernel, {"SCALED": True, "G": 2, "NB": 2}, {"dy": "*fp16"}),
    ("conv fwd", conv._conv_fwd_kernel, CONV_FWD, {"T": "i32"}),
    ("conv bwd pre", conv._conv_bwd_pre_kernel, CONV_BWD, {"T": "i32"}),
    ("conv bwd dx", conv._conv_bwd_dx_kernel, CONV_BWD, {"T": "i32"}),
    # a piece's conv, with carried input rows after its own
    ("conv fwd tail", conv._conv_fwd_kernel, {**CONV_FWD, "HAS_TAIL": True}, {"T": "i32"}),
    ("conv bwd pre tail", conv._conv_bwd_pre_kernel, {**CONV_BWD, "HAS_TAIL": True}, {"T": "i32"}),
    ("conv bwd dx tail", conv._conv_bwd_dx_kernel, {**CONV_BWD, "HAS_TAIL": True}, {"T": "i32"}),
    # KDA at Kimi Linear's shapes (32 heads of 128; KDAKernelConfig's tiles)
    ("kda diag_fwd", intra_fwd._diag_fwd_kernel, {"HK": 32, "HV": 32, "BH": 4}, None),
    ("kda intra_fwd", intra_fwd._intra_fwd_kernel, {"HK": 32, "HV": 32, "BK": 32}, None),
    ("kda solve", intra_fwd._solve_kernel, {"HV": 32}, None),
    ("kda wu", intra_fwd._wu_kernel, {"HK": 32, "HV": 32, "BK": 64}, None),
    ("kda intra_bwd", intra_bwd._intra_bwd_kernel, {"HK": 32, "HV": 32, "BK": 32}, None),
    ("kda diag_bwd", diag_bwd._diag_bwd_kernel, {"HK": 32, "HV": 32, "BH": 4}, None),
    # RMS norms at their launch (rmsnorm.launch): the decoder norm's 2048-wide rows, GDN's gated 128-wide rows
    ("rmsnorm fwd 2048", rmsnorm._rms_norm_fwd_kernel, {"MODE": 0, "BLOCK_D": 2048, "ROWS": 1}, RMSNORM_PTRS),
    ("rmsnorm bwd 2048", rmsnorm._rms_norm_bwd_kernel, {"MODE": 0, "BLOCK_D": 2048, "ROWS": 1}, RMSNORM_PTRS),
    ("rmsnorm fwd gated", rmsnorm._rms_norm_fwd_kernel, {"MODE": 2, "BLOCK_D": 128, "ROWS": 16}, RMSNORM_PTRS),
    ("rmsnorm bwd gated", rmsnorm._rms_norm_bwd_kernel, {"MODE": 2, "BLOCK_D": 128, "ROWS": 16}, RMSNORM_PTRS),
    # MoE combine at its launch (moe_combine.launch) for Qwen3-Next's 2048-wide rows, 4 slots + gated shared
    ("combine fwd", moe_combine._combine_fwd_kernel, {"TOP_K": 4, "MODE": 2, "BLOCK_H": 2048}, COMBINE_PTRS),
    ("combine bwd", moe_combine._combine_bwd_kernel, {"TOP_K": 4, "K_PAD": 4, "MODE": 2, "BLOCK_H": 2048},
     COMBINE_PTRS),
    ("dispatch bwd", moe_combine._combine_fwd_kernel, {"TOP_K": 4, "MODE": 0, "BLOCK_H": 2048, "WEIGHTED": False},
     COMBINE_PTRS),
    ("kda scan fwd", kda_state_fwd._scan_fwd_kernel, {"HK": 32, "HV": 32}, None),
    ("kda output", kda_state_fwd._output_kernel, {"HK": 32, "HV": 32}, None),
    ("kda scan bwd", kda_state_bwd._scan_bwd_kernel, {"HK": 32, "HV": 32}, None),
    ("kda bwd_inter", kda_chunk_bwd._bwd_inter_kernel, {"HK": 32, "HV": 32}, None),
    ("kda wy_bwd", kda_chunk_bwd._wy_bwd_kernel, {"HK": 32, "HV": 32}, {"dv": "*fp32", "side_dv": "*fp32"}),
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--only", default=None, help="substring of a kernel name")
    parser.add_argument("--stages", type=int, default=3,
                        help="pipeline stages (the 16-bit scans run at 3: GDNKernelConfig.scan_stages_for)")
    parser.add_argument("--set", nargs="*", default=[],
                        help="constexpr overrides, e.g. BV=32 GATHER=1 (integers; 0 / 1 for flags)")
    parser.add_argument("--aligned", action="store_true",
                        help="give pointers the 16-byte divisibility hint the JIT sees for torch tensors")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                        help="element type of the q/k/v/o-like pointers (fp32: an fp32 model)")
    parser.add_argument("--digests", action="store_true",
                        help="also each compile's SASS digest: equal digests before and after a source change show "
                             "that it kept the machine code (unequal ones may differ only in instruction order or "
                             "registers; the TMA scans' code even moves with the source's line numbers)")
    args = parser.parse_args()
    extra = {}
    for item in args.set:
        name, _, value = item.partition("=")
        if not value.lstrip("-").isdigit():
            parser.error(f"--set {item}: expected NAME=INTEGER")
        extra[name] = int(value)
    print(f"{'kernel':16s} " + " ".join(f"{f'{w}w regs/stack/smem':>26s}" for w in args.warps))
    for name, fn, consts, overrides in KERNELS:
        if args.only and args.only not in name:
            continue
        cells = []
        for warps in args.warps:
            try:
                report = resources(fn, warps, {**consts, **extra}, overrides, args.stages, args.dtype, args.aligned)
                cells.append(f"{report['regs']:4d} / {report['stack']:6d} B / {report['shared'] // 1024:3d} KiB"
                             + (f" {report['sass_digest'][:10]}" if args.digests else ""))
            except Exception as exc:  # noqa: BLE001 - report and go on
                cells.append(f"failed: {type(exc).__name__}"[:26])
        print(f"{name:16s} " + " ".join(f"{c:>26s}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
