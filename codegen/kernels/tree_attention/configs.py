"""Launch configurations of the tree-attention kernels, per head dim (tuned on one H200).

Each kernel has its own tile: ``block_m`` x ``block_n`` are the query/key block sizes of the
visit lists it walks (codegen builds the lists at every tile of ``KernelConfig.tiles`` once per
microbatch); the backward kernels split each query block into sub-tiles
of ``block_ms`` rows. Candidates were screened offline with ``tools/attention_resources.py`` (shared memory
within Hopper's 227 KB) and timed on the H200; the fastest won even where it spills a few hundred
bytes: what matters most is 128-row score tiles (n64 wgmma per warpgroup). See
docs/tree_attention_kernels.md. Head dims 64 and 128 are checked on the GPU but not tuned.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def _launch(block_m, block_n, num_warps, num_stages, block_ms=None) -> dict:
    out = dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    if block_ms is not None:
        out["block_ms"] = block_ms
    return out


@dataclass(frozen=True)
class KernelConfig:
    # head dim 256 on the H200 (sweep 2, anchor P4096 B8 L3584, 16/2 heads): fwd 7.5 ms
    # (385 TFLOP/s), dq 9.0 ms (485), dk/dv 14.6 ms (399); see docs/tree_attention_kernels.md
    fwd: dict = field(default_factory=lambda: _launch(128, 64, 8, 2))
    dq: dict = field(default_factory=lambda: _launch(128, 64, 8, 1, block_ms=128))
    dkdv: dict = field(default_factory=lambda: _launch(128, 64, 8, 1, block_ms=128))

    @property
    def block_m(self) -> int:
        """Block sizes of the index built when the caller passes none (the forward's)."""
        return self.fwd["block_m"]

    @property
    def block_n(self) -> int:
        return self.fwd["block_n"]

    @property
    def tiles(self) -> tuple[tuple[int, int], ...]:
        """The distinct (block_m, block_n) tiles of the three kernels: the block lists a plan must hold."""
        return tuple(dict.fromkeys((launch["block_m"], launch["block_n"]) for launch in (self.fwd, self.dq, self.dkdv)))


def uniform_config(block_m: int, block_n: int, block_ms: int, num_warps: int,
                   num_stages: int) -> KernelConfig:
    """One tile and launch shape for all three kernels (tests, sweeps)."""
    return KernelConfig(fwd=_launch(block_m, block_n, num_warps, num_stages),
                        dq=_launch(block_m, block_n, num_warps, num_stages, block_ms),
                        dkdv=_launch(block_m, block_n, num_warps, num_stages, block_ms))


CONFIGS = {
    64: KernelConfig(fwd=_launch(128, 64, 4, 3), dq=_launch(128, 64, 4, 2, block_ms=64),
                     dkdv=_launch(128, 64, 4, 2, block_ms=64)),
    128: KernelConfig(fwd=_launch(128, 64, 8, 3), dq=_launch(128, 64, 8, 2, block_ms=64),
                      dkdv=_launch(128, 64, 8, 2, block_ms=64)),
    256: KernelConfig(),
}

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)

# Launch shapes still in the running at head dim 256 (all fit in shared memory): bench/attention.py
# times them and the GPU tests check each against the fp32 reference, so whichever wins can ship.
CANDIDATES_256 = {
    "fwd": [_launch(128, 64, 8, 2), _launch(128, 128, 8, 1), _launch(128, 32, 8, 3)],
    "dq": [_launch(128, 64, 8, 1, block_ms=128), _launch(128, 32, 8, 2, block_ms=128)],
    "dkdv": [_launch(128, 64, 8, 1, block_ms=128), _launch(128, 64, 8, 2, block_ms=64),
             _launch(64, 64, 8, 2, block_ms=64)],
}


def config_for(head_dim: int) -> KernelConfig:
    """Config of the nearest tuned head dim at or above `head_dim` (a power of two <= 256)."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim D={head_dim} is not supported by the Triton kernels "
                         f"(supported: {SUPPORTED_HEAD_DIMS})")
    return CONFIGS[max(64, head_dim)]
