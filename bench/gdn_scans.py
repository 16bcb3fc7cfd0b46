"""The two GDN state scans alone, under every launch (columns, warps, pipeline stages), per round shape.

The scans are the sequential part of a GDN step, and which launch is fastest depends on how many
(sequence, head) pairs a call has: a lone 16k-token root is latency-bound, 42 trajectories are bound by
memory. `GDNKernelConfig.scan_launch_for` encodes the choice; this script measures it, one table per
case (fwd + bwd scan ms, bf16, 16 key heads, 16 value heads unless --value-heads, K = V = 128), in one run:

    python bench/gdn_scans.py [--cases root1 roots6 ...] [--quick] 2>&1 | tee $OUT/gdn_scans.log

Cases: the rounds of bench/gdn.py's trees and the trajectory-wise calls (`row maps`: the tree rounds read
each sequence's first chunk through index.PackedRows and the rest at row + shift, as the runtime's agentic
rounds do; the others read rows in place). Launches are timed with descriptor (TMA) loads at every width
and / or with pointer loads only (`--tma`).
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from common import kernel_ms
from gdn_cases import agentic_trees, make_inputs
from harts_compiler.codegen.kernels.chunk_gdn import GDNKernelConfig, prepare_gdn_index
from harts_compiler.codegen.kernels.chunk_gdn.index import PackedRows, affine_chunk_shifts, affine_row_shifts
from harts_compiler.codegen.kernels.chunk_gdn.state_bwd import state_bwd_scan
from harts_compiler.codegen.kernels.chunk_gdn.state_fwd import state_fwd
from harts_compiler.codegen.kernels.upload import to_device

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


def forced(block_v: int, warps: int, stages: int, tma: bool = True) -> GDNKernelConfig:
    """A config whose scans always launch with (block_v, warps, stages), whatever the program count: with
    descriptor loads at any width (`tma`: scan_tma_max_block_v = 128) or pointer loads only (0)."""
    return GDNKernelConfig(scan_block_v=block_v, scan_warps=warps, scan_min_programs=0, scan_num_stages=stages,
                           scan_tma_max_block_v=128 if tma else 0)


def identity_rows(lengths) -> PackedRows:
    """Row maps of packed rows that are the compact tokens in order (host): the kernels take the row-map path
    (each sequence's first chunk through the maps, the rest at row + shift, here 0) on in-place data."""
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = np.arange(cu[-1], dtype=np.int64)
    chunk_shift = affine_chunk_shifts(cu, ids, ids, CHUNK)
    return PackedRows(src=ids, own=ids, num_tokens=ids.size, num_replays=0,
                      seq_shift=affine_row_shifts(cu, chunk_shift, CHUNK), chunk_shift=chunk_shift)


def time_case(lengths, row_maps, launches, device, value_heads=16, tma=True):
    q, k, v = make_inputs(lengths, hk=min(16, value_heads), hv=value_heads, device=device)[0][:3]
    rows_total, hv, vd = v.shape
    kd = k.shape[2]
    gen = torch.Generator(device).manual_seed(1)
    w = (torch.randn(rows_total, hv, kd, device=device, generator=gen) * 0.1).to(k.dtype)
    u = (torch.randn(rows_total, hv, vd, device=device, generator=gen) * 0.1).to(k.dtype)
    gc = torch.zeros(rows_total, hv, device=device)  # the gates' values do not change the timing
    do = torch.randn_like(u)
    n_chunks = sum(-(-n // CHUNK) for n in lengths)
    gated_at = (torch.randn(n_chunks, hv, CHUNK, CHUNK, device=device, generator=gen) * 0.1).to(k.dtype)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    h0 = torch.zeros(len(lengths), hv, kd, vd, device=device)
    rows = to_device(identity_rows(lengths), device) if row_maps else None
    results, split = {}, {}
    for block_v, warps, stages in launches:
        try:  # a config outside GDNKernelConfig's range or a launch over the shared-memory limit: report, go on
            config = forced(block_v, warps, stages, tma)
            index = to_device(prepare_gdn_index(cu, chunk_size=CHUNK, config=config), device)
            dh = torch.empty(index.num_chunks, hv, kd, vd, device=device, dtype=k.dtype)
            dvn = torch.empty_like(u)
            bank_grad = torch.zeros(0, hv, kd, vd, device=device)

            def fwd():
                state_fwd(k, w, u, gc, h0, index, rows=rows)

            def bwd():
                state_bwd_scan(q, k, w, gc, do, bank_grad, 0.1, index, dh, dvn, gated_at=(gated_at, 0), rows=rows)
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
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3],
                        help="pipeline stages to try (GDNKernelConfig.scan_num_stages)")
    parser.add_argument("--launches", nargs="+", default=None, metavar="BV:WARPS",
                        help="(columns, warps) pairs, default: " + " ".join(f"{b}:{w}" for b, w in LAUNCHES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--value-heads", type=int, default=16, help="32: the e2e model's (Qwen3-Next's) GDN")
    parser.add_argument("--tma", type=int, nargs="+", default=[1], choices=[0, 1],
                        help="time with descriptor loads at every width (1: GDNKernelConfig.scan_tma_max_block_v = "
                             "128) and / or pointer loads only (0: scan_tma_max_block_v = 0), each a table of its own")
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
                                args.value_heads, bool(tma))
            print(f"\n== {name}: {len(lengths)} sequences, {sum(lengths)} rows, row maps {row_maps}, tma {tma}; "
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
