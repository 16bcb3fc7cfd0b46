"""Per-trajectory metadata of a rollout file, carried from the JSONL line to the loss.

A line may carry, besides `id` and `tokens`, what the rollout and the old policy produced (`records.
TrajectoryFields`): `reward` and `group`, or `advantage`, and per-position `old_logprobs`, `ref_logprobs`,
`response_mask`; any other field is kept untouched. `TreeBatch` checks the per-position lengths, `compile`
puts the metadata into the plan (saved with it and part of its identity), and `loss_inputs(plan)` turns it
into the runtime's `TrajectoryInputs`, so a trainer needs no side table keyed by trajectory id.
"""
from __future__ import annotations

import warnings
from collections import Counter
from typing import Iterable, Mapping, Sequence

PER_POSITION = ("old_logprobs", "ref_logprobs", "response_mask")
# names other RL stacks give the fields the loss reads: kept as plain metadata here, so a rollout file that uses
# them would silently train without its mask or old log-probs; `field_hints` names them
NEAR_MISSES = {"loss_mask": "response_mask", "action_mask": "response_mask", "assistant_mask": "response_mask",
               "response_masks": "response_mask", "old_log_probs": "old_logprobs", "old_logprob": "old_logprobs",
               "logprobs": "old_logprobs", "ref_log_probs": "ref_logprobs", "ref_logprob": "ref_logprobs",
               "advantages": "advantage", "rewards": "reward", "group_id": "group"}


def check_lengths(metadata: Mapping, length: int, where: str) -> list[str]:
    """Problems with the per-position fields of one trajectory of `length` tokens."""
    problems = []
    for name in PER_POSITION + ("advantage",):
        value = metadata.get(name)
        if isinstance(value, list) and len(value) != length:
            problems.append(f"{where}: field {name}: {len(value)} entries for {length} tokens (one per position; "
                            "entry 0 predicts nothing and is ignored)")
    return problems


def field_hints(fields: Iterable[Mapping]) -> list[str]:
    """One line per field name that another RL stack uses for a field the loss reads (`NEAR_MISSES`), set on
    trajectories that lack the field HARTS reads: such a field is kept as plain metadata and has no effect."""
    counts: Counter = Counter()
    for f in fields:
        counts.update(name for name, meant in NEAR_MISSES.items() if name in f and meant not in f)
    return [f"field {name!r} ({count} trajectories) is kept as plain metadata and not read; the loss reads "
            f"{NEAR_MISSES[name]!r}" for name, count in sorted(counts.items())]


def loss_inputs(plan, *, scale_by_std: bool = True):
    """`runtime.dp_inputs.TrajectoryInputs` of a compiled plan from its trajectories' metadata.

    Advantages: each trajectory's `advantage` when every trajectory has one; otherwise GRPO advantages of the
    `reward`s, grouped by `group` (a trajectory of an explicit tree defaults to the tree's id; a flat line
    must say its group), over the whole batch. `old_logprobs` / `ref_logprobs` / `response_mask` are used when
    every trajectory has them."""
    from harts_compiler.runtime.dp_inputs import TrajectoryInputs, group_advantages

    ids = list(plan.program.forest.traj_ids)
    metadata = plan.metadata or {}
    fields = [metadata.get(i, {}) for i in ids]
    for hint in field_hints(fields):
        warnings.warn(hint, stacklevel=2)
    if all("advantage" in f for f in fields):
        advantages = {i: f["advantage"] for i, f in zip(ids, fields)}
    else:
        missing = _first_without(ids, fields, "reward")
        if missing is not None:
            raise ValueError(f"trajectory {missing!r}: neither 'advantage' nor 'reward' in its metadata (every "
                             "trajectory needs one of them, the same one)")
        missing = _first_without(ids, fields, "group")
        if missing is not None:
            raise ValueError(f"trajectory {missing!r}: a reward without a 'group' (the rollouts of one prompt that "
                             "GRPO compares; trajectories of an explicit tree default to the tree)")
        rewards = {i: f["reward"] for i, f in zip(ids, fields)}
        groups = [f["group"] for f in fields]
        advantages = group_advantages(rewards, ids, groups, scale_by_std=scale_by_std)
    per_position = {}
    for name in PER_POSITION:
        if any(name in f for f in fields):
            missing = _first_without(ids, fields, name)
            if missing is not None:
                raise ValueError(f"trajectory {missing!r}: no {name!r} while other trajectories have it")
            per_position[name] = {i: f[name] for i, f in zip(ids, fields)}
    return TrajectoryInputs.for_plan(plan, advantages=advantages, **per_position)


def _first_without(ids: Sequence[str], fields: Sequence[Mapping], name: str):
    return next((i for i, f in zip(ids, fields) if name not in f), None)
