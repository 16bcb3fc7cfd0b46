"""Index tensors of one packed `chunk_gated_delta_rule` call, built once per call signature.

The runtime builds a `GDNIndex` once per microbatch round (it depends only on `cu_seqlens` and the
export list) and passes it to every linear-attention layer, so no layer recomputes it or syncs
with the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .inputs import check_exports


Q_DO_PRECISIONS = ("auto", "bf16", "bf16x2")  # GDNKernelConfig.scan_q_do_precision
NO_SHIFT = -(1 << 62)  # PackedRows.chunk_shift of a chunk that reads its rows through the maps


@dataclass(frozen=True)
class GDNKernelConfig:
    """Launch configuration: fixed per plan (never autotuned), so equal chunks give equal bits in any call.

    Defaults from H200 timings of one trajectory-wise fwd+bwd at 61,440 tokens, H=16, K=V=128, bf16
    (`bench/gdn_kernels.py --sweep`, 2026-11-30, each change against the old default in one run: 9.53 ms,
    fla 8.36 ms), after `bench/gdn_resources.py` ruled out configurations that spill on sm_90a.
    """
    # The two state scans (state_fwd / state_bwd): `scan_block_v` state columns per program at `scan_warps`,
    # halved (down to 16) while a call would have fewer than `scan_min_programs` programs: a lone long root
    # is latency-bound and gains from more, narrower programs; everything else from wide ones, which read
    # w, k and q once per 64 columns. Chosen from `bench/gdn_scans.py` (H200, 2026-12-01, BENCHMARKS.md
    # session 7: fwd + bwd scan ms, this launch vs the old per-count rule): 8 x 7,680 tokens 1.30 vs 1.85,
    # 42 agentic trajectories 3.95 vs 4.66, their tree rounds 0.66 vs 0.70 (6 roots) and 1.74 vs 1.97 (42
    # branches), 8 x 2,048 0.37 vs 0.47; a lone 16k root at 16 columns 0.66 (64 columns: 1.21). Column blocks
    # are independent, so tree == trajectory-wise stays bitwise when a round and a call launch differently.
    scan_block_v: int = 64
    scan_warps: int = 4         # wgmma; 2 warps (mma.sync) lost everywhere but the 6 roots (32 columns: 0.61 ms)
    scan_min_programs: int = 128  # about one per SM
    # pipeline depth, 0 = by input dtype (scan_stages_for): 16-bit scans load 2 chunks ahead at 3 stages
    scan_num_stages: int = 0
    # (forward, backward) pipeline depth of 16-bit scans at 16 columns (a lone long root: latency-bound, one
    # program per SM, so shared memory is free for deeper prefetch); 0 = scan_stages_for
    narrow_scan_stages: tuple[int, int] = (0, 0)
    out_block_v: int = 64
    out_warps: int = 4          # with bwd_block_v 64: 7.83 vs 8.21 ms
    dv_local_warps: int = 8
    # WY forward (wy_fwd.py): A + (I + A)^-1 in 16x16 register blocks, then w / u; 9.07 vs 9.53 ms for
    # the single kernel it replaced (wy_fwd 0.79 vs 1.44 ms)
    wy_kkt_warps: int = 1         # its first kernel: 8.90 ms at 1 warp, 9.07 at 2, 9.61 at 4
    wy_kkt_block_k: int = 64      # columns of k per step of that kernel (32: 9.63 ms)
    wy_wu_warps: int = 4          # its w / u kernel (8: no faster)
    bwd_block_v: int = 64       # V block of the chunk-parallel backward kernels (see out_warps)
    bwd_qk_warps: int = 8
    bwd_qk_block_k: int = 0     # K columns per dq/dk/dw program, 0 = all (255 registers at 8 warps)
    wy_bwd_warps: int = 4       # 8.68 vs 9.53 ms at 8 (12.49 at 2); no tl.trans, unlike fla's (GPU.md)
    # tree mode (tree.py): kernels read inputs / write outputs through the plan's row maps instead of
    # gathered copies (agentic batch of bench/gdn.py: 11.68 vs 12.37 ms, 82% vs 77% of ideal, H200
    # 2026-12-01, bitwise equal to trajectory-wise); False = the gathered path
    tree_rows_in_kernels: bool = True
    # tree mode: the scans of independent trees (components of the state hand-offs) run on up to this many
    # CUDA streams, so a tree's branches start when its own root is scanned; 1 = one launch per round
    tree_scan_lanes: int = 8
    # tree mode with row maps: where every sequence's rows after its first chunk are consecutive compact tokens
    # (replays fill at most the first chunk: DESIGN.md's alignment rule), the scans read those chunks at
    # row + a per-sequence shift and only the first chunk through the maps, so no row-index load stays in
    # their loops and the data is prefetched two chunks ahead, not one (scan_stages_for). H200 2026-12-01
    # (bench/gdn_scans.py --affine, fwd + bwd scan ms): agentic roots 0.574 vs 0.659 through the maps,
    # branches 1.529 vs 1.739; the agentic tree step 9.36 vs 9.52 ms (bench/gdn.py --variants maps).
    tree_affine_scan_rows: bool = True
    # tree mode with row maps: the chunk-parallel kernels (WY forward, output, dv_local, dq/dk, WY backward) read
    # and write chunks whose rows are all kept, consecutive compact tokens at row + a per-chunk shift, and only
    # chunks with replayed rows through the maps (PackedRows.chunk_shift; bitwise the same). Why: with maps those
    # kernels have 3-12% more sm_90a instructions (dq/dk 2768 vs 2544, WY backward 3320 vs 2952 and a spill).
    # H200 2026-12-01 (bench/gdn.py --variants chunk_maps): agentic tree step 8.77-8.81 vs 9.02-9.05 ms (92% vs
    # 89-90% of ideal), P16384 3.75-3.76 either way; False = every chunk through the maps
    tree_affine_chunk_rows: bool = True
    # the scans load full chunks through tensor descriptors (TMA bulk copies on sm_90; tma.py), in launches of
    # at most `scan_tma_max_block_v` state columns. H200 2026-12-01 (bench/gdn_scans.py --tma 0 1, fwd + bwd):
    # lone 16k root at 16 columns 0.577 vs 0.639 ms, P16384 tree 3.76 vs 3.81 ms (bench/gdn.py --variants
    # pointers). At 64 columns (memory-bound scans) descriptors were a wash (agentic roots 0.516 vs 0.556 ms,
    # P16384's branches 0.384 vs 0.373, trajectory-wise equal; tree steps equal with 64 or 32 here) and spill
    # on sm_90a (232 B fwd, 504 B bwd), so 32 keeps the wide launches on pointers
    scan_tma: bool = True
    scan_tma_max_block_v: int = 32
    # the backward scan's (scale exp(gc) q)^T do (state_bwd._decayed_q_do): "bf16" rounds the decayed do to bf16
    # (one wgmma; d(initial state) at 32k tokens then has 1.2x fla's error, 2.93e-3 vs 2.43e-3), "bf16x2" adds
    # its bf16 remainder in a second wgmma (2.39e-3: at or below fla's; but tree steps P16384 3.81-3.82 vs 3.76
    # ms, agentic 9.07-9.09 vs 9.00-9.01; H200 2026-12-01, bench/gdn.py --variants qdo_bf16x2), "auto" =
    # bf16x2 only in calls that return d(initial state) (an initial state that requires grad), the one
    # gradient whose error it changes beyond noise. tf32 (as fla): 2.42e-3, and slower than bf16x2.
    scan_q_do_precision: str = "auto"

    def __post_init__(self):
        if self.bwd_qk_block_k and (self.bwd_qk_block_k < 16 or self.bwd_qk_block_k & (self.bwd_qk_block_k - 1)):
            raise ValueError(f"GDNKernelConfig.bwd_qk_block_k must be 0 or a power of two >= 16 (tl.dot, "
                             f"tl.arange), got {self.bwd_qk_block_k}")
        # scan columns feed tl.arange / tl.dot
        for field, least in (("scan_block_v", 16), ("scan_warps", 1)):
            value = getattr(self, field)
            if value < least or value & (value - 1):
                raise ValueError(f"GDNKernelConfig.{field} must be a power of two >= {least}, got {value}")
        # 4 stages overflow shared memory at 32 or 64 columns and 4 warps (241 / 289 KiB, gdn_resources.py)
        if not 0 <= self.scan_num_stages <= 3:
            raise ValueError(f"GDNKernelConfig.scan_num_stages must be 0 (by dtype) or 1-3, got {self.scan_num_stages}")
        # at 16 columns sm_90a holds 6 forward / 4 backward stages (gdn_resources.py --set BV=16 --stages N)
        for depth, most, name in zip(self.narrow_scan_stages, (6, 4), ("forward", "backward")):
            if not 0 <= depth <= most:
                raise ValueError(f"GDNKernelConfig.narrow_scan_stages: the {name} depth must be 0 (as "
                                 f"scan_num_stages) or 1-{most}, got {depth}")
        if self.scan_q_do_precision not in Q_DO_PRECISIONS:
            raise ValueError(f"GDNKernelConfig.scan_q_do_precision must be one of {Q_DO_PRECISIONS}, "
                             f"got {self.scan_q_do_precision!r}")
        if self.scan_min_programs < 0:
            raise ValueError(f"GDNKernelConfig.scan_min_programs must be >= 0, got {self.scan_min_programs}")
        if self.tree_scan_lanes < 1:
            raise ValueError(f"GDNKernelConfig.tree_scan_lanes must be >= 1, got {self.tree_scan_lanes}")
        if self.wy_kkt_block_k < 16 or self.wy_kkt_block_k & (self.wy_kkt_block_k - 1):
            raise ValueError(f"GDNKernelConfig.wy_kkt_block_k must be a power of two >= 16 (tl.dot, tl.arange), "
                             f"got {self.wy_kkt_block_k}")

    def scan_q_do_code(self, initial_state_grad: bool) -> int:
        """The backward scan's QDO constexpr (1: the bf16 hi + lo q^T do) in a call that does (or does not)
        return the initial-state gradient."""
        precision = self.scan_q_do_precision
        return int(precision == "bf16x2" or (precision == "auto" and initial_state_grad))

    def scan_launch_for(self, num_seqs: int, value_heads: int, value_dim: int,
                        element_size: int, backward: bool = False) -> tuple[int, int, int]:
        """(state columns per program, warps, pipeline stages) of the forward (or `backward`) scan for a call
        with `num_seqs` sequences of `element_size`-byte inputs."""
        block_v = min(self.scan_block_v, value_dim)
        while block_v > 16 and num_seqs * value_heads * (value_dim // block_v) < self.scan_min_programs:
            block_v //= 2
        stages = self.scan_stages_for(element_size)
        narrow = self.narrow_scan_stages[int(backward)]
        if block_v == 16 and narrow and element_size <= 2:
            stages = narrow
        return block_v, self.scan_warps, stages

    def scan_stages_for(self, element_size: int) -> int:
        """Software-pipeline depth of the two state scans: `scan_num_stages`, or by input size (0).

        The scans run a sequence's chunks in one loop (between exports: state_fwd), and at 2 stages Triton
        issues a chunk's loads after the previous chunk's dots, so each chunk waits for memory; at 3 they run
        2 chunks ahead (sm_90a TTGIR; with row maps the row-index loads 2 ahead and the data 1). sm_90a shared
        memory at K=V=128, 64 columns, 4 warps (`bench/gdn_resources.py --stages 3 --set BV=64 --aligned`):
        bf16 136/217 KiB (fwd/bwd scan), with row maps 96/146. fp32 at 32 columns needs 168/240 KiB at 2
        stages, over the H200's 227 KiB (the runtime saw `OutOfResources`), 56/80 at 1."""
        if self.scan_num_stages:
            return self.scan_num_stages
        return 3 if element_size <= 2 else 1


@dataclass(frozen=True)
class PackedRows:
    """Row maps that let the kernels run a packed layout (tree mode: sequences of every round one after
    another, replayed rows included) on compact tensors, without gathered copies: packed row r reads q, k,
    v, g, beta at compact token src[r], and reads do / writes o and its input gradients at compact token
    own[r]. A replayed row (own[r] = -1 - s) writes no output and leaves its input gradients in row s of
    side buffers [num_replays, ...], for the caller to add to the tokens it replays (tree.py numbers the
    replayed rows grouped by token, so those sums read the side buffers in order)."""
    src: torch.Tensor   # [R] int64
    own: torch.Tensor   # [R] int64: compact token, or -1 - (replay slot) on replayed rows
    num_tokens: int
    num_replays: int
    # [N] int64 per sequence of the index, or None: src[r] == own[r] == r + seq_shift[n] on every row r after
    # sequence n's first chunk (GDNKernelConfig.tree_affine_scan_rows), which the scans use instead of the maps
    seq_shift: torch.Tensor | None = None
    # [NC] int64 per chunk of the index, or None: src[r] == own[r] == r + chunk_shift[c] on every row r of chunk
    # c, or NO_SHIFT (GDNKernelConfig.tree_affine_chunk_rows): the chunk-parallel kernels read those chunks at
    # row + shift, so only chunks with replayed rows or a gap in their tokens go through the maps
    chunk_shift: torch.Tensor | None = None


def row_tables(index: "GDNIndex", rows: PackedRows | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The (src, own) pointers a kernel takes: the maps of `rows`, or placeholders it never reads (GATHER off)."""
    if rows is None:
        return index.chunk_row_start, index.chunk_row_start
    return rows.src, rows.own


def scan_row_shift(index: "GDNIndex", rows: PackedRows | None, first: int) -> tuple[torch.Tensor, bool]:
    """(per-sequence shifts from sequence `first` on, whether the scans use them: AFFINE) for a scan launch;
    a placeholder the kernel never reads when `rows` has none."""
    if rows is None or rows.seq_shift is None:
        return index.seq_chunk_start, False
    return rows.seq_shift[first:], True


def chunk_shift_table(index: "GDNIndex", rows: PackedRows | None) -> tuple[torch.Tensor, bool]:
    """(the per-chunk shifts, whether a chunk-parallel launch uses them: AFFINE); a placeholder the kernel never
    reads when `rows` has none."""
    if rows is None or rows.chunk_shift is None:
        return index.chunk_row_start, False
    return rows.chunk_shift, True


def chunk_layout(cu_seqlens: np.ndarray, chunk_size: int):
    """The chunks of packed sequences `cu_seqlens`, chunk_size rows from each sequence's start: (first chunk of
    each sequence [N + 1], sequence of each chunk [NC], first row [NC], end row [NC])."""
    lengths = np.diff(cu_seqlens)
    chunks_per_seq = (lengths + chunk_size - 1) // chunk_size
    seq_chunk_start = np.concatenate([[0], np.cumsum(chunks_per_seq)]).astype(np.int64)
    chunk_seq = np.repeat(np.arange(len(lengths)), chunks_per_seq)
    row_start = cu_seqlens[chunk_seq] + (np.arange(seq_chunk_start[-1]) - seq_chunk_start[chunk_seq]) * chunk_size
    return seq_chunk_start, chunk_seq, row_start, np.minimum(row_start + chunk_size, cu_seqlens[chunk_seq + 1])


def affine_chunk_shifts(cu_seqlens: np.ndarray, src: np.ndarray, own: np.ndarray, chunk_size: int) -> np.ndarray:
    """[NC] per chunk (chunk_layout): the shift with src[r] == own[r] == r + shift on all its rows, else
    NO_SHIFT (PackedRows.chunk_shift)."""
    starts = chunk_layout(cu_seqlens, chunk_size)[2]
    if starts.size == 0:
        return np.zeros(0, dtype=np.int64)
    offset = src - np.arange(src.size)
    same = np.minimum.reduceat(offset, starts) == np.maximum.reduceat(offset, starts)
    kept = np.minimum.reduceat((src == own).astype(np.int8), starts) == 1
    return np.where(same & kept, offset[starts], NO_SHIFT).astype(np.int64)


def affine_row_shifts(cu_seqlens: np.ndarray, chunk_shifts: np.ndarray, chunk_size: int) -> np.ndarray | None:
    """[N] shifts with src[r] == own[r] == r + shift[n] on every row r after sequence n's first chunk, from the
    per-chunk shifts (affine_chunk_shifts), or None where some sequence has no such shift (PackedRows.seq_shift).
    A sequence of at most one chunk takes its chunk's shift, or 0 (the scans read its only chunk through the maps)."""
    seq_chunk_start, chunk_seq, _, _ = chunk_layout(cu_seqlens, chunk_size)
    shift = np.zeros(seq_chunk_start.size - 1, dtype=np.int64)
    nonempty = np.diff(seq_chunk_start) > 0
    shift[nonempty] = chunk_shifts[seq_chunk_start[1:][nonempty] - 1]  # the last chunk's
    later = np.arange(chunk_seq.size) > seq_chunk_start[chunk_seq]
    if not np.array_equal(chunk_shifts[later], shift[chunk_seq[later]]) or (shift[chunk_seq[later]] == NO_SHIFT).any():
        return None
    return np.where(shift == NO_SHIFT, 0, shift)


@dataclass(frozen=True)
class GDNIndex:
    chunk_size: int
    num_seqs: int
    num_chunks: int
    seq_lengths: tuple[int, ...]
    cu_seqlens: torch.Tensor        # [N+1] int64
    seq_chunk_start: torch.Tensor   # [N+1] int64, global index of each sequence's first chunk
    chunk_row_start: torch.Tensor   # [NC] int64, first packed row of each chunk
    chunk_row_end: torch.Tensor     # [NC] int64, end (exclusive) of the chunk's rows (sequence end for a tail)
    # export segments: each sequence's chunks cut after every exported state, so the scans store / inject
    # bank states between inner loops instead of loading a slot per chunk (a per-chunk dependent load kept
    # Triton from prefetching more than one chunk ahead). Sequence n owns entries
    # [seq_export_start[n], seq_export_start[n + 1]): ascending chunk counts ending a segment, the last
    # one the sequence's chunk count with slot -1 (a sentinel: every sequence has at least one entry).
    seq_export_start: torch.Tensor  # [N+1] int64
    export_end_chunk: torch.Tensor  # [S] int64, chunks of the sequence up to the end of the segment
    export_end_slot: torch.Tensor   # [S] int64, bank slot of the state leaving the segment, -1 = none
    num_slots: int                  # distinct exported (sequence, offset) states
    export_slot: torch.Tensor       # [E] int64, slot of each requested export (duplicates share a slot)
    export_slot_host: tuple[int, ...]  # the same slots on the host: backward sums duplicates without a sync
    export_seq: tuple[int, ...]
    export_offset: tuple[int, ...]
    config: GDNKernelConfig = GDNKernelConfig()


def prepare_gdn_index(cu_seqlens, export_seq=None, export_offset=None, chunk_size: int = 64,
                      device=None, config: GDNKernelConfig | None = None) -> GDNIndex:
    """Chunk tables and the export bank layout for `cu_seqlens` (host tensor or list) and the exports.

    Exports are checked again here (`inputs.check_exports`): an offset past its sequence would let the scans
    write into the next sequence's chunks.
    """
    bounds = np.asarray(torch.as_tensor(cu_seqlens).cpu().tolist(), dtype=np.int64)
    device = device if device is not None else (cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else "cpu")
    lengths = np.diff(bounds)
    seq_chunk_start, _, row_start, row_end = chunk_layout(bounds, chunk_size)
    chunks_per_seq = np.diff(seq_chunk_start)
    num_chunks = int(seq_chunk_start[-1])

    e_seq = tuple(int(x) for x in (torch.as_tensor(export_seq).reshape(-1).tolist() if export_seq is not None else ()))
    e_off = tuple(int(x) for x in (torch.as_tensor(export_offset).reshape(-1).tolist()
                                   if export_offset is not None else ()))
    check_exports(e_seq, e_off, lengths.tolist(), chunk_size, who="prepare_gdn_index")  # else scans write past
    slot_of: dict[tuple[int, int], int] = {}
    export_slot = [slot_of.setdefault((s, off), len(slot_of)) for s, off in zip(e_seq, e_off)]
    # segment ends: the distinct exports and one sentinel per sequence, sorted by (sequence, end, sentinel last)
    seg_seq = np.array([s for s, _ in slot_of] + list(range(len(lengths))), dtype=np.int64)
    seg_end = np.array([off // chunk_size for _, off in slot_of] + list(chunks_per_seq), dtype=np.int64)
    seg_slot = np.array(list(slot_of.values()) + [-1] * len(lengths), dtype=np.int64)
    order = np.lexsort((seg_slot < 0, seg_end, seg_seq))
    seq_export_start = np.searchsorted(seg_seq[order], np.arange(len(lengths) + 1))

    def as_tensor(a, dtype):
        return torch.as_tensor(np.ascontiguousarray(a), dtype=dtype, device=device)

    return GDNIndex(
        chunk_size=chunk_size, num_seqs=len(lengths), num_chunks=num_chunks,
        seq_lengths=tuple(int(x) for x in lengths), cu_seqlens=as_tensor(bounds, torch.int64),
        seq_chunk_start=as_tensor(seq_chunk_start, torch.int64), chunk_row_start=as_tensor(row_start, torch.int64),
        chunk_row_end=as_tensor(row_end, torch.int64), seq_export_start=as_tensor(seq_export_start, torch.int64),
        export_end_chunk=as_tensor(seg_end[order], torch.int64),
        export_end_slot=as_tensor(seg_slot[order], torch.int64),
        num_slots=len(slot_of), export_slot=as_tensor(np.asarray(export_slot, dtype=np.int64), torch.int64),
        export_slot_host=tuple(export_slot),
        export_seq=e_seq, export_offset=e_off, config=config or GDNKernelConfig())
