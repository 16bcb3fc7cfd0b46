"""Launch configurations of the tree-attention kernels, per head dim (tuned on one H200).

Each kernel has its own tile: ``block_m`` x ``block_n`` are the query/key block sizes of the
visit lists it walks (codegen builds the lists at every tile of ``KernelConfig.tiles`` once per
microbatch); the backward kernels split each query block into sub-tiles
of ``block_ms`` rows. Candidates were screened offline with ``tools/attention_resources.py`` (shared memory
within Hopper's 227 KB) and timed on the H200; the fastest won even where it spills a few hundred
bytes: what matters most is 128-row score tiles (n64 wgmma per warpgroup). See
docs/tree_attention_kernels.md. Head dims 64 and 128 are checked on the GPU but not tuned.
At head dim 256 and for MLA a config also names launches of the Gluon kernels (``gluon``): on Hopper (sm_90)
they run in place of the Triton ones, which stay the kernels of other GPUs and of the CPU interpreter.

q/k and v head dims may differ (MLA): ``config_for(head_dim, value_dim)``. The q/k head dim is then any
power of two or sum of two (each >= 16, the smallest dot), up to 256; 192 / 128 (Kimi Linear) has its
own entry, other pairs use the config of the next tuned uniform head dim at or above both.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def _launch(block_m, block_n, num_warps, num_stages, block_ms=None, heads=None) -> dict:
    """block_m query tokens x block_n keys (dq, dk/dv: block_ms tokens a program); `heads` (forward only): query
    heads of one KV head per program, block_m tokens of each stacked into the score rows."""
    out = dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    if block_ms is not None:
        out["block_ms"] = block_ms
    if heads is not None:
        out["heads"] = heads
    return out


@dataclass(frozen=True)
class KernelConfig:
    # head dim 256 on the H200 (anchor P4096 B8 L3584, 16/2 heads): fwd 6.8 ms (433 TFLOP/s) with 64 tokens of
    # 2 query heads a program (each key block serves 2 heads), dq 9.0 ms (485), dk/dv 13.1 ms (450); see
    # docs/tree_attention_kernels.md
    fwd: dict = field(default_factory=lambda: _launch(64, 64, 8, 2, heads=2))
    dq: dict = field(default_factory=lambda: _launch(128, 64, 8, 1, block_ms=128))
    dkdv: dict = field(default_factory=lambda: _launch(128, 64, 8, 1, block_ms=128))
    # the Gluon kernels' launches (keys "fwd", "dq", "dkdv"), run instead of the Triton ones on Hopper (sm_90)
    # for bf16 / fp16 inputs; None: the Triton kernels everywhere (see function.py, hopper_launches)
    gluon: dict | None = None

    def __post_init__(self):
        heads = self.fwd.get("heads", 1)
        if heads < 1 or heads & (heads - 1):
            raise ValueError(f"tree attention forward launch: heads={heads} must be a positive power of two")

    @property
    def block_m(self) -> int:
        """Block sizes of the index built when the caller passes none (the forward's)."""
        return self.fwd["block_m"]

    @property
    def block_n(self) -> int:
        return self.fwd["block_n"]

    @property
    def tiles(self) -> tuple[tuple[int, int], ...]:
        """The distinct (block_m, block_n) tiles of the three kernels: the block lists a plan must hold. A packed
        forward adds its unpacked tile (block_m * heads tokens), run where the heads do not divide the GQA group."""
        fwd_unpacked = dict(self.fwd, block_m=self.fwd["block_m"] * self.fwd.get("heads", 1))
        launches = (self.fwd, fwd_unpacked, self.dq, self.dkdv, *(self.gluon or {}).values())
        return tuple(dict.fromkeys((launch["block_m"], launch["block_n"]) for launch in launches))


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
    256: KernelConfig(gluon=dict(
        # on the H200 (P4096 B8 L3584, 16/2 heads) against the Triton launches above: fwd 4.73 ms (614 TFLOP/s) vs
        # 6.74; dq 6.75 (645) vs 8.94; dk/dv 10.81 (537) vs 13.01. Two 4-warp consumers beat one 8-warp one in the
        # forward (5.52 ms) and dk/dv (11.71); dq is even (6.83 with two). dk/dv key-major (dK, dV as [keys, dims]
        # accumulators, p^T and ds^T entering their wgmma from registers): 9.85-10.04 ms against 10.4-10.7
        # query-major on an H100
        fwd=dict(block_m=128, block_n=64, num_stages=2, consumers=2),
        dq=dict(block_m=128, block_n=64, k_stages=2, v_stages=1, consumers=1),
        dkdv=dict(block_m=128, block_n=64, block_ms=64, stages=2, consumers=2, key_major=True))),
}

# MLA: (q/k head dim, v head dim). Shared memory below is per program for bf16, q/k as two tiles 128 + 64.
MLA_CONFIGS = {
    (192, 128): KernelConfig(
        # 128-row score tiles (n64 wgmma per warpgroup, the shape that won at 256); k + v are 40 KB per
        # stage, so 3 stages fit beside the 48 KB q tile (sm_90 compile: 173 KB, no spills), as at head dim 128
        fwd=_launch(128, 64, 8, 3),
        # 128-row sub-tile as at 256 (dq accumulator 128 x 192 fp32 = 96 registers a thread, less than
        # 256's 128); q + do 80 KB, k + v 40 KB a stage: 2 stages fit (sm_90 compile: 164 KB, no spills)
        dq=_launch(128, 64, 8, 2, block_ms=128),
        # 128-row sub-tile, two stages: with q and do read through tensor descriptors they fit without spills
        # (sm_90 compile: 218 KB) and took 9.1 ms on P4096 B8 L3584 against 13.8 for one stage
        dkdv=_launch(128, 64, 8, 2, block_ms=128),
        # Gluon on Hopper, q/k as column tiles 128 + 64 (sm_90 compiles, Triton 3.6): forward two consumers, K / V
        # rings of 3 (172 KB, no spills); dq one consumer (two get every wgmma serialised), K ring 3, V ring 2
        # (189 KB, 4 spilled registers); dk/dv two consumers (one gets its [64, 64] dK^T tile serialised), q / do
        # rings of 3 (197 KB, no spills); key-major dk/dv was slower here (H100: 9.07 vs 8.44 ms on P4096 B8 L3584,
        # 146 vs 136 on P32768 B8 L8192)
        gluon=dict(fwd=dict(block_m=128, block_n=64, num_stages=3, consumers=2),
                   dq=dict(block_m=128, block_n=64, k_stages=3, v_stages=2, consumers=1),
                   dkdv=dict(block_m=128, block_n=64, block_ms=64, stages=3, consumers=2))),
}

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
GLUON_HEAD_DIMS = ((256, 256), (192, 128))  # (q/k, v) head dims whose configs' Gluon launches run on Hopper

# Launch shapes still in the running at head dim 256 (all fit in shared memory): bench/attention.py
# times them and the GPU tests check each against the fp32 reference, so whichever wins can ship.
CANDIDATES_MLA = {  # the same for q/k 192, v 128
    "fwd": [MLA_CONFIGS[(192, 128)].fwd, _launch(128, 64, 8, 2), _launch(128, 128, 8, 1)],
    "dq": [MLA_CONFIGS[(192, 128)].dq, _launch(128, 64, 8, 1, block_ms=128), _launch(128, 64, 8, 2, block_ms=64)],
    "dkdv": [MLA_CONFIGS[(192, 128)].dkdv, _launch(128, 64, 8, 1, block_ms=128), _launch(128, 32, 8, 2, block_ms=128),
             _launch(128, 64, 8, 2, block_ms=64)],
}
CANDIDATES_256 = {
    # 64 tokens of 2 heads (or 16 of 8): the same 128-row score tiles, each key block loaded once for 2 (8) heads
    "fwd": [_launch(64, 64, 8, 2, heads=2), _launch(16, 64, 8, 2, heads=8), _launch(128, 64, 8, 2),
            _launch(128, 128, 8, 1)],
    "dq": [_launch(128, 64, 8, 1, block_ms=128), _launch(128, 32, 8, 2, block_ms=128)],
    "dkdv": [_launch(128, 64, 8, 1, block_ms=128), _launch(128, 64, 8, 2, block_ms=64),
             _launch(64, 64, 8, 2, block_ms=64)],
}


def config_for(head_dim: int, value_dim: int | None = None) -> KernelConfig:
    """Config of q/k head dim `head_dim` and v head dim `value_dim` (default `head_dim`): for equal dims the
    nearest tuned head dim at or above (a power of two <= 256); see the module docstring for MLA."""
    if value_dim is None or value_dim == head_dim:
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head dim D={head_dim} is not supported by the Triton kernels "
                             f"(supported: {SUPPORTED_HEAD_DIMS})")
        return CONFIGS[max(64, head_dim)]
    if not supports_head_dims(head_dim, value_dim):
        raise ValueError(f"head dims D={head_dim} (q/k), Dv={value_dim} (v) are not supported by the Triton kernels "
                         f"(Dv one of {SUPPORTED_HEAD_DIMS}; D one of them or a sum of two, each >= 16, <= 256)")
    if (head_dim, value_dim) in MLA_CONFIGS:
        return MLA_CONFIGS[(head_dim, value_dim)]
    return CONFIGS[max(64, 1 << (max(head_dim, value_dim) - 1).bit_length())]


def supports_head_dims(head_dim: int, value_dim: int | None = None) -> bool:
    """Whether the Triton kernels take q/k head dim `head_dim` with v head dim `value_dim` (default equal)."""
    if value_dim is None or value_dim == head_dim:
        return head_dim in SUPPORTED_HEAD_DIMS
    if value_dim not in SUPPORTED_HEAD_DIMS or not 16 <= head_dim <= 256:
        return False
    first = 1 << (head_dim.bit_length() - 1)
    rest = head_dim - first
    return rest == 0 or (rest >= 16 and rest & (rest - 1) == 0)
