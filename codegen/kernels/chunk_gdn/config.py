"""Launch parameters of the Gated DeltaNet kernels.

Fixed per plan, never autotuned: the same chunk with the same entering state then runs the same code in
any call, which is what makes tree mode bitwise equal to trajectory-wise training. The values are the
H200's (docs/gdn_kernels.md says why each is what it is; BENCHMARKS.md has the measurements).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

Q_DO_PRECISIONS = ("auto", "bf16", "bf16x2")


def _power_of_two(value: int, least: int = 16) -> bool:
    return value >= least and value & (value - 1) == 0


# On CUDA the Triton path runs only what passed on the H200 (`bench/gdn_shapes.py`): Triton 3.6 miscompiles
# some Hopper configurations, and fp32 operands with 16-column heads made the WY backward access memory
# illegally there. Everything else takes the plain-torch reference.
CUDA_DTYPES = (torch.bfloat16, torch.float16)
CUDA_HEAD_DIMS = (64, 128)


def triton_supports(dtype: torch.dtype, key_dim: int, value_dim: int, *, cuda: bool = True) -> bool:
    """Whether the Triton kernels run inputs of `dtype` with these head sizes: on CUDA the validated
    configurations only, under the CPU interpreter any non-fp64 float with power-of-two heads >= 16."""
    if cuda:
        return dtype in CUDA_DTYPES and key_dim in CUDA_HEAD_DIMS and value_dim in CUDA_HEAD_DIMS
    return dtype != torch.float64 and _power_of_two(key_dim) and _power_of_two(value_dim)


@dataclass(frozen=True)
class GDNKernelConfig:
    # state scans: 64 columns per program read w, k, q once per 64 columns (memory-bound when many sequences run)
    scan_block_v: int = 64
    # 4 warps = one warpgroup: the scans' dots are wgmma
    scan_warps: int = 4
    # halve the columns (down to 16) while a launch has fewer programs than this (~one per SM): a lone long
    # root is latency-bound and gains from more, narrower programs
    scan_min_programs: int = 128
    # full-width backward scans form dv_local themselves only where the launch's longest sequence has at least this
    # many chunks: the scans of short sequences are latency-bound, and the chunk-parallel kernel's buffer is cheaper
    # there (docs/gdn_kernels.md)
    scan_local_dv_min_chunks: int = 8
    # pipeline depth, 0 = by input size: 16-bit scans prefetch two chunks ahead at 3 (4 overflows shared memory)
    scan_num_stages: int = 0
    # launches of at most this many columns load full chunks through tensor descriptors (narrow scans are
    # issue-bound; at 64 columns descriptors gain nothing and spill); 0 = pointer loads only
    scan_tma_max_block_v: int = 32
    # backward scan's (scale exp(gc) q)^T do: "bf16" one wgmma, "bf16x2" adds the bf16 remainder in a second one
    # (d(initial state) then at or below fla's error), "auto" = bf16x2 only where d(initial state) is returned
    scan_q_do_precision: str = "auto"
    # tree mode: independent trees' scans on up to this many CUDA streams, so branches wait only for their own root
    tree_scan_lanes: int = 8
    # output kernel: 64 state columns per program at 4 warps
    out_block_v: int = 64
    out_warps: int = 4
    # A^T (dv_local = A^T do) for the backward scans that do not form it: one [64, K] x [K, 64] dot a program;
    # 8 warps to hide its latency (4 fit, 114 registers offline, but were not timed)
    gated_at_warps: int = 8
    # WY forward: the KKT solve in 16x16 register blocks runs best at one warp, 64 key columns a step
    wy_kkt_warps: int = 1
    wy_kkt_block_k: int = 64
    wy_wu_warps: int = 4
    # chunk-parallel backward: V block of the dq/dk/dw and WY kernels
    bwd_block_v: int = 64
    # dq/dk/dw kernel: 8 warps (at 4 its fp32 accumulators spill, 1.3 KB a thread at the JIT's alignment:
    # bench/gdn_resources.py --aligned; 16 warps fit 128 registers but were 0.7% slower)
    bwd_qk_warps: int = 8
    # WY backward at 4 warps (8 and 2 were slower)
    wy_bwd_warps: int = 4

    def __post_init__(self):
        for field, least in (("scan_block_v", 16), ("scan_warps", 1), ("wy_kkt_block_k", 16)):
            if not _power_of_two(getattr(self, field), least):
                raise ValueError(f"GDNKernelConfig.{field} must be a power of two >= {least}, "
                                 f"got {getattr(self, field)}")
        if self.scan_warps > 4:  # 8-warp scans (two warpgroups) returned NaN on Hopper under Triton 3.6
            raise ValueError(f"GDNKernelConfig.scan_warps must be at most 4 (one warpgroup), got {self.scan_warps}")
        if not 0 <= self.scan_num_stages <= 3:
            raise ValueError(f"GDNKernelConfig.scan_num_stages must be 0 (by dtype) or 1-3, got {self.scan_num_stages}")
        if self.scan_q_do_precision not in Q_DO_PRECISIONS:
            raise ValueError(f"GDNKernelConfig.scan_q_do_precision must be one of {Q_DO_PRECISIONS}, "
                             f"got {self.scan_q_do_precision!r}")
        for field, least in (("scan_min_programs", 0), ("scan_tma_max_block_v", 0), ("tree_scan_lanes", 1),
                             ("scan_local_dv_min_chunks", 0)):
            if getattr(self, field) < least:
                raise ValueError(f"GDNKernelConfig.{field} must be >= {least}, got {getattr(self, field)}")

    def scan_q_do_code(self, initial_state_grad: bool) -> int:
        """The backward scan's QDO constexpr (1: the bf16 hi + lo q^T do) in a call that does (or does not)
        return the initial-state gradient."""
        precision = self.scan_q_do_precision
        return int(precision == "bf16x2" or (precision == "auto" and initial_state_grad))

    def scan_launch_for(self, num_seqs: int, value_heads: int, value_dim: int,
                        element_size: int) -> tuple[int, int, int]:
        """(state columns per program, warps, pipeline stages) of a scan launch over `num_seqs` sequences of
        `element_size`-byte inputs."""
        block_v = min(self.scan_block_v, value_dim)
        while block_v > 16 and num_seqs * value_heads * (value_dim // block_v) < self.scan_min_programs:
            block_v //= 2
        return block_v, self.scan_warps, self.scan_stages_for(element_size)

    def scan_full_width(self, num_seqs: int, value_heads: int, value_dim: int, element_size: int) -> bool:
        """Whether a scan launch over `num_seqs` sequences runs at `scan_block_v` columns (not narrowed for want of
        programs)."""
        block_v = self.scan_launch_for(num_seqs, value_heads, value_dim, element_size)[0]
        return block_v == min(self.scan_block_v, value_dim)

    def scan_forms_dv_local(self, num_seqs: int, longest_chunks: int, value_heads: int, value_dim: int,
                            element_size: int) -> bool:
        """Whether a backward scan launch over `num_seqs` sequences, the longest `longest_chunks` chunks long, forms
        each chunk's dv_local itself (full width and long enough) rather than reading gated_at_bwd's A^T."""
        return (longest_chunks >= self.scan_local_dv_min_chunks
                and self.scan_full_width(num_seqs, value_heads, value_dim, element_size))

    def scan_stages_for(self, element_size: int) -> int:
        """Pipeline depth of the scans: `scan_num_stages`, or 3 for 16-bit inputs (two chunks of prefetch fit
        in shared memory at 64 columns) and 1 for fp32 (2 stages at 32 columns exceed the H200's 227 KiB)."""
        if self.scan_num_stages:
            return self.scan_num_stages
        return 3 if element_size <= 2 else 1
