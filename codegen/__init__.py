"""Codegen: compiled plans -> per-microbatch index tensors and specialised kernels."""
from .index import LinearRound, MicrobatchIndex, trajectory_index

__all__ = ["LinearRound", "MicrobatchIndex", "trajectory_index"]
