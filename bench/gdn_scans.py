"""The two GDN state scans alone, under every launch (columns, warps, pipeline stages), per round shape.

The scans are the sequential part of a GDN step, and which launch is fastest depends on how many
(sequence, head) pairs a call has: a lone 16k-token root is latency-bound, 42 trajectories are bound by
memory. `GDNKernelConfig.scan_launch_for` encodes the choice; this script measures it, one table per
case (fwd + bwd scan ms, bf16, 16 key heads, 16 value heads unless --value-heads, K = V = 128), in one run:

    python bench/gdn_scans.py [--cases root1 roots6 ...] [--quick] 2>&1 | tee $OUT/gdn_scans.log

Cases: the rounds of bench/gdn.py's trees and the trajectory-wise calls (`row maps`: the tree rounds read
their rows through index.PackedRows, as the runtime's agentic rounds do; the others read rows in place).
"""
from __future__ import annotations

import argparse

import torch

from common import kernel_ms
from gdn_cases import agentic_trees, make_inputs
from harts_compiler.codegen.kernels.chunk_gdn import GDNKernelConfig, prepare_gdn_index
from harts_compiler.codegen.kernels.chunk_gdn.index import PackedRows
from harts_compiler.codegen.kernels.chunk_gdn.state_bwd import state_bwd_scan
from harts_compiler.codegen.kernels.chunk_gdn.state_fwd import state_fwd

CHUNK = 64


def cases() -> dict[str, tuple[list[int], bool]]:
    """name -> (sequence lengths, whether rows are read through row maps)."""
    trees = agentic_trees()
    replay = [p % CHUNK for p, _, _ in trees]  # a branch replays its root's rows after the aligned boundary
    return {
        "root1": ([16384], False),                                  # P16384 B8 L2048, round 0
        "branches8": ([2048] * 8, False),                           # its round 1
        "traj8": ([7680] * 8, False),                               # P4096 B8 L3584, trajectory-wise
        "roots6": ([p for p, _, _ in trees], True),                 # agentic, round 0
        "branches42": ([r + n for (_, b, n), r in zip(trees, replay) for _ in range(b)], True),  # round 1
        "traj42": ([p + n for p, b, n in trees for _ in range(b)], False),  # agentic, trajectory-wise
    }


LAUNCHES = [(16, 2), (32, 2), (16, 4), (32, 4), (64, 4)]  # (columns, warps); 64 at 2 warps spills


def forced(block_v: int, warps: int, stages: int, tma: bool = GDNKernelConfig.scan_tma) -> GDNKernelConfig:
    """A config whose scans always launch with (block_v, warps, stages), with or without descriptor loads
    at any width (`tma`: GDNKernelConfig.scan_tma), whatever the program count; past 3 stages (16 columns only:
    GDNKernelConfig.narrow_scan_stages) the backward scan stops at 4."""
    launch = dict(scan_block_v=block_v, scan_warps=warps, scan_min_programs=0, scan_tma=tma, scan_tma_max_block_v=128)
    if stages > 3:
        return GDNKernelConfig(**launch, narrow_scan_stages=(stages, min(stages, 4)))
    return GDNKernelConfig(**launch, scan_num_stages=stages)


def time_case(lengths, row_maps, launches, device, value_heads=16, affine=False, tma=GDNKernelConfig.scan_tma):
    q, k, v = make_inputs(lengths, hk=min(16, value_heads), hv=value_heads, device=device)[0][:3]
    rows_total, hv, vd = v.shape
    kd = k.shape[2]
    gen = torch.Generator(device).manual_seed(1)
    w = (torch.randn(rows_total, hv, kd, device=device, generator=gen) * 0.1).to(k.dtype)
    u = (torch.randn(rows_total, hv, vd, device=device, generator=gen) * 0.1).to(k.dtype)
    gc = torch.zeros(rows_total, hv, device=device)  # the gates' values do not change the timing
    do = torch.randn_like(u)
    dv_local = torch.randn(rows_total, hv, vd, device=device, generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()))
    h0 = torch.zeros(len(lengths), hv, kd, vd, device=device)
    rows = None
    if row_maps:
        ids = torch.arange(rows_total, device=device)
        shift = torch.zeros(len(lengths), dtype=torch.int64, device=device) if affine else None
        rows = PackedRows(src=ids, own=ids, num_tokens=rows_total, num_replays=0, seq_shift=shift)
    results, split = {}, {}
    for block_v, warps, stages in launches:
        try:  # a config outside GDNKernelConfig's range or a launch over the shared-memory limit: report, go on
            index = prepare_gdn_index(cu, chunk_size=CHUNK, device=device, config=forced(block_v, warps, stages, tma))
            dh = torch.empty(index.num_chunks, hv, kd, vd, device=device, dtype=k.dtype)
            dvn = torch.empty_like(u)
            bank_grad = torch.zeros(0, hv, kd, vd, device=device)

            def fwd():
                state_fwd(k, w, u, gc, h0, index, rows=rows)

            def bwd():
                state_bwd_scan(q, k, w, gc, do, dv_local, bank_grad, 0.1, index, dh, dvn, rows=rows)
            fwd_ms, bwd_ms = (kernel_ms(fn, device, rep_ms=60, warmup_ms=15) for fn in (fwd, bwd))
            results[(block_v, warps, stages)] = fwd_ms + bwd_ms
            split[(block_v, warps, stages)] = (fwd_ms, bwd_ms)
        except Exception as err:  # ValueError from the config, triton OutOfResources (not a RuntimeError)
            results[(block_v, warps, stages)] = float("nan")
            print(f"  {block_v} cols {warps} warps {stages} stages: {type(err).__name__}: {err}", flush=True)
    for (block_v, warps, stages), (fwd_ms, bwd_ms) in split.items():
        print(f"  {block_v} cols {warps} warps {stages} stages tma {tma}: fwd {fwd_ms:.3f} + bwd {bwd_ms:.3f} ms",
              flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(cases()), choices=list(cases()))
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], help="pipeline stages to try (1-3 "
                        "for any launch, 4-6 at 16 columns: GDNKernelConfig.narrow_scan_stages; session 7 found 5 no "
                        "better than 3 with row maps)")
    parser.add_argument("--launches", nargs="+", default=None, metavar="BV:WARPS",
                        help="(columns, warps) pairs, default: " + " ".join(f"{b}:{w}" for b, w in LAUNCHES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--value-heads", type=int, default=16, help="32: the e2e model's (Qwen3-Next's) GDN")
    parser.add_argument("--affine", action="store_true", help="row-map cases read rows after each first chunk "
                        "at row + shift (GDNKernelConfig.tree_affine_scan_rows)")
    parser.add_argument("--tma", type=int, nargs="+", default=[int(GDNKernelConfig.scan_tma)], choices=[0, 1],
                        help="time with descriptor loads (1) and / or pointers only (0) (GDNKernelConfig.scan_tma), "
                             "each a table of its own")
    parser.add_argument("--shrink", type=int, default=1, help="divide every length (a CPU smoke test under "
                        "TRITON_INTERPRET=1 with --shrink 64)")
    args = parser.parse_args()
    device = torch.device(args.device)
    pairs = [tuple(int(x) for x in p.split(":")) for p in args.launches] if args.launches else LAUNCHES
    print(torch.cuda.get_device_name() if device.type == "cuda" else device, flush=True)
    summary = []
    stages = sorted(set(args.stages))
    launches = [(b, w, s) for b, w in pairs for s in stages]
    for name in args.cases:
        lengths, row_maps = cases()[name]
        lengths = [max(1, n // args.shrink) for n in lengths]
        default = GDNKernelConfig().scan_launch_for(len(lengths), args.value_heads, 128, 2)
        for tma in args.tma:
            results = time_case(lengths, row_maps, launches + [default] * (default not in launches), device,
                                args.value_heads, args.affine, bool(tma))
            print(f"\n== {name}: {len(lengths)} sequences, {sum(lengths)} rows, row maps {row_maps}"
                  f"{' (affine)' if row_maps and args.affine else ''}, tma {tma}; "
                  f"fwd+bwd scan ms (default launch {default}) ==")
            print(f"{'cols':>4s} {'warps':>5s} " + " ".join(f"{f'{s} st':>7s}" for s in stages))
            for b, w in pairs:
                print(f"{b:4d} {w:5d} " + " ".join(f"{results[(b, w, s)]:7.3f}" for s in stages))
            print(f"default {default}: {results[default]:.3f} ms")
            finite = {key: ms for key, ms in results.items() if ms == ms}
            best = min(finite, key=finite.get)
            summary.append((f"{name} tma {tma}", best, finite[best], default, results[default]))
    print("\n== best launch per case (columns, warps, stages) ==")
    for name, best, ms, default, default_ms in summary:
        print(f"{name:17s} best {best} {ms:.3f} ms; default {default} {default_ms:.3f} ms")


if __name__ == "__main__":
    main()
