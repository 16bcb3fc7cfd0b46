"""Block-sparse visit lists of the tree mask, built once per microbatch on the host (numpy).

Keys are the compact rows ``[0, Tk)``; queries are the last ``Tq`` of them, ``[q0, Tk)`` with
``q0 = Tk - Tq`` (``Tq = Tk``, ``q0 = 0``: every token queries; ``Tq < Tk``: the first ``q0`` keys are
context, e.g. an earlier microbatch's ancestor tokens). The query grid is shifted to start at ``q0``:
query block ``m`` covers the local query rows ``[m*BM, min((m+1)*BM, Tq))``, i.e. the global rows
``q0 + m*BM ...``, so no query block is ragged at its start whatever ``q0`` is; key block ``n`` covers
``[n*BN, min((n+1)*BN, Tk))``. With the mask ``j <= i < subtree_end[j]`` (``i`` global,
``subtree_end[j] > j``):

- the pair (m, n) has *some* visible element iff ``kstart < qend`` and (the ranges overlap, so a
  key sees itself, or ``max(subtree_end[Kn]) > qstart``) -- exact, from one per-block maximum;
- the pair is *full* (every element visible, no per-element mask) iff every key precedes every
  query (``kend - 1 <= qstart``) and ``min(subtree_end[Kn]) >= qend``, and neither block is cut
  by the end of the sequence (so the kernels' unmasked loops need no bounds checks either).
Both tests only compare row ranges, so they hold for the shifted query grid as they are.

Lists are CSR-style int32 tensors. In each row the full blocks come first, in increasing order,
then the partially masked ones: kernels run an unmasked loop and a masked loop, with the mask
decided at compile time rather than per iteration. The transposed lists (query blocks visiting
each key block) drive the dk/dv kernel, so it owns its key block's gradients: no atomics.
``*_order`` lists rows by decreasing work, so the longest programs start first (load balance).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class BlockIndex:
    block_m: int
    block_n: int
    num_tokens: int        # Tk: keys, the length of subtree_end
    num_queries: int       # Tq <= Tk: the last Tq tokens query (query_offset = Tk - Tq)
    # per query block m: key blocks q_cols[q_ptr[m]:q_ptr[m+1]], the first q_full[m] of them full
    q_ptr: np.ndarray      # [NM+1] int32
    q_cols: np.ndarray     # [nnz] int32
    q_full: np.ndarray     # [NM] int32
    q_order: np.ndarray    # [NM] int32, query blocks by decreasing visit count
    # per key block n: query blocks k_rows[k_ptr[n]:k_ptr[n+1]], the first k_full[n] of them full
    k_ptr: np.ndarray      # [NN+1] int32
    k_rows: np.ndarray     # [nnz] int32
    k_full: np.ndarray     # [NN] int32
    k_order: np.ndarray    # [NN] int32
    # the lists of the same mask at the other tiles the kernels use, built with this one (`with_tiles`)
    tiles: dict = field(default_factory=dict, repr=False, compare=False)

    def with_tiles(self, subtree_end, tiles) -> "BlockIndex":
        """This index with the lists at every (block_m, block_n) of `tiles` built too (host)."""
        extra = {tile: build_block_index(subtree_end, *tile, num_queries=self.num_queries) for tile in tiles
                 if tile != (self.block_m, self.block_n)}
        return BlockIndex(**{**{f: getattr(self, f) for f in self.__dataclass_fields__ if f != "tiles"},
                             "tiles": {**self.tiles, **extra}})

    def with_blocks(self, block_m: int, block_n: int) -> "BlockIndex":
        """The lists at tile (block_m, block_n): this index's own, or one built with it (`with_tiles`)."""
        if (block_m, block_n) == (self.block_m, self.block_n):
            return self
        if (block_m, block_n) not in self.tiles:
            raise ValueError(f"block index: no lists at tile ({block_m}, {block_n}); build them with "
                             f"with_tiles (this index has {[(self.block_m, self.block_n), *self.tiles]})")
        return self.tiles[(block_m, block_n)]

    @property
    def query_offset(self) -> int:
        """Global row of local query row 0 (Tk - Tq)."""
        return self.num_tokens - self.num_queries

    @property
    def num_query_blocks(self) -> int:
        return self.q_full.shape[0]

    @property
    def num_key_blocks(self) -> int:
        return self.k_full.shape[0]

    @property
    def num_visits(self) -> int:
        return self.q_cols.shape[0]

    @property
    def device(self):
        """The device of an uploaded index, None on the host."""
        return self.q_ptr.device if hasattr(self.q_ptr, "is_cuda") else None


def _block_reduce(values: np.ndarray, block: int, fill: int, reduce) -> np.ndarray:
    # [T] -> [ceil(T/block)] max or min over each block (padding with a neutral `fill`)
    n_blocks = -(-values.shape[0] // block)
    padded = np.full(n_blocks * block, fill, dtype=values.dtype)
    padded[:values.shape[0]] = values
    return reduce(padded.reshape(n_blocks, block), axis=1)


def _csr(visible: np.ndarray, full: np.ndarray):
    """Rows of `visible` [R, C] as CSR lists, full entries first within each row."""
    n_rows, n_cols = visible.shape
    rows, cols = np.nonzero(visible)
    is_full = full[rows, cols]
    # stable order: row, then full before partial, then column
    order = np.argsort(rows * (2 * n_cols) + (~is_full).astype(np.int64) * n_cols + cols, kind="stable")
    counts = visible.sum(axis=1)
    ptr = np.concatenate([[0], np.cumsum(counts)])
    work_order = np.argsort(-counts, kind="stable")
    as32 = lambda a: np.ascontiguousarray(a, dtype=np.int32)  # noqa: E731
    return as32(ptr), as32(cols[order]), as32(full.sum(axis=1)), as32(work_order)


def build_block_index(subtree_end, block_m: int, block_n: int, num_queries: int | None = None) -> BlockIndex:
    """Visit lists of the tree mask for query blocks of `block_m` rows and key blocks of `block_n` rows
    (vectorised, O(NM x NN)). `subtree_end` [Tk]: host array (a tensor is copied to the host).
    `num_queries`: Tq, the queries being the last Tq tokens (default all Tk)."""
    ends = np.asarray(subtree_end.cpu() if hasattr(subtree_end, "cpu") else subtree_end)
    if ends.ndim != 1:
        raise ValueError(f"subtree_end must be 1-D [T], got shape {tuple(ends.shape)}")
    if ends.dtype not in (np.int32, np.int64):
        raise ValueError(f"subtree_end must be int32 or int64, got {ends.dtype}")
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size < 1 or size & (size - 1):
            raise ValueError(f"{name} must be a positive power of two, got {size}")
    n_tokens = ends.shape[0]
    n_queries = n_tokens if num_queries is None else int(num_queries)
    if not 0 <= n_queries <= n_tokens:
        raise ValueError(f"num_queries must be in [0, T={n_tokens}], got {num_queries}")
    ends = ends.astype(np.int64)
    if n_tokens and np.any((ends <= np.arange(n_tokens)) | (ends > n_tokens)):
        raise ValueError("subtree_end must satisfy i < subtree_end[i] <= T for every token")
    n_q_blocks, n_k_blocks = -(-n_queries // block_m), -(-n_tokens // block_n)
    # global rows of the shifted query grid
    q_start = n_tokens - n_queries + np.arange(n_q_blocks)[:, None] * block_m        # [NM, 1]
    q_end_nominal = q_start + block_m
    q_end = np.minimum(q_end_nominal, n_tokens)
    k_start = np.arange(n_k_blocks)[None, :] * block_n        # [1, NN]
    k_end_nominal = k_start + block_n
    k_end = np.minimum(k_end_nominal, n_tokens)
    if n_tokens:
        max_end = _block_reduce(ends, block_n, 0, np.max)[None, :]
        min_end = _block_reduce(ends, block_n, n_tokens, np.min)[None, :]
    else:
        max_end = min_end = k_start
    overlap = (k_start < q_end) & (k_end > q_start)
    visible = (k_start < q_end) & (overlap | (max_end > q_start))
    full = (visible & (k_end - 1 <= q_start) & (min_end >= q_end)
            & (q_end_nominal <= n_tokens) & (k_end_nominal <= n_tokens))
    q_ptr, q_cols, q_full, q_order = _csr(visible, full)
    k_ptr, k_rows, k_full, k_order = _csr(visible.T, full.T)
    return BlockIndex(block_m, block_n, n_tokens, n_queries, q_ptr, q_cols, q_full, q_order,
                      k_ptr, k_rows, k_full, k_order)


def query_windows(subtree_end, query_block: int = 256,
                  num_queries: int | None = None) -> tuple[tuple[int, int, int], ...]:
    """The plain-torch path's blocking: (start, end, lo) per query block [start, end), lo = the first key
    still open at `start` (subtree_end[k] > start, k < start), else start; keys before lo are masked for the
    whole block. The first such k is the first whose running maximum of subtree_end exceeds start. O(T).
    `num_queries`: Tq, the queries being the last Tq of the T tokens; the blocks then start at q0 = T - Tq.
    start, end and lo are global token rows (keys [lo, end)); a suffix's query rows are [start - q0, end - q0)."""
    ends = np.asarray(subtree_end, dtype=np.int64)
    n_queries = ends.size if num_queries is None else int(num_queries)
    if not 0 <= n_queries <= ends.size:
        raise ValueError(f"num_queries must be in [0, T={ends.size}], got {num_queries}")
    starts = np.arange(ends.size - n_queries, ends.size, query_block)
    if not starts.size:
        return ()
    first_open = np.searchsorted(np.maximum.accumulate(ends), starts, side="right")
    lows = np.minimum(first_open, starts)
    return tuple((int(s), int(min(s + query_block, ends.size)), int(lo)) for s, lo in zip(starts, lows))
