"""Where the memory alive after a forward was allocated: CUDA allocator snapshot, grouped by source line.

A tree run as pieces keeps every piece's autograd graph until its backward; `forward_memory_sites` runs one
forward of a launch plan with the allocator's history on, takes a snapshot before any backward, and sums the
live blocks by the innermost frame inside this repository (file:line function), so what a mode keeps per
token shows up by name (checkpointed layer inputs, carried K/V, a kernel's saved tensors, ...).
`bench/e2e.py --memory-sites` prints it for the largest tree and trajectory-wise microbatch.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

REPO = str(Path(__file__).resolve().parent.parent)


def live_bytes_by_site(snapshot: dict, root: str = REPO) -> Counter:
    """{site: bytes} of the snapshot's live blocks; site = the innermost allocation frame whose file lies under
    `root` ("<elsewhere>" when none does, "<no stack>" for blocks recorded without frames)."""
    sites: Counter = Counter()
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            sites[site_of(block.get("frames"), root)] += block.get("requested_size", block["size"])
    return sites


def site_of(frames, root: str = REPO) -> str:
    """"file:line function" of the innermost frame under `root` (frames innermost first); "<elsewhere>" when none
    is, "<no stack>" without frames (an allocation made inside autograd's C++ backward has no python frame)."""
    if not frames:
        return "<no stack>"
    ours = next((f for f in frames if f["filename"].startswith(root)), None)
    return "<elsewhere>" if ours is None else f"{ours['filename'][len(root) + 1:]}:{ours['line']} {ours['name']}"


def forward_memory_sites(model, plan, kernels: dict, top: int = 12) -> dict:
    """One forward of `plan` (a launch plan or lowered piece chain) with the allocator's history recorded:
    {"live_gib": bytes alive after it above what was alive before, "sites": [(site, GiB)] of the largest}.
    CUDA only; the forward's graph is dropped without a backward."""
    device = model.lm_head.weight.device
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        out = model(plan, **kernels)
        torch.cuda.synchronize(device)
        live = torch.cuda.memory_allocated(device) - before
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    del out
    sites = live_bytes_by_site(snapshot)
    return {"live_gib": live / 2**30, "sites": [(site, b / 2**30) for site, b in sites.most_common(top)]}


def print_sites(label: str, report: dict) -> None:
    print(f"  live after one forward [{label}]: {report['live_gib']:.2f} GiB; largest allocation sites (GiB; the "
          "model's weights and earlier allocations included):")
    for site, gib in report["sites"]:
        print(f"    {gib:8.3f}  {site}")
