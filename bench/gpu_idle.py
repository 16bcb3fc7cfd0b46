"""Where the GPU waits during a step: idle gaps on the kernel timeline and the host work that caused them.

Import from a script in bench/ as `from gpu_idle import idle_report` (it reads a `breakdown.profiled_step`
profile).

A gap is time between the end of every kernel / copy so far and the start of the next one. If the next
kernel was launched only after the GPU went idle, the host was the bottleneck there: the gap is charged to
the host op that issued that launch (the innermost profiler op around it) and to the `harts:` component
range around it (bench/breakdown.py's ranges), so the sites that starve the GPU (a device-to-host sync, a
host loop of small launches) are named with the time they cost. Gaps whose next kernel had been queued
before the GPU went idle are launch latency of the queue and are summed separately.
"""
from __future__ import annotations

import bisect
import json
import os
import tempfile
from collections import Counter
from dataclasses import dataclass

import numpy as np

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
MIN_GAP_US = 5.0  # shorter gaps are the normal back-to-back launch distance of a busy queue


@dataclass(frozen=True)
class IdleReport:
    wall_ms: float
    busy_ms: float  # union of kernel / copy intervals
    starved_ms: float  # idle with the next launch issued after the GPU went idle
    queued_ms: float  # idle with the next launch already issued
    gaps: int
    sites: list[tuple[str, float, int]]  # (host op < component, starved ms, gaps), largest first


def idle_report(prof, wall_ms: float, top: int = 12) -> IdleReport:
    """The GPU idle time of a profiled step (`breakdown.profiled_step`: CPU ops and CUDA kernels, inside the
    component ranges), charged to the host sites that caused it."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return analyse(events, wall_ms, top)


def analyse(events: list[dict], wall_ms: float, top: int) -> IdleReport:
    """The gap analysis of a chrome trace's events (split from idle_report so it runs on a saved trace)."""
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES and "dur" in e), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    ops_by_thread: dict = {}
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e:
            ops_by_thread.setdefault(e["tid"], []).append(e)
    index = {tid: _Nesting(ops) for tid, ops in ops_by_thread.items()}
    busy = starved = queued = 0.0
    sites: Counter = Counter()
    counts: Counter = Counter()
    gaps = 0
    frontier = None
    for kernel in gpu:
        begin, end = kernel["ts"], kernel["ts"] + kernel["dur"]
        if frontier is None:
            busy += end - begin
            frontier = end
            continue
        if begin > frontier + MIN_GAP_US:
            gap = begin - frontier
            gaps += 1
            launch = launches.get(kernel.get("args", {}).get("correlation"))
            if launch is not None and launch["ts"] > frontier:
                starved += gap
                site = index[launch["tid"]].site(launch["ts"]) if launch["tid"] in index else "?"
                sites[site] += gap / 1e3
                counts[site] += 1
            else:
                queued += gap
        busy += max(0.0, end - max(begin, frontier))
        frontier = max(frontier, end)
    ranked = [(site, ms, counts[site]) for site, ms in sites.most_common(top)]
    return IdleReport(wall_ms, busy / 1e3, starved / 1e3, queued / 1e3, gaps, ranked)


class _Nesting:
    """Host ops of one thread, queried for the innermost op and the `harts:` range around a timestamp."""

    def __init__(self, ops: list[dict]):
        self.tables = [self._table([e for e in ops if keep(e["name"])]) for keep in
                       (lambda n: not n.startswith(("harts:", "cuda")), lambda n: n.startswith("harts:"))]

    @staticmethod
    def _table(events: list[dict]):
        events = sorted(events, key=lambda e: e["ts"])
        ends = np.maximum.accumulate([e["ts"] + e["dur"] for e in events]) if events else np.zeros(0)
        return events, [e["ts"] for e in events], ends

    @staticmethod
    def _innermost(table, ts: float):
        # the latest-starting event still running at ts; the walk back stops once no earlier event ends after ts
        events, starts, ends = table
        for i in range(bisect.bisect_right(starts, ts) - 1, -1, -1):
            if ends[i] < ts:
                return None
            if events[i]["ts"] + events[i]["dur"] >= ts:
                return events[i]["name"]
        return None

    def site(self, ts: float) -> str:
        inner, component = (self._innermost(table, ts) for table in self.tables)
        return f"{inner or '?'} < {component[len('harts:'):] if component else 'other'}"


def print_idle(label: str, report: IdleReport) -> None:
    print(f"  GPU idle, {label}: wall {report.wall_ms:,.0f} ms, kernels busy {report.busy_ms:,.0f} ms; idle "
          f"{report.starved_ms:,.0f} ms waiting for the host (next launch issued after the GPU went idle) + "
          f"{report.queued_ms:,.0f} ms between queued launches, {report.gaps:,} gaps over {MIN_GAP_US:g} us")
    for site, ms, n in report.sites:
        print(f"    {ms:9.1f} ms  {n:6d} gaps  {site}")
