"""Launch parameters of the KDA chunk-parallel kernels (the scans and lanes follow the plan's GDNKernelConfig).

Fixed, never autotuned: the same chunk then runs the same code in any call, which keeps tree mode bitwise
equal to trajectory-wise training. K = V = 128 on the H200: each value below won `bench/kda.py --sweep` at
8 x 8,192 tokens x 32 heads (every listed change there measured slower or within noise; docs/kda_kernels.md).
"""
from __future__ import annotations

from dataclasses import dataclass


def _power_of_two(value: int, least: int) -> bool:
    return value >= least and value & (value - 1) == 0


@dataclass(frozen=True)
class KDAKernelConfig:
    # key columns per step of the sub-chunk kernels (forward Aqk / Akk, backward intra): 32; 16 took 45.5-46.2 against
    # 39.0 ms fwd + bwd (H100, 8 x 8,192 tokens x 32 heads; bench/kda.py --sweep)
    intra_block_k: int = 32
    # diagonal blocks of the forward: heads per program and warps; one warp per head, so each [K] dot sums
    # within a warp (K = 128: four values a lane)
    diag_heads: int = 4
    diag_warps: int = 4
    # forward intra (the off-diagonal blocks of Aqk and Akk; the inverse runs in the solve kernel): 2 warps, 2.23
    # against 2.52 ms at 4 (H100, 8 x 8,192 tokens x 32 heads; bench/kda.py --sweep)
    intra_fwd_warps: int = 2
    # T = (I + Akk)^-1 from the stored Akk blocks: one warp keeps each substitution step's row sums in a warp
    solve_warps: int = 1
    # w, u, kg: [64, 64] dots, as GDN's wy_wu_warps
    wu_warps: int = 4
    # output: 64 state columns per program at 4 warps (GDN's out kernel)
    out_block_v: int = 64
    out_warps: int = 4
    # backward prologue (dv_local, qg): [64, 64] dots over all of V, 8 warps as GDN's dv_local
    bwd_prep_warps: int = 8
    # backward inter-chunk kernel (dq, dk, dw over all K at once): 8 warps hold three [64, K] fp32 tiles
    bwd_inter_warps: int = 8
    bwd_block_v: int = 64
    # WY backward: 4 warps, walking K and V in 64-column blocks (GDN's wy_bwd_warps)
    wy_bwd_warps: int = 4
    # backward intra, off-diagonal sub-chunk blocks of dAqk and dAkk: 2 warps (8.2 ms against 8.7 at 4 and 15.5
    # at 8 on the H200, 8 x 8,192 tokens x 32 heads; bench/kda.py --sweep)
    intra_bwd_warps: int = 2
    # backward diagonal blocks, one program per row: heads per program and warps, as the forward's diag_*
    diag_bwd_heads: int = 4
    diag_bwd_warps: int = 4

    def __post_init__(self):
        for field in ("intra_block_k", "out_block_v", "bwd_block_v"):
            if not _power_of_two(getattr(self, field), 16):
                raise ValueError(f"KDAKernelConfig.{field} must be a power of two >= 16, got {getattr(self, field)}")
        for field in ("diag_heads", "diag_warps", "intra_fwd_warps", "solve_warps", "wu_warps", "out_warps",
                      "bwd_prep_warps", "bwd_inter_warps", "wy_bwd_warps", "intra_bwd_warps", "diag_bwd_heads",
                      "diag_bwd_warps"):
            if not _power_of_two(getattr(self, field), 1):
                raise ValueError(f"KDAKernelConfig.{field} must be a power of two, got {getattr(self, field)}")
