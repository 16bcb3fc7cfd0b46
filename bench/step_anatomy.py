"""Where one training step's time and memory go, tree mode against trajectory-wise, on a generated batch.

    PYTHONUNBUFFERED=1 python bench/step_anatomy.py --presets tau2 --length-scale 1.0 \
        --target-tokens 1000000 --microbatch-tokens 65536
    python bench/step_anatomy.py --device cpu --tiny          # toy size on the CPU: section 1 only

The batch, model and step are bench/e2e.py's (same options). For each preset:
1. components (bench/breakdown.py) of one profiled step of each mode, as ms per million trajectory tokens, and
   the trajectory-wise / tree ratio of each: the speedup that component reaches, to compare with the token
   ratio (the pair ratio for attention). Trajectory-wise profiles --traj-microbatches evenly spaced
   microbatches and scales by the trajectory tokens they hold; --profiles N prints each component's median
   over N profiled calls (single profiles move by up to 10% a component);
2. on CUDA, the kernels with the most GPU time in each mode, in the same units, and the kernels whose tree-mode
   time is furthest above their trajectory-wise time over the token ratio (attention's ideal is the pair ratio);
3. on CUDA, the memory timeline of a tree step: allocated memory at every decoder layer's forward and
   recomputation, and the highest peak between two of those events, so the phase that sets the step's peak
   is named (piece, layer, forward or backward);
4. on CUDA, the live allocations at that peak, summed by source line (python frames; allocations made inside
   autograd's C++ backward have none and are summed as "<no stack>");
5. on CUDA, GPU idle time in each mode, charged to the host ops whose late launches caused it (bench/gpu_idle.py).
Sections 1, 2 and 5 read one profiled call per mode (`breakdown.profiled_step`; --profiles adds calls for the
medians of section 1).
"""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from breakdown import backward_node, components, profiled_step  # noqa: E402
from common import (BENCH_MODELS, Step, build_model, describe_device, forward_units, model_config,  # noqa: E402
                    synchronize)
from e2e import parse_args, plan_preset  # noqa: E402
from harts_compiler import predict  # noqa: E402
from gpu_idle import idle_report, print_idle  # noqa: E402
from memory_sites import REPO, site_of  # noqa: E402

PER = 1e6  # components and kernels are printed per this many trajectory tokens


def kernel_times(prof) -> Counter:
    """{kernel name: GPU ms} of a profiled step."""
    totals: Counter = Counter()
    for event in prof.events():
        # the harts: component ranges also appear on the GPU timeline (user annotations): not kernels
        if event.device_type == torch.autograd.DeviceType.CUDA and not event.is_user_annotation:
            totals[event.name] += event.device_time_total / 1e3
    return totals


def op_sites(label: str, step, tokens: int, ops: list[str], top: int) -> None:
    """GPU time of the given host ops (e.g. aten::cat) in one profiled call of `step`, per million of the
    `tokens` it stands for, by the python call stack that issued them (the repository's frames), so a kernel
    in the excess table is traced to its line and compared with the same line in the other mode."""
    from torch.profiler import ProfilerActivity, profile
    # verbose: without it the python frames are not recorded (torch >= 2.0); an op with no repository frame
    # prints as "?"
    verbose = torch._C._profiler._ExperimentalConfig(verbose=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True,
                 experimental_config=verbose) as prof:
        step()
        torch.cuda.synchronize()
    root = str(REPO) + "/"
    times: Counter = Counter()
    calls: Counter = Counter()
    for event in prof.events():  # each call with its whole stack (key_averages would cut it at n frames)
        if event.name in ops and event.device_time_total > 0:
            frames = [f.replace(root, "") for f in event.stack if f.startswith(root) and "/bench/" not in f]
            # an op autograd's backward runs carries the python stack of the forward op it differentiates
            node = backward_node(event)
            backward = f"[{node.name.split(': ', 1)[1]}] " if node is not None else ""
            site = (event.name, backward + (" < ".join(frames[:3]) or "?"))
            times[site] += event.device_time_total / 1e3 * 1e6 / tokens
            calls[site] += 1
    for op in ops:
        print(f"  {op}: GPU ms per 1M trajectory tokens by call site ({label})")
        for (name, where), ms in [item for item in times.most_common() if item[0][0] == op][:top]:
            print(f"    {ms:9.1f}  {calls[(name, where)]:6d} calls  {where}")


def short_name(name: str, width: int = 96) -> str:
    # template kernels differ at the end (the functor), so keep both ends of a long name
    half = (width - 3) // 2
    return name if len(name) <= width else f"{name[:half]}...{name[-half:]}"


class LayerTimeline:
    """Allocated memory at each decoder layer's forward and recomputation, and the peak since the event before."""

    def __init__(self, model):
        self.model, self.events, self.pieces, self.saved = model, [], {}, []

    def __enter__(self):
        for i, layer in enumerate(self.model.model.layers):
            original = layer.forward

            def forward(x, ctx, _original=original, _layer=i):
                self.mark(("recompute" if torch._C._current_graph_task_id() != -1 else "forward",
                           self.pieces.setdefault(id(ctx.plan), len(self.pieces)), _layer))
                return _original(x, ctx)
            layer.forward = forward
            self.saved.append((layer, original))
        return self

    def __exit__(self, *exc):
        for layer, original in self.saved:
            layer.forward = original

    def mark(self, label) -> None:
        synchronize(torch.device("cuda"))
        peak = torch.cuda.max_memory_allocated()
        if self.events:  # the peak between the previous event and this one belongs to the previous
            self.events[-1]["peak"] = peak
        self.events.append({"label": label, "at": torch.cuda.memory_allocated(), "peak": None})
        torch.cuda.reset_peak_memory_stats()


def peak_sites(snapshot: dict, device_index: int, top: int, root: str = REPO) -> tuple[int, list[tuple[str, int]]]:
    """Replay the allocator trace: (bytes allocated at the highest point above the start, [(site, bytes)] of the
    blocks live then that were allocated during the trace)."""
    trace = snapshot["device_traces"][device_index]

    def deltas():
        for entry in trace:
            if entry["action"] == "alloc":
                yield entry, entry["size"]
            elif entry["action"] == "free_completed":
                yield entry, -entry["size"]
    total = peak = 0
    peak_at = -1
    for n, (_, delta) in enumerate(deltas()):
        total += delta
        if total > peak:
            peak, peak_at = total, n
    live = {}
    for n, (entry, delta) in enumerate(deltas()):
        if n > peak_at:
            break
        if delta > 0:
            live[entry["addr"]] = (delta, site_of(entry.get("frames"), root))
        else:
            live.pop(entry["addr"], None)
    sites: Counter = Counter()
    for size, site in live.values():
        sites[site] += size
    return peak, sites.most_common(top)


def memory_anatomy(step, model, top: int) -> None:
    device = model.lm_head.weight.device
    synchronize(device)
    model.zero_grad(set_to_none=True)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=3_000_000, stacks="python")
    try:
        with LayerTimeline(model) as timeline:
            timeline.mark(("step start", -1, -1))
            step()
            timeline.mark(("step end", -1, -1))
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    gib = 2 ** 30
    print(f"  memory timeline (GiB above the step's start, {start / gib:.1f} GiB resident then): the phases with "
          "the highest peaks")
    events = [e for e in timeline.events if e["peak"] is not None]
    for event in sorted(events, key=lambda e: -e["peak"])[:8]:
        kind, piece, layer = event["label"]
        where = kind if piece < 0 else f"{kind:9s} piece {piece} layer {layer}"
        at, peak = (event["at"] - start) / gib, (event["peak"] - start) / gib
        print(f"    {where:32s} at {at:6.2f}  peak after it {peak:6.2f}")
    peak, sites = peak_sites(snapshot, device.index or 0, top)
    print(f"  live at the step's peak ({peak / gib:.2f} GiB allocated during the step), by site:")
    for site, size in sites:
        print(f"    {size / gib:8.3f}  {site}")


def component_table(tree_parts: dict, traj_parts: dict, tree_tokens: int, traj_tokens: int, row: dict) -> None:
    print(f"  ms per {PER / 1e6:g}M trajectory tokens (tree: its step over all {tree_tokens:,}; trajectory-wise: "
          f"the profiled microbatches' {traj_tokens:,}); ideal: token ratio {row['ideal']:.2f}x, pair ratio "
          f"{row['pair_compression']:.2f}x")
    names = [n for n in traj_parts if n not in ("total", "step wall")] + ["total", "step wall"]
    for name in names:
        tree = tree_parts.get(name, 0.0) * PER / tree_tokens
        traj = traj_parts.get(name, 0.0) * PER / traj_tokens
        ratio = traj / tree if tree else float("inf")
        print(f"    {name:28s} traj {traj:9.1f}  tree {tree:8.1f}  speedup {ratio:6.2f}x")
    ceiling = exact_tree_ceiling(traj_parts, row["ideal"], row["pair_compression"])
    if ceiling:
        kernels = (traj_parts["total"] / traj_tokens) / (tree_parts["total"] / tree_tokens)
        print(f"  exact-tree ceiling {ceiling:.2f}x ({ceiling / row['ideal']:.1%} of the token ratio: every part at "
              f"the token ratio, attention at the pair ratio, weighted by the trajectory-wise parts); the tree's "
              f"kernels reach {kernels:.2f}x = {kernels / ceiling:.1%} of it")


def exact_tree_ceiling(traj_parts: dict, token_ratio: float, pair_ratio: float) -> float | None:
    """The speedup an exact tree step could reach if every component sped up by its own ideal: attention (whose
    work is query-key pairs) by the pair ratio, everything else (work per token) by the token ratio. None without
    a trajectory-wise kernel total."""
    parts = {name: ms for name, ms in traj_parts.items() if name not in ("total", "step wall")}
    total = sum(parts.values())
    return predict.ceiling(token_ratio, pair_ratio, parts.get("attention", 0.0) / total) if total else None


def kernel_table(label: str, kernels: Counter, tokens: int, top: int) -> None:
    print(f"  top kernels, {label} (GPU ms per {PER / 1e6:g}M trajectory tokens):")
    for name, ms in kernels.most_common(top):
        print(f"    {ms * PER / tokens:9.1f}  {short_name(name)}")


def excess_table(tree: Counter, traj: Counter, tree_tokens: int, traj_tokens: int, ideal: float, top: int) -> None:
    """Each kernel's tree-mode time above (or below) its trajectory-wise time divided by the token ratio: where
    the tree step is further from the ideal than the whole step's ratio allows, kernel by kernel."""
    excess = Counter({name: tree.get(name, 0.0) * PER / tree_tokens - traj.get(name, 0.0) * PER / traj_tokens / ideal
                      for name in set(tree) | set(traj)})
    above = sum(v for v in excess.values() if v > 0)
    below = sum(v for v in excess.values() if v < 0)
    print(f"  tree time above the token-ratio ideal ({ideal:.2f}x), GPU ms per {PER / 1e6:g}M trajectory tokens: "
          f"+{above:.1f} over {sum(v > 0 for v in excess.values())} kernels, {below:.1f} under; largest:")
    for name, ms in excess.most_common(top):
        print(f"    {ms:+9.1f}  tree {tree.get(name, 0.0) * PER / tree_tokens:8.1f}  "
              f"traj {traj.get(name, 0.0) * PER / traj_tokens:9.1f}  {short_name(name)}")


def profile_mode(step, device, profiles: int, top: int):
    """(each component's median over `profiles` profiled calls, and from the first call on CUDA its kernel times
    and idle report): single profiles move by up to 10% a component. The first profile is read at once: a
    later profiler session in the process drops the kernel events its trace export would need."""
    runs, kernels, idle = [], None, None
    for _ in range(profiles):
        prof, wall_ms = profiled_step(step, device)
        runs.append(components(prof, wall_ms, device))
        if kernels is None and device.type == "cuda":
            kernels, idle = kernel_times(prof), idle_report(prof, wall_ms, top)
        del prof
    return {name: float(np.median([run.get(name, 0.0) for run in runs])) for name in runs[0]}, kernels, idle


def run_preset(preset, model, args, traj_microbatches: int, top: int, sites: list[str], profiles: int) -> None:
    batch, row, tree_indices, traj_indices, _ = plan_preset(preset, model.config, args)
    cuda = args.device.type == "cuda"
    tree = Step(model, tree_indices, row["trajectory_tokens"])
    # evenly spaced over the packing order, whose first microbatches need not be typical
    sample = traj_indices[::max(1, len(traj_indices) // traj_microbatches)][:traj_microbatches]
    sample_tokens = sum(index.num_tokens for index in sample)
    traj = Step(model, sample, row["trajectory_tokens"])
    for step in (tree, traj):  # warm: kernels compiled, allocator grown
        step()
    tree_parts, tree_kernels, tree_idle = profile_mode(tree, args.device, profiles, top)
    traj_parts, traj_kernels, traj_idle = profile_mode(traj, args.device, profiles, top)
    print(f"  tree: {len(forward_units(tree_indices))} forwards; trajectory-wise: {len(sample)} of "
          f"{len(traj_indices)} microbatches profiled")
    component_table(tree_parts, traj_parts, row["trajectory_tokens"], sample_tokens, row)
    if cuda:
        kernel_table("tree", tree_kernels, row["trajectory_tokens"], top)
        kernel_table("trajectory-wise", traj_kernels, sample_tokens, top)
        excess_table(tree_kernels, traj_kernels, row["trajectory_tokens"], sample_tokens, row["ideal"], top)
        if sites:
            op_sites("tree", tree, row["trajectory_tokens"], sites, top)
            op_sites("trajectory-wise", traj, sample_tokens, sites, top)
        memory_anatomy(tree, model, top)
        print_idle("tree", tree_idle)
        print_idle(f"trajectory-wise ({len(sample)} microbatches)", traj_idle)
    del tree, traj


def anatomy_arguments(p) -> None:
    p.add_argument("--traj-microbatches", type=int, default=2,
                   help="trajectory-wise microbatches profiled, evenly spaced (default 2)")
    p.add_argument("--top", type=int, default=14, help="rows of the kernel tables (default 14)")
    p.add_argument("--profiles", type=int, default=1,
                   help="profiled calls per mode for the component table, medians printed (e.g. 3)")
    p.add_argument("--op-sites", nargs="*", default=[], metavar="OP",
                   help="host ops (e.g. aten::cat aten::copy_) whose tree-step GPU time to list by call site")


def main(argv=None) -> int:
    args = parse_args(argv, __doc__.split("\n")[0], anatomy_arguments)
    print(f"device {describe_device(args.device)}")
    model = build_model(model_config(args.tiny, model=args.model), args.device, torch.bfloat16, seed=args.seed,
                        checkpointing=True)
    print(f"model {BENCH_MODELS[args.model][1] if args.tiny else args.model}")
    for preset in args.presets:
        run_preset(preset, model, args, args.traj_microbatches, args.top, args.op_sites, args.profiles)
    return 0


if __name__ == "__main__":
    sys.exit(main())
