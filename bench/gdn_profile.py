"""Where the GDN tree step's time goes: GPU time per kernel (torch.profiler), tree vs trajectory-wise.

Prints, for one fwd+bwd of each mode (trajectory-wise, tree as the runtime runs it, and one call per round
with gathers between them), device milliseconds per kernel name (summed over launches), the launch count and
the host-side wall time, so time missing from tree mode's ideal share shows up by name: a kernel, a torch op
around the calls (gathers, scatters, casts), or gaps between launches.

    python bench/gdn_profile.py [--tree P B L] [--timeline]   # H200; bench/gdn.py runs it too
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch


def device_ms_by_kernel(step, repeat: int = 3) -> tuple[dict[str, tuple[float, int]], float]:
    """({kernel name: (GPU ms per step, launches per step)}, wall ms per step) over `repeat` steps
    after one warm-up step."""
    step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(repeat):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3 / repeat
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[event.name[:60]]
            entry[0] += event.device_time_total / 1e3 / repeat  # microseconds -> ms per step
            entry[1] += 1
    return {name: (ms, count // repeat) for name, (ms, count) in totals.items()}, wall


def print_kernels(label: str, kernels: dict[str, tuple[float, int]]) -> None:
    """One line per kernel of `device_ms_by_kernel`'s dict, heaviest first: label, GPU ms, launches, name."""
    for name, (ms, launches) in sorted(kernels.items(), key=lambda item: -item[1][0]):
        print(f"  {label:8s} {ms:8.3f} ms {launches:4d}x  {name}")


def timeline(step, label: str) -> list[dict]:
    """Print every kernel of one step after a warm-up in start order: stream, start and end in microseconds
    from the first kernel, name. Shows gaps between launches and whether launches on different streams (the
    scan lanes of tree.py) overlap on the device, and how long each kernel takes beside the others."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    t0 = kernels[0].time_range.start if kernels else 0.0
    rows = [dict(stream=int(getattr(e, "device_resource_id", -1)), start_us=e.time_range.start - t0,
                 end_us=e.time_range.end - t0, kernel=e.name[:50]) for e in kernels]
    print(f"\n== timeline of one step [{label}]: stream, start..end us, kernel ==")
    for row in rows:
        print(f"{row['stream']:>4d} {row['start_us']:9.1f} {row['end_us']:9.1f}  {row['kernel']}")
    return rows


def compare(steps: dict[str, callable], top: int = 14) -> list[dict]:
    """Print the heaviest kernels of each step side by side; return the rows."""
    results = {label: device_ms_by_kernel(step) for label, step in steps.items()}
    labels = list(steps)
    names = sorted({n for kernels, _ in results.values() for n in kernels},
                   key=lambda n: -max(results[lbl][0].get(n, (0.0, 0))[0] for lbl in labels))
    print(f"{'kernel':60s} " + " ".join(f"{lbl + ' ms':>12s} {'n':>4s}" for lbl in labels))
    rows = []
    for name in names[:top]:
        cells = [results[lbl][0].get(name, (0.0, 0)) for lbl in labels]
        print(f"{name:60s} " + " ".join(f"{ms:12.3f} {n:4d}" for ms, n in cells))
        rows.append(dict(kernel=name, **{lbl: ms for lbl, (ms, _) in zip(labels, cells)}))
    for lbl in labels:
        kernels, wall = results[lbl]
        busy = sum(ms for ms, _ in kernels.values())
        launches = sum(n for _, n in kernels.values())
        print(f"{lbl}: device busy {busy:.2f} ms in {launches} launches, wall {wall:.2f} ms per step")
        rows.append(dict(kernel=f"total[{lbl}]", busy_ms=busy, launches=launches, wall_ms=wall))
    return rows


def timeline_section(log: list, trees, config, label: str, case=None) -> None:
    """The tree step's kernels of one case in time order (timeline); `case`: the trees' tree_case if built."""
    from gdn_cases import tree_case
    case = case or tree_case(trees, config)
    rows = timeline(lambda: torch.autograd.grad(case.ours_tree(*case.compact), case.compact, case.do_tree), label)
    log.extend(dict(section="timeline", config=label, **row) for row in rows)


def profile_section(log: list, trees=((4096, 8, 3584),), config=None, timeline_label: str | None = None) -> list[dict]:
    """Kernel-level GPU time of one tree case in its three modes (bench/gdn_cases.tree_case); with `timeline_label`
    also the tree step's kernels in time order, on the same case."""
    from gdn_cases import tree_case
    from harts_compiler.codegen.kernels.chunk_gdn import GDNKernelConfig
    config = config or GDNKernelConfig()
    case = tree_case(trees, config)
    print(f"\n== GPU ms per kernel, one fwd+bwd, trees {list(trees)} ==")

    def fwd_bwd(fn, leaves, do):
        return lambda: torch.autograd.grad(fn(*leaves), leaves, do)
    rows = compare({"traj": fwd_bwd(case.ours_traj, case.traj, case.do_traj),
                    "tree": fwd_bwd(case.ours_tree, case.compact, case.do_tree),
                    "per round": fwd_bwd(case.ours_tree_rounds, case.compact, case.do_tree)})
    log.extend(dict(section="profile", **row) for row in rows)
    if timeline_label:
        timeline_section(log, trees, config, timeline_label, case)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=int, nargs=3, action="append", metavar=("P", "B", "L"),
                        help="a two-level tree: root of P tokens, B branches of L tokens (repeatable; default "
                             "4096 8 3584)")
    parser.add_argument("--timeline", action="store_true", help="also the tree step's kernels in time order")
    args = parser.parse_args()
    trees = tuple(map(tuple, args.tree)) if args.tree else ((4096, 8, 3584),)
    label = " ".join(f"P{p} B{b} L{l}" for p, b, l in trees)
    profile_section([], trees=trees, timeline_label=label if args.timeline else None)


if __name__ == "__main__":
    main()
