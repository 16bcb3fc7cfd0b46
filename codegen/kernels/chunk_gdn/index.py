"""Chunk tables of one packed layout of sequences, built on the host (numpy) and uploaded with the plan.

`GDNIndex` describes the chunks of packed varlen sequences and the export bank of the states other
sequences start from; `PackedRows` maps packed rows to compact tokens in tree mode. Both are plain
frozen dataclasses of numpy arrays until `upload.to_device` turns every array into a tensor, so the
kernels' host wrappers read Python ints (`seq_lengths`, `export_slot_host`) and never the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import GDNKernelConfig
from .inputs import check_exports

NO_SHIFT = -(1 << 62)  # PackedRows.chunk_shift of a chunk that reads its rows through the maps


@dataclass(frozen=True)
class PackedRows:
    """Row maps that let the kernels run a packed layout (tree mode: sequences of every round one after
    another, replayed rows included) on compact tensors, without gathered copies: packed row r reads q, k,
    v, g, beta at compact token src[r], and reads do / writes o and its input gradients at compact token
    own[r]. A replayed row (own[r] = -1 - s) writes no output and leaves its input gradients in row s of
    side buffers [num_replays, ...], for the caller to add to the tokens it replays (tree.py numbers the
    replayed rows grouped by token, so those sums read the side buffers in order)."""
    src: np.ndarray          # [R] int64
    own: np.ndarray          # [R] int64: compact token, or -1 - (replay slot) on replayed rows
    num_tokens: int
    num_replays: int
    # [N] per sequence: src[r] == own[r] == r + seq_shift[n] on every row r after sequence n's first chunk
    # (replays fill at most the first chunk), so the scans read those chunks without the maps
    seq_shift: np.ndarray
    # [NC] per chunk: src[r] == own[r] == r + chunk_shift[c] on every row of chunk c, or NO_SHIFT; the
    # chunk-parallel kernels read only chunks with replayed rows (or a gap in their tokens) through the maps
    chunk_shift: np.ndarray


def row_tables(index: "GDNIndex", rows: PackedRows | None):
    """The (src, own) pointers a kernel takes: the maps of `rows`, or placeholders it never reads (GATHER off)."""
    if rows is None:
        return index.chunk_row_start, index.chunk_row_start
    return rows.src, rows.own


def scan_row_shift(index: "GDNIndex", rows: PackedRows | None, first: int):
    """Per-sequence shifts from sequence `first` on for a scan launch, or a placeholder the kernel never reads."""
    return index.seq_chunk_start if rows is None else rows.seq_shift[first:]


def chunk_shift_table(index: "GDNIndex", rows: PackedRows | None):
    """The per-chunk shifts of a chunk-parallel launch, or a placeholder the kernel never reads."""
    return index.chunk_row_start if rows is None else rows.chunk_shift


def longest_first(chunks_per_seq: np.ndarray) -> np.ndarray:
    """Sequence numbers by decreasing chunk count, ties in order: the launch order of a scan
    (gates._scan_program). O(N log N)."""
    return np.argsort(-np.asarray(chunks_per_seq, dtype=np.int64), kind="stable").astype(np.int64)


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


def affine_row_shifts(cu_seqlens: np.ndarray, chunk_shifts: np.ndarray, chunk_size: int) -> np.ndarray:
    """[N] shifts with src[r] == own[r] == r + shift[n] on every row r after sequence n's first chunk, from the
    per-chunk shifts (PackedRows.seq_shift). A sequence of at most one chunk takes its chunk's shift, or 0 (the
    scans read its only chunk through the maps). Raises where a sequence has no such shift: its replayed or
    gathered rows reach past its first chunk, which the alignment rule never produces."""
    seq_chunk_start, chunk_seq, _, _ = chunk_layout(cu_seqlens, chunk_size)
    shift = np.zeros(seq_chunk_start.size - 1, dtype=np.int64)
    nonempty = np.diff(seq_chunk_start) > 0
    shift[nonempty] = chunk_shifts[seq_chunk_start[1:][nonempty] - 1]  # the last chunk's
    later = np.arange(chunk_seq.size) > seq_chunk_start[chunk_seq]
    bad = later & ((chunk_shifts != shift[chunk_seq]) | (shift[chunk_seq] == NO_SHIFT))
    if bad.any():
        seq = int(chunk_seq[np.argmax(bad)])
        raise ValueError(f"GDN plan: sequence {seq} holds replayed or non-consecutive rows after its first chunk "
                         "(replays must fit in a sequence's first chunk)")
    return np.where(shift == NO_SHIFT, 0, shift)


@dataclass(frozen=True)
class GDNIndex:
    chunk_size: int
    num_seqs: int
    num_chunks: int
    seq_lengths: tuple[int, ...]
    cu_seqlens: np.ndarray        # [N+1] int64
    seq_chunk_start: np.ndarray   # [N+1] int64, global index of each sequence's first chunk
    chunk_row_start: np.ndarray   # [NC] int64, first packed row of each chunk
    chunk_row_end: np.ndarray     # [NC] int64, end (exclusive) of the chunk's rows (sequence end for a tail)
    # export segments: each sequence's chunks cut after every exported state, so the scans store / inject
    # bank states between inner loops (no per-chunk bank load, which kept Triton from prefetching ahead).
    # Sequence n owns entries [seq_export_start[n], seq_export_start[n + 1]): ascending chunk counts ending a
    # segment, the last one the sequence's chunk count with slot -1 (every sequence has at least one entry).
    seq_export_start: np.ndarray  # [N+1] int64
    export_end_chunk: np.ndarray  # [S] int64, chunks of the sequence up to the end of the segment
    export_end_slot: np.ndarray   # [S] int64, bank slot of the state leaving the segment, -1 = none
    num_slots: int                # distinct exported (sequence, offset) states
    export_slot: np.ndarray       # [E] int64, slot of each requested export (duplicates share a slot)
    export_slot_host: tuple[int, ...]  # the same slots as ints: backward sums duplicates without a device read
    export_seq: tuple[int, ...]
    export_offset: tuple[int, ...]
    seq_order: np.ndarray         # [N] int64, the sequences longest first: a whole-index scan's launch order
    config: GDNKernelConfig = GDNKernelConfig()


def prepare_gdn_index(cu_seqlens, export_seq=(), export_offset=(), chunk_size: int = 64,
                      config: GDNKernelConfig | None = None) -> GDNIndex:
    """Chunk tables and the export bank layout of packed sequences `cu_seqlens` (ints) and the exports
    (sequence, row offset) pairs; the exports are checked (an offset past its sequence would let the scans
    write into the next sequence's chunks). Host only: O(N + NC + E)."""
    bounds = np.asarray(cu_seqlens, dtype=np.int64).reshape(-1)
    lengths = np.diff(bounds)
    seq_chunk_start, _, row_start, row_end = chunk_layout(bounds, chunk_size)
    chunks_per_seq = np.diff(seq_chunk_start)
    e_seq = tuple(int(x) for x in np.asarray(export_seq, dtype=np.int64).reshape(-1))
    e_off = tuple(int(x) for x in np.asarray(export_offset, dtype=np.int64).reshape(-1))
    check_exports(e_seq, e_off, lengths.tolist(), chunk_size, who="GDN plan")
    slot_of: dict[tuple[int, int], int] = {}
    export_slot = [slot_of.setdefault((s, off), len(slot_of)) for s, off in zip(e_seq, e_off)]
    # segment ends: the distinct exports and one sentinel per sequence, sorted by (sequence, end, sentinel last)
    seg_seq = np.array([s for s, _ in slot_of] + list(range(len(lengths))), dtype=np.int64)
    seg_end = np.array([off // chunk_size for _, off in slot_of] + list(chunks_per_seq), dtype=np.int64)
    seg_slot = np.array(list(slot_of.values()) + [-1] * len(lengths), dtype=np.int64)
    order = np.lexsort((seg_slot < 0, seg_end, seg_seq))
    seq_export_start = np.searchsorted(seg_seq[order], np.arange(len(lengths) + 1)).astype(np.int64)
    return GDNIndex(
        chunk_size=chunk_size, num_seqs=len(lengths), num_chunks=int(seq_chunk_start[-1]),
        seq_lengths=tuple(int(x) for x in lengths), cu_seqlens=bounds,
        seq_chunk_start=seq_chunk_start, chunk_row_start=row_start.astype(np.int64),
        chunk_row_end=row_end.astype(np.int64), seq_export_start=seq_export_start,
        export_end_chunk=seg_end[order], export_end_slot=seg_slot[order],
        num_slots=len(slot_of), export_slot=np.asarray(export_slot, dtype=np.int64),
        export_slot_host=tuple(export_slot), export_seq=e_seq, export_offset=e_off,
        seq_order=longest_first(chunks_per_seq), config=config or GDNKernelConfig())
