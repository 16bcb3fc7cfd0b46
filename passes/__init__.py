"""Compiler passes (`Program -> Program`), their registry table and the pass manager."""
from .base import Pass, PassError
from .manager import PassTiming, run_passes
from .registry import PASSES, build_pipeline

__all__ = ["Pass", "PassError", "PassTiming", "run_passes", "PASSES", "build_pipeline"]
