"""Per-microbatch index tables: what codegen derives from a compiled plan, on the host.

Codegen turns a scheduled microbatch of the IR into a `MicrobatchIndex` (numpy arrays, local compact
indices); `codegen.lower` then builds the launch plan the runtime reads from it. The field contract is
docs/INTERFACES.md section 3.

`trajectory_index()` builds the same structure for trajectory-wise execution (every trajectory its
own packed sequence, nothing shared), so the baseline runs through exactly the same runtime code.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


def host_array(value, dtype=np.int64) -> np.ndarray:
    """An index field as a host numpy array (tensors are copied off their device: host-side input only)."""
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(value), dtype=dtype)


@dataclasses.dataclass
class LinearRound:
    """One packed varlen linear-attention call (see docs/INTERFACES.md section 3)."""

    cu_seqlens: np.ndarray  # [N+1], packed rows per sequence
    row_src: np.ndarray  # [R], compact token of each packed row (replay rows included)
    own_rows: np.ndarray  # [R_own], packed rows whose outputs are kept
    own_dst: np.ndarray  # [R_own], compact tokens those rows are
    init_state: np.ndarray  # [N], bank id of each sequence's initial state, -1 = zeros
    export_seq: np.ndarray  # [E], sequence (in this round) of each exported state
    export_offset: np.ndarray  # [E], local row offset (positive multiple of C, <= length)
    export_bank: np.ndarray  # [E], bank id the exported state is stored under

    def __post_init__(self):
        for field in dataclasses.fields(self):
            setattr(self, field.name, host_array(getattr(self, field.name)).reshape(-1))

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.size - 1

    @property
    def num_rows(self) -> int:
        return self.row_src.size


@dataclasses.dataclass(frozen=True)
class PieceRows:
    """The part of a piece's context (PieceContext) that the runtime reads too (codegen.lower.PieceLaunch): how
    many conv input rows, replay rows and states the piece carries in, and its own rows that later pieces read."""

    conv_rows: int
    replay_rows: int
    num_states: int
    kv_out: np.ndarray  # own rows whose K/V later pieces read
    conv_out: np.ndarray  # own rows whose conv inputs later pieces read
    replay_out: np.ndarray  # own rows later pieces replay


@dataclasses.dataclass(frozen=True)
class PieceContext(PieceRows):
    """What a piece of a split tree reads from the pieces before it and keeps for the pieces after it
    (codegen/pieces.py). Row spaces beyond the piece's own T tokens:

    - attention keys: the context's Nc keys first, then the T own tokens (own `subtree_end` is in this space);
    - conv inputs: conv_pred values in [T, T + conv_rows) are carried conv inputs (pre-conv rows);
    - linear attention: row_src values in [T, T + replay_rows) are carried replay rows (q, k, v, g, beta as the
      rounds read them); one extra round-0 sequence keeps them (its outputs are discarded, its gradients are 0);
    - states: init_state -2-j starts a sequence from carried state j.
    The `*_out` arrays list what later pieces read: own rows (K/V, conv inputs, replay rows) and bank ids."""

    kv_subtree_end: np.ndarray  # [Nc] subtree end of each context key, in the key space
    state_out: np.ndarray  # bank ids of the states later pieces start from

    def __post_init__(self):
        for name in ("kv_subtree_end", "kv_out", "conv_out", "replay_out", "state_out"):
            object.__setattr__(self, name, host_array(getattr(self, name)).reshape(-1))

    @property
    def num_keys(self) -> int:
        return self.kv_subtree_end.size


_TABLES = ("token_ids", "positions", "multiplicity", "conv_pred", "subtree_end", "target_src", "target_token",
           "row_target", "row_pred", "lengths")


@dataclasses.dataclass
class MicrobatchIndex:
    """Index tables of one microbatch (docs/INTERFACES.md section 3), int64 numpy arrays on the host."""

    trajectory_ids: list[str]
    token_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T], RoPE positions
    multiplicity: np.ndarray  # [T], trajectories containing the token (0 = context only)
    conv_pred: np.ndarray  # [T, W-1], path predecessors oldest first, -1 before position 0
    subtree_end: np.ndarray  # [T], tree mask: q attends k iff k <= q < subtree_end[k]
    rounds: list[LinearRound]
    num_states: int  # exported-state bank size over all rounds
    target_src: np.ndarray  # [P], compact token whose logits predict target p
    target_token: np.ndarray  # [P]
    row_target: np.ndarray  # [rows, max_len], index into P, -1 at p=0 and padding
    row_pred: np.ndarray  # [rows, max_len], compact token predicting (row, p), -1 likewise
    lengths: np.ndarray  # [rows]
    chunk_size: int
    conv_width: int
    context: PieceContext | None = None  # a piece of a split tree: what it reads from earlier pieces

    def __post_init__(self):
        for name in _TABLES:
            setattr(self, name, host_array(getattr(self, name)))
        self.trajectory_ids = [str(i) for i in self.trajectory_ids]

    @property
    def num_tokens(self) -> int:
        return self.token_ids.size

    def check(self) -> None:
        """Shape and coverage checks; raises ValueError naming the field. O(T log T)."""
        T, W = self.num_tokens, self.conv_width
        ctx = self.context
        conv_rows, replay_rows = (0, 0) if ctx is None else (ctx.conv_rows, ctx.replay_rows)
        expect = {
            "token_ids": (T,), "positions": (T,), "multiplicity": (T,), "conv_pred": (T + conv_rows, W - 1),
            "subtree_end": (T,), "lengths": (len(self.trajectory_ids),), "target_src": (self.target_src.size,),
            "target_token": (self.target_src.size,),
        }
        for name, shape in expect.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"MicrobatchIndex.{name}: shape {got}, expected {shape}")
        if self.row_target.shape != self.row_pred.shape or self.row_target.shape[0] != len(self.trajectory_ids):
            raise ValueError("MicrobatchIndex.row_target/row_pred: shapes disagree with trajectory_ids")
        own = np.concatenate([r.own_dst for r in self.rounds]) if self.rounds else np.zeros(0, np.int64)
        if own.size != T + replay_rows or not np.array_equal(np.sort(own), np.arange(T + replay_rows)):
            raise ValueError("MicrobatchIndex.rounds: own_dst must cover every compact token exactly once")
        keys = T if ctx is None else T + ctx.num_keys
        if self.subtree_end.size and (self.subtree_end.min() < 1 or self.subtree_end.max() > keys):
            raise ValueError(f"MicrobatchIndex.subtree_end: values must lie in [1, {keys}]")
        if self.conv_pred.size and self.conv_pred.max() >= T + conv_rows:
            raise ValueError(f"MicrobatchIndex.conv_pred: values must be < {T + conv_rows}")


def trajectory_index(
    token_lists: Sequence[Sequence[int]],
    trajectory_ids: Sequence[str] | None = None,
    *,
    chunk_size: int = 64,
    conv_width: int = 4,
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

    rows = np.arange(T, dtype=np.int64)
    none = np.zeros(0, np.int64)
    one_round = LinearRound(cu_seqlens=np.concatenate([[0], ends]), row_src=rows, own_rows=rows, own_dst=rows,
                            init_state=np.full(len(arrays), -1), export_seq=none, export_offset=none,
                            export_bank=none)
    index = MicrobatchIndex(
        trajectory_ids=ids,
        token_ids=np.concatenate(arrays),
        positions=positions,
        multiplicity=np.ones(T, dtype=np.int64),
        conv_pred=conv_pred.reshape(T, conv_width - 1),
        subtree_end=ends[owner],
        rounds=[one_round],
        num_states=0,
        target_src=target_src,
        target_token=target_token,
        row_target=row_target,
        row_pred=row_pred,
        lengths=lengths,
        chunk_size=chunk_size,
        conv_width=conv_width,
    )
    index.check()
    return index
