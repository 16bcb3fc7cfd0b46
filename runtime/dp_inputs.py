"""Per-trajectory loss inputs of a data-parallel step, and the batch-global loss normalisers.

An RL loss needs, besides the log-probs the model computes, per-trajectory data produced by the
rollout and the old policy: advantages (one per trajectory or one per token), old and reference
log-probs, a response mask. Trainers hold them keyed by trajectory id; every microbatch returns
its rows in its own order (`MicrobatchIndex.trajectory_ids`), so `TrajectoryInputs` stores them
once as struct-of-arrays in the plan's trajectory order and gathers `[rows, max_len]` tensors for
any row order (`rows_for`).

`GlobalNormalisers` are the loss denominators of the whole batch (token-mean: counted tokens;
seq-mean: trajectories with at least one counted token). They depend only on trajectory lengths
and the response mask, so every rank knows them from the plan before any compute: no collective.

Per-token arrays of a trajectory of length L have L entries indexed by position, like the
`TreeOutput.logprobs` rows; entry 0 (no prediction) is ignored.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Hashable, Mapping, Sequence

import numpy as np
import torch

from harts_compiler.objectives import grpo_advantages


@dataclasses.dataclass(frozen=True)
class GlobalNormalisers:
    """Loss denominators over every rank and slot (see `harts_compiler.objectives.aggregate`)."""

    num_tokens: int  # counted tokens of the batch (>= 1 so that an all-masked batch gives 0)
    num_sequences: int  # trajectories with at least one counted token (>= 1 likewise)
    trajectory_tokens: int  # tokens of all trajectories, the weight base of per-microbatch aux losses


@dataclasses.dataclass
class RowInputs:
    """Loss inputs gathered into one microbatch's row order; tensors [rows, max_len] unless noted."""

    trajectory_ids: list[str]
    advantages: torch.Tensor  # [rows] (per trajectory) or [rows, max_len] (per token)
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    response_mask: torch.Tensor | None  # bool


@dataclasses.dataclass(frozen=True, eq=False)
class TrajectoryInputs:
    """Per-trajectory loss inputs in the order of `trajectory_ids` (the plan's trajectory order).

    Per-token fields are flat arrays over all trajectories (`offsets` like a CSR pointer).
    Build with `from_mappings`, which checks every id and length and names what is wrong.
    """

    trajectory_ids: list[str]
    offsets: np.ndarray  # [n_traj + 1]
    advantages: np.ndarray  # [n_traj] (per trajectory) or [total tokens] (per token)
    per_token_advantages: bool
    old_logprobs: np.ndarray | None  # [total tokens]
    ref_logprobs: np.ndarray | None
    response_mask: np.ndarray | None  # [total tokens] bool

    @classmethod
    def from_mappings(cls, trajectory_ids: Sequence[str], lengths: Sequence[int], *,
                      advantages: Mapping[str, object],
                      old_logprobs: Mapping[str, object] | None = None,
                      ref_logprobs: Mapping[str, object] | None = None,
                      response_mask: Mapping[str, object] | None = None) -> "TrajectoryInputs":
        """`advantages[id]`: a number or an array of the trajectory's length; the others: arrays
        of its length. Every mapping must hold exactly the ids of `trajectory_ids`."""
        ids = [str(i) for i in trajectory_ids]
        lengths = np.asarray(lengths, np.int64)
        if lengths.shape != (len(ids),):
            raise ValueError(f"lengths: {lengths.shape[0] if lengths.ndim else 0} lengths for "
                             f"{len(ids)} trajectory ids")
        if lengths.size and lengths.min() < 1:
            raise ValueError(f"lengths: trajectory {ids[int(np.argmin(lengths))]!r} is empty")
        offsets = np.zeros(len(ids) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        scalar = [np.ndim(_value(advantages, i, "advantages")) == 0 for i in ids]
        if all(scalar):
            adv = np.asarray([float(advantages[i]) for i in ids], np.float64)
        else:  # any per-token entry: broadcast the scalar ones over their trajectory
            adv = np.concatenate([np.full(n, float(advantages[i])) if s else
                                  _per_token(advantages, i, n, "advantages", np.float64)
                                  for i, n, s in zip(ids, lengths.tolist(), scalar)])
        _no_extra_ids(advantages, ids, "advantages")

        def flat(mapping, name, dtype):
            if mapping is None:
                return None
            _no_extra_ids(mapping, ids, name)
            parts = [_per_token(mapping, i, n, name, dtype) for i, n in zip(ids, lengths.tolist())]
            return np.concatenate(parts) if parts else np.zeros(0, dtype)

        return cls(trajectory_ids=ids, offsets=offsets, advantages=adv,
                   per_token_advantages=not all(scalar),
                   old_logprobs=flat(old_logprobs, "old_logprobs", np.float64),
                   ref_logprobs=flat(ref_logprobs, "ref_logprobs", np.float64),
                   response_mask=flat(response_mask, "response_mask", bool))

    @classmethod
    def for_plan(cls, plan, **mappings) -> "TrajectoryInputs":
        """`from_mappings` over the trajectories of a compiled plan."""
        forest = plan.program.forest
        return cls.from_mappings(forest.traj_ids, forest.traj_length, **mappings)

    @functools.cached_property
    def _position(self) -> dict[str, int]:
        return {i: j for j, i in enumerate(self.trajectory_ids)}

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def counted_tokens(self) -> np.ndarray:
        """[n_traj] loss tokens per trajectory: positions 1..L-1, restricted to the response mask."""
        if self.response_mask is None:
            return self.lengths - 1
        counted = self.response_mask.copy()
        counted[self.offsets[:-1]] = False  # position 0 predicts nothing
        if not counted.size:
            return np.zeros(len(self.trajectory_ids), np.int64)
        return np.add.reduceat(counted.astype(np.int64), self.offsets[:-1])

    def normalisers(self) -> GlobalNormalisers:
        per_traj = self.counted_tokens()
        return GlobalNormalisers(num_tokens=max(int(per_traj.sum()), 1),
                                 num_sequences=max(int((per_traj > 0).sum()), 1),
                                 trajectory_tokens=int(self.lengths.sum()))

    def rows_for(self, trajectory_ids: Sequence[str], max_len: int, *, dtype=torch.float32,
                 device="cpu") -> RowInputs:
        """Gather into `[rows, max_len]` right-padded tensors for this row order."""
        position = self._position
        missing = [i for i in trajectory_ids if i not in position]
        if missing:
            raise KeyError(f"TrajectoryInputs: no inputs for trajectory id(s) {missing[:5]}")
        traj = np.asarray([position[i] for i in trajectory_ids], np.int64)
        lengths = self.lengths[traj]
        if lengths.size and lengths.max() > max_len:
            raise ValueError(f"rows_for: max_len={max_len} < longest row ({int(lengths.max())})")
        row = np.repeat(np.arange(traj.size), lengths)
        col = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        src = self.offsets[traj][row] + col

        def gather(flat, fill, out_dtype):
            if flat is None:
                return None
            grid = np.full((traj.size, max_len), fill, dtype=flat.dtype)
            grid[row, col] = flat[src]
            return torch.as_tensor(grid).to(device=device, dtype=out_dtype)

        advantages = (gather(self.advantages, 0.0, dtype) if self.per_token_advantages else
                      torch.as_tensor(self.advantages[traj]).to(device=device, dtype=dtype))
        return RowInputs(trajectory_ids=list(trajectory_ids), advantages=advantages,
                         old_logprobs=gather(self.old_logprobs, 0.0, dtype),
                         ref_logprobs=gather(self.ref_logprobs, 0.0, dtype),
                         response_mask=gather(self.response_mask, False, torch.bool))


def group_advantages(rewards: Mapping[str, float], trajectory_ids: Sequence[str],
                     groups: Mapping[str, Hashable] | Sequence[Hashable], *,
                     scale_by_std: bool = True) -> dict[str, float]:
    """GRPO advantages of the whole batch (groups may span ranks, so every rank computes them
    from all rewards, which are cheap to hold). `groups`: one group per id, e.g. the tree."""
    ids = [str(i) for i in trajectory_ids]
    _no_extra_ids(rewards, ids, "rewards")
    values = torch.as_tensor([float(_value(rewards, i, "rewards")) for i in ids], dtype=torch.float64)
    group_list = [_value(groups, i, "groups") for i in ids] if isinstance(groups, Mapping) else list(groups)
    advantages = grpo_advantages(values, group_list, scale_by_std=scale_by_std)
    return dict(zip(ids, advantages.tolist()))


def _value(mapping, traj_id: str, name: str):
    try:
        return mapping[traj_id]
    except KeyError:
        raise KeyError(f"{name}: no entry for trajectory id {traj_id!r}") from None


def _per_token(mapping, traj_id: str, length: int, name: str, dtype) -> np.ndarray:
    value = _value(mapping, traj_id, name)
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    array = np.asarray(value, dtype=dtype)
    if array.shape != (length,):
        raise ValueError(f"{name}[{traj_id!r}]: shape {array.shape}, expected ({length},) "
                         f"(one entry per position of the trajectory)")
    return array


def _no_extra_ids(mapping, ids: list[str], name: str) -> None:
    if isinstance(mapping, Mapping) and len(mapping) != len(ids):
        extra = sorted(set(map(str, mapping)) - set(ids))
        raise KeyError(f"{name}: unknown trajectory id(s) {extra[:5]}" if extra else
                       f"{name}: {len(mapping)} entries for {len(ids)} trajectories")
