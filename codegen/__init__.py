"""Codegen: a compiled plan's microbatch -> index tables (host) -> the launch plan the runtime reads.

`build_microbatch_index` / `trajectory_index` derive a microbatch's tables from the IR (or from plain token
lists); `lower` builds and verifies every kernel's launch tables for a model's `LaunchTarget`;
`LaunchPlan.to(device)` uploads it in one copy; `format_launch_plan` prints it.
"""
from .index import LinearRound, MicrobatchIndex, trajectory_index
from .launch_text import format_launch_plan
from .lower import LaunchPlan, LaunchTarget, PlanMismatchError, lower
from .microbatch import build_microbatch_index

__all__ = ["LaunchPlan", "LaunchTarget", "LinearRound", "MicrobatchIndex", "PlanMismatchError",
           "build_microbatch_index", "format_launch_plan", "lower", "trajectory_index"]
