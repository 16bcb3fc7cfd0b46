"""Block-sparse visit lists of the tree mask, built once per microbatch, on the device.

Query block ``m`` covers compact rows ``[m*BM, min((m+1)*BM, T))``, key block ``n`` covers
``[n*BN, min((n+1)*BN, T))``. With the mask ``j <= i < subtree_end[j]`` (and ``subtree_end[j] > j``):

- the pair (m, n) has *some* visible element iff ``kstart < qend`` and (the ranges overlap, so a
  key sees itself, or ``max(subtree_end[Kn]) > qstart``) -- exact, from one per-block maximum;
- the pair is *full* (every element visible, no per-element mask) iff every key precedes every
  query (``kend - 1 <= qstart``) and ``min(subtree_end[Kn]) >= qend``, and neither block is cut
  by the end of the sequence (so the kernels' unmasked loops need no bounds checks either).

Lists are CSR-style int32 tensors. In each row the full blocks come first, in increasing order,
then the partially masked ones: kernels run an unmasked loop and a masked loop, with the mask
decided at compile time rather than per iteration. The transposed lists (query blocks visiting
each key block) drive the dk/dv kernel, so it owns its key block's gradients: no atomics.
``*_order`` lists rows by decreasing work, so the longest programs start first (load balance).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class BlockIndex:
    block_m: int
    block_n: int
    num_tokens: int
    # per query block m: key blocks q_cols[q_ptr[m]:q_ptr[m+1]], the first q_full[m] of them full
    q_ptr: torch.Tensor      # [NM+1] int32
    q_cols: torch.Tensor     # [nnz] int32
    q_full: torch.Tensor     # [NM] int32
    q_order: torch.Tensor    # [NM] int32, query blocks by decreasing visit count
    # per key block n: query blocks k_rows[k_ptr[n]:k_ptr[n+1]], the first k_full[n] of them full
    k_ptr: torch.Tensor      # [NN+1] int32
    k_rows: torch.Tensor     # [nnz] int32
    k_full: torch.Tensor     # [NN] int32
    k_order: torch.Tensor    # [NN] int32
    subtree_end: torch.Tensor = field(repr=False, compare=False, default=None)
    # lists at other block sizes, built on first request (kernels may tile differently)
    _derived: dict = field(repr=False, compare=False, default_factory=dict)

    def with_blocks(self, block_m: int, block_n: int) -> "BlockIndex":
        """The visit lists of the same mask at other block sizes (built once, then cached)."""
        if (block_m, block_n) == (self.block_m, self.block_n):
            return self
        key = (block_m, block_n)
        if key not in self._derived:
            self._derived[key] = build_block_index(self.subtree_end, block_m, block_n)
        return self._derived[key]

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
    def device(self) -> torch.device:
        return self.q_ptr.device


def _block_reduce(values: torch.Tensor, block: int, fill: int, reduce: str) -> torch.Tensor:
    # [T] -> [ceil(T/block)] max or min over each block (padding with a neutral `fill`)
    n_blocks = -(-values.shape[0] // block)
    padded = values.new_full((n_blocks * block,), fill)
    padded[:values.shape[0]] = values
    padded = padded.view(n_blocks, block)
    return padded.amax(dim=1) if reduce == "max" else padded.amin(dim=1)


def _csr(visible: torch.Tensor, full: torch.Tensor):
    """Rows of `visible` [R, C] as CSR lists, full entries first within each row."""
    n_rows, n_cols = visible.shape
    rows, cols = visible.nonzero(as_tuple=True)
    is_full = full[rows, cols]
    # stable order: row, then full before partial, then column
    key = rows * (2 * n_cols) + (~is_full).to(rows.dtype) * n_cols + cols
    order = torch.argsort(key)
    counts = visible.sum(dim=1)
    ptr = torch.zeros(n_rows + 1, dtype=torch.int64, device=visible.device)
    ptr[1:] = torch.cumsum(counts, dim=0)
    n_full = full.sum(dim=1)
    work_order = torch.argsort(counts, descending=True, stable=True)
    return (ptr.to(torch.int32), cols[order].to(torch.int32), n_full.to(torch.int32),
            work_order.to(torch.int32))


def build_block_index(subtree_end: torch.Tensor, block_m: int, block_n: int) -> BlockIndex:
    """Visit lists of the tree mask for query blocks of `block_m` rows and key blocks of
    `block_n` rows, on `subtree_end`'s device (vectorised: no Python loop over blocks)."""
    if subtree_end.dim() != 1:
        raise ValueError(f"subtree_end must be 1-D [T], got shape {tuple(subtree_end.shape)}")
    if subtree_end.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"subtree_end must be int32 or int64, got {subtree_end.dtype}")
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size < 1 or size & (size - 1):
            raise ValueError(f"{name} must be a positive power of two, got {size}")
    n_tokens = subtree_end.shape[0]
    device = subtree_end.device
    ends = subtree_end.to(torch.int64)
    if n_tokens:
        index = torch.arange(n_tokens, device=device)
        if bool(((ends <= index) | (ends > n_tokens)).any()):
            raise ValueError("subtree_end must satisfy i < subtree_end[i] <= T for every token")
    n_q_blocks = -(-n_tokens // block_m)
    n_k_blocks = -(-n_tokens // block_n)
    q_start = torch.arange(n_q_blocks, device=device)[:, None] * block_m        # [NM, 1]
    q_end_nominal = q_start + block_m
    q_end = q_end_nominal.clamp(max=n_tokens)
    k_start = torch.arange(n_k_blocks, device=device)[None, :] * block_n        # [1, NN]
    k_end_nominal = k_start + block_n
    k_end = k_end_nominal.clamp(max=n_tokens)
    if n_tokens:
        max_end = _block_reduce(ends, block_n, 0, "max")[None, :]
        min_end = _block_reduce(ends, block_n, n_tokens, "min")[None, :]
    else:
        max_end = min_end = k_start
    overlap = (k_start < q_end) & (k_end > q_start)
    visible = (k_start < q_end) & (overlap | (max_end > q_start))
    full = (visible & (k_end - 1 <= q_start) & (min_end >= q_end)
            & (q_end_nominal <= n_tokens) & (k_end_nominal <= n_tokens))
    q_ptr, q_cols, q_full, q_order = _csr(visible, full)
    k_ptr, k_rows, k_full, k_order = _csr(visible.T, full.T)
    return BlockIndex(block_m, block_n, n_tokens, q_ptr, q_cols, q_full, q_order,
                      k_ptr, k_rows, k_full, k_order, subtree_end)
