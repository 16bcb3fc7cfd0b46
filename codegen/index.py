"""Per-microbatch index tensors: the one thing the runtime reads from a compiled plan.

Codegen turns a scheduled microbatch of the IR into a `MicrobatchIndex` once; every layer of the
forward and backward then only gathers and scatters with these tensors. The field contract is
docs/INTERFACES.md section 3; all compact indices are local to the microbatch.

`trajectory_index()` builds the same structure for trajectory-wise execution (every trajectory its
own packed sequence, nothing shared), so the baseline runs through exactly the same runtime code.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch


@dataclasses.dataclass
class LinearRound:
    """One packed varlen linear-attention call (see docs/INTERFACES.md section 3)."""

    cu_seqlens: torch.Tensor  # [N+1] int32, packed rows per sequence
    row_src: torch.Tensor  # [R] int64, compact token of each packed row (replay rows included)
    own_rows: torch.Tensor  # [R_own] int64, packed rows whose outputs are kept
    own_dst: torch.Tensor  # [R_own] int64, compact tokens those rows are
    init_state: torch.Tensor  # [N] int64, bank id of each sequence's initial state, -1 = zeros
    export_seq: torch.Tensor  # [E] int64, sequence (in this round) of each exported state
    export_offset: torch.Tensor  # [E] int64, local row offset (positive multiple of C, <= length)
    export_bank: torch.Tensor  # [E] int64, bank id the exported state is stored under

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_rows(self) -> int:
        return self.row_src.numel()


@dataclasses.dataclass
class MicrobatchIndex:
    """Index tensors of one microbatch (docs/INTERFACES.md section 3)."""

    trajectory_ids: list[str]
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, RoPE positions
    multiplicity: torch.Tensor  # [T] int64, trajectories containing the token (0 = context only)
    conv_pred: torch.Tensor  # [T, W-1] int64, path predecessors oldest first, -1 before position 0
    subtree_end: torch.Tensor  # [T] int32, tree mask: q attends k iff k <= q < subtree_end[k]
    rounds: list[LinearRound]
    num_states: int  # exported-state bank size over all rounds
    target_src: torch.Tensor  # [P] int64, compact token whose logits predict target p
    target_token: torch.Tensor  # [P] int64
    row_target: torch.Tensor  # [rows, max_len] int64, index into P, -1 at p=0 and padding
    row_pred: torch.Tensor  # [rows, max_len] int64, compact token predicting (row, p), -1 likewise
    lengths: torch.Tensor  # [rows] int64
    chunk_size: int
    conv_width: int

    @property
    def num_tokens(self) -> int:
        return self.token_ids.numel()

    @property
    def device(self) -> torch.device:
        return self.token_ids.device

    def to(self, device) -> "MicrobatchIndex":
        def move(value):
            if isinstance(value, torch.Tensor):
                return value.to(device)
            if isinstance(value, LinearRound):
                return LinearRound(**{f.name: move(getattr(value, f.name)) for f in dataclasses.fields(value)})
            if isinstance(value, list) and value and isinstance(value[0], LinearRound):
                return [move(r) for r in value]
            return value

        return MicrobatchIndex(**{f.name: move(getattr(self, f.name)) for f in dataclasses.fields(self)})

    def check(self) -> None:
        """Cheap shape/range checks (host-side); raises ValueError naming the field."""
        T, W = self.num_tokens, self.conv_width
        expect = {
            "positions": (T,), "multiplicity": (T,), "conv_pred": (T, W - 1), "subtree_end": (T,),
            "lengths": (len(self.trajectory_ids),), "target_src": (self.target_src.numel(),),
            "target_token": (self.target_src.numel(),),
        }
        for name, shape in expect.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"MicrobatchIndex.{name}: shape {got}, expected {shape}")
        if self.row_target.shape != self.row_pred.shape or self.row_target.shape[0] != len(self.trajectory_ids):
            raise ValueError("MicrobatchIndex.row_target/row_pred: shapes disagree with trajectory_ids")
        own = torch.cat([r.own_dst for r in self.rounds]) if self.rounds else torch.empty(0, dtype=torch.long)
        # compared on the index's device: one host sync, no copy of a T-long tensor to the host
        if own.numel() != T or not torch.equal(torch.sort(own).values, torch.arange(T, device=own.device)):
            raise ValueError("MicrobatchIndex.rounds: own_dst must cover every compact token exactly once")


def _as_i64(values) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values, dtype=np.int64))


def trajectory_index(
    token_lists: Sequence[Sequence[int]],
    trajectory_ids: Sequence[str] | None = None,
    *,
    chunk_size: int = 64,
    conv_width: int = 4,
    device: torch.device | str = "cpu",
) -> MicrobatchIndex:
    """Index tensors for trajectory-wise execution: each trajectory is its own sequence.

    Nothing is shared: compact tokens are the trajectories' tokens concatenated, every sequence
    starts from the zero state in a single round, and the tree mask degenerates to per-trajectory
    causal masks. O(total tokens), vectorised.
    """
    arrays = [np.asarray(t, dtype=np.int64) for t in token_lists]
    if not arrays or any(a.ndim != 1 or a.size == 0 for a in arrays):
        raise ValueError("trajectory_index: need at least one non-empty 1-D token list per trajectory")
    ids = [str(i) for i in range(len(arrays))] if trajectory_ids is None else [str(i) for i in trajectory_ids]
    lengths = np.array([a.size for a in arrays], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    ends = starts + lengths
    T = int(lengths.sum())
    owner = np.repeat(np.arange(len(arrays)), lengths)
    positions = np.arange(T) - starts[owner]

    # conv_pred[i, j] = i - (W-1) + j when that position exists on i's trajectory
    back = np.arange(conv_width - 1) - (conv_width - 1)
    conv_pred = np.arange(T)[:, None] + back[None, :]
    conv_pred[positions[:, None] + back[None, :] < 0] = -1

    # targets: token p of every trajectory (p >= 1) is predicted by compact token (start + p - 1)
    max_len = int(lengths.max())
    p = np.arange(max_len)[None, :]
    valid = (p >= 1) & (p < lengths[:, None])
    row_pred = np.where(valid, starts[:, None] + p - 1, -1)
    row_target = np.full(valid.shape, -1, dtype=np.int64)
    row_target[valid] = np.arange(int(valid.sum()))
    target_src = row_pred[valid]
    target_token = np.concatenate(arrays)[target_src + 1]

    rows = torch.arange(T, dtype=torch.long)
    one_round = LinearRound(
        cu_seqlens=torch.as_tensor(np.concatenate([[0], ends]), dtype=torch.int32),
        row_src=rows, own_rows=rows, own_dst=rows.clone(),
        init_state=torch.full((len(arrays),), -1, dtype=torch.long),
        export_seq=torch.empty(0, dtype=torch.long), export_offset=torch.empty(0, dtype=torch.long),
        export_bank=torch.empty(0, dtype=torch.long),
    )
    index = MicrobatchIndex(
        trajectory_ids=ids,
        token_ids=_as_i64(np.concatenate(arrays)),
        positions=_as_i64(positions),
        multiplicity=torch.ones(T, dtype=torch.long),
        conv_pred=_as_i64(conv_pred).reshape(T, conv_width - 1),
        subtree_end=torch.as_tensor(ends[owner], dtype=torch.int32),
        rounds=[one_round],
        num_states=0,
        target_src=_as_i64(target_src),
        target_token=_as_i64(target_token),
        row_target=_as_i64(row_target),
        row_pred=_as_i64(row_pred),
        lengths=_as_i64(lengths),
        chunk_size=chunk_size,
        conv_width=conv_width,
    )
    index.check()
    return index.to(device)
