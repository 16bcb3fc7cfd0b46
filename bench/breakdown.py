"""Per-component time breakdown of a training step (torch.profiler), for bench/e2e.py.

Import from a script in bench/ as `from breakdown import component_breakdown`.
"""
from __future__ import annotations

import contextlib
import importlib
import time
from collections import defaultdict
from typing import Callable

import torch

from common import synchronize

# -- per-component time breakdown -------------------------------------------------------------

# component -> (module, attribute) of the runtime functions whose calls make that component; the
# profiler ranges wrap them while a breakdown is recorded (nothing is changed otherwise).
COMPONENT_HOOKS = {
    "linear attention": [("harts_compiler.runtime.gated_deltanet", "gated_delta_rule_rounds"),
                         ("harts_compiler.runtime.gated_deltanet", "tree_causal_conv"),
                         ("harts_compiler.runtime.kimi_delta", "linear_attention_rounds"),
                         ("harts_compiler.runtime.kimi_delta", "tree_causal_conv")],
    "attention": [("harts_compiler.runtime.attention", "tree_attention"),
                  ("harts_compiler.runtime.mla", "tree_attention")],
    "log-probs": [("harts_compiler.runtime.model", "token_logprobs")],
    "MoE/MLP": [("harts_compiler.runtime.moe", "SparseMoeBlock.forward"),
                ("harts_compiler.runtime.kimi_moe", "KimiMoeBlock.forward"),
                ("harts_compiler.runtime.layers", "DenseMLP.forward")],
}
OTHER = "projections/norms/other"


@contextlib.contextmanager
def component_ranges():
    """Wrap COMPONENT_HOOKS' functions in `record_function("harts:<component>")` ranges."""
    saved = []
    try:
        for component, targets in COMPONENT_HOOKS.items():
            for module_name, attribute in targets:
                owner = importlib.import_module(module_name)
                *path, name = attribute.split(".")
                for part in path:
                    owner = getattr(owner, part)
                original = getattr(owner, name)
                setattr(owner, name, _ranged(original, f"harts:{component}"))
                saved.append((owner, name, original))
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def _ranged(fn, label):
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)
    wrapper.__wrapped__ = fn
    return wrapper


def component_breakdown(step: Callable[[], object], device: torch.device) -> dict:
    """Run `step` once under torch.profiler and split its time into COMPONENT_HOOKS' components.

    Forward (and recomputed forward) work is attributed by the enclosing `harts:` range; backward
    work by the autograd node's sequence number, which links it to the forward op that created
    it. CUDA: kernel time; CPU: op self time. Returns {component: ms} plus 'total' and, on CUDA,
    'step wall' (the profiled step's wall time)."""
    return components(*profiled_step(step, device), device)


def profiled_step(step: Callable[[], object], device: torch.device):
    """(profiler, wall ms) of one call of `step` inside the component ranges: CPU ops, and CUDA kernels on CUDA.
    The same profile serves `components`, per-kernel tables and the idle-gap analysis (bench/gpu_idle.py)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with component_ranges(), profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        synchronize(device)
        wall_ms = (time.perf_counter() - start) * 1e3
    return prof, wall_ms


def components(prof, wall_ms: float, device: torch.device) -> dict:
    """`component_breakdown`'s table from a `profiled_step` profile."""
    events = [e for e in prof.events() if getattr(e, "device_type", None) is None
              or e.device_type == torch.autograd.DeviceType.CPU]
    totals = attribute_events(events, device.type == "cuda")
    totals["step wall"] = wall_ms
    return totals


def backward_node(event):
    """The `autograd::engine::evaluate_function: <Node>` event around `event` (an op run by autograd's backward),
    or None for a forward op."""
    while event is not None:
        if event.name.startswith("autograd::engine::evaluate_function"):
            return event
        event = event.cpu_parent
    return None


def attribute_events(events, on_device: bool) -> dict:
    """See component_breakdown; `events` are the profiler's CPU-side FunctionEvents."""
    def range_of(event):
        while event is not None:
            if event.name.startswith("harts:"):
                return event.name[len("harts:"):]
            event = event.cpu_parent
        return None

    forward_owner = {}
    for event in events:
        if event.sequence_nr >= 0 and not event.name.startswith("autograd::engine"):
            component = range_of(event)
            if component is not None:
                forward_owner.setdefault((event.thread, event.sequence_nr), component)
    totals: dict[str, float] = defaultdict(float)
    for event in events:
        us = event.self_device_time_total if on_device else event.self_cpu_time_total
        if not us:
            continue
        component = range_of(event)
        if component is None:
            node = backward_node(event)
            if node is not None:
                component = forward_owner.get((node.fwd_thread, node.sequence_nr))
        totals[component or OTHER] += us / 1e3
    totals = dict(totals)
    totals["total"] = sum(totals.values())
    return totals


if __name__ == "__main__":
    import argparse
    argparse.ArgumentParser(description=__doc__.splitlines()[0],
                            epilog="A module of bench/e2e.py: nothing runs on its own.").parse_args()
