"""Launch configurations of the tree-attention kernels, per head dim (tuned on one H200).

The block index fixes the query/key block sizes shared by all three kernels (BM x BN); the
backward kernels further split each query block into sub-tiles of ``block_ms`` rows so that
q, do and the fp32 accumulators fit in registers and shared memory at head dim 256.
See bench/NOTES_attention.md for the measurements behind these numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class KernelConfig:
    block_m: int = 128
    block_n: int = 64
    fwd: dict = field(default_factory=lambda: dict(num_warps=8, num_stages=2))
    dq: dict = field(default_factory=lambda: dict(block_ms=64, num_warps=8, num_stages=2))
    dkdv: dict = field(default_factory=lambda: dict(block_ms=64, num_warps=8, num_stages=2))


CONFIGS = {
    64: KernelConfig(fwd=dict(num_warps=4, num_stages=3),
                     dq=dict(block_ms=64, num_warps=4, num_stages=3),
                     dkdv=dict(block_ms=64, num_warps=4, num_stages=3)),
    128: KernelConfig(fwd=dict(num_warps=8, num_stages=3),
                      dq=dict(block_ms=64, num_warps=4, num_stages=2),
                      dkdv=dict(block_ms=64, num_warps=8, num_stages=2)),
    256: KernelConfig(),
}

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)


def config_for(head_dim: int) -> KernelConfig:
    """Config of the nearest tuned head dim at or above `head_dim` (a power of two <= 256)."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim D={head_dim} is not supported by the Triton kernels "
                         f"(supported: {SUPPORTED_HEAD_DIMS})")
    return CONFIGS[max(64, head_dim)]
