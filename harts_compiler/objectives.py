"""Token-level RL objectives (PPO-clip, GRPO) over trajectory-wise tensors.

Every tensor here has the layout that trajectory-wise training hands to a loss and that
`TreeModel` returns (`out.logprobs`, `out.entropy`, `out.lengths`): ``[rows, max_len]``,
right-padded, position ``p`` holding ``log P(token_p | tokens_<p)``; position 0 and padding carry
no log-prob. So the same loss runs unchanged on tree-mode and trajectory-wise outputs.

Which tokens count: ``1 <= p < lengths[row]``, intersected with an optional ``response_mask``
(e.g. 1 on model-generated tokens, 0 on prompt and tool-output tokens).

Aggregation (how per-token losses become one scalar):
- ``"token-mean"``:          sum over all counted tokens / ``num_tokens``
- ``"seq-mean-token-sum"``:  sum over sequences of (sum over its tokens) / ``num_sequences``
- ``"seq-mean-token-mean"``: sum over sequences of (mean over its tokens) / ``num_sequences``

``num_tokens`` / ``num_sequences`` default to this call's counts (sequences with at least one
counted token). With several microbatches or data-parallel ranks, pass the *global* counts
(`global_counts` all-reduces them): the per-call losses then add up (over microbatches and
ranks) to the loss of the whole batch. DDP *averages* gradients over ranks, so multiply the loss
by the world size there to get the gradient of that sum.

All functions are plain torch, differentiable in ``logprobs`` (and ``entropy``), and return a
loss to *minimise*.
"""
from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_ESTIMATORS = ("k1", "k3")
# exp() of a log-ratio beyond this overflows or is meaningless; clamped as in common PPO stacks
_MAX_LOG_RATIO = 20.0


@dataclasses.dataclass
class LossOutput:
    """The scalar loss to minimise and detached statistics: ``pg_loss``, ``kl_ref`` and
    ``entropy`` are the terms as aggregated into the loss (same normalisers); ``clip_fraction``,
    ``dual_clip_fraction`` and ``approx_kl_old`` are means over this call's counted tokens."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


def loss_mask(lengths: torch.Tensor, max_len: int,
              response_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Bool [rows, max_len]: positions ``1 <= p < lengths[row]``, and ``response_mask`` if given."""
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be [rows], got shape {tuple(lengths.shape)}")
    positions = torch.arange(max_len, device=lengths.device)[None, :]
    mask = (positions >= 1) & (positions < lengths[:, None])
    if response_mask is not None:
        if response_mask.shape != mask.shape:
            raise ValueError(f"response_mask must be [rows, max_len] = {tuple(mask.shape)}, "
                             f"got {tuple(response_mask.shape)}")
        mask = mask & response_mask.to(torch.bool)
    return mask


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", *,
              num_tokens: float | torch.Tensor | None = None,
              num_sequences: float | torch.Tensor | None = None) -> torch.Tensor:
    """Reduce per-token ``values`` [rows, max_len] over ``mask`` to a scalar (see module doc)."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {mode!r}")
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} differ in shape")
    mask = mask.to(torch.bool)
    masked = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    if mode == "token-mean":
        denominator = mask.sum().clamp(min=1) if num_tokens is None else _positive(num_tokens, "num_tokens")
        return masked.sum() / denominator
    per_sequence = masked.sum(dim=-1)
    tokens_per_sequence = mask.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        per_sequence = per_sequence / tokens_per_sequence.clamp(min=1)
    if num_sequences is None:
        denominator = (tokens_per_sequence > 0).sum().clamp(min=1)
    else:
        denominator = _positive(num_sequences, "num_sequences")
    return per_sequence.sum() / denominator


def global_counts(masks: Sequence[torch.Tensor], *, process_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_tokens, num_sequences) over all ``masks`` (e.g. `loss_mask` of every microbatch of
    this rank's step), summed over the data-parallel ranks when torch.distributed is initialised.
    Pass the results as ``num_tokens`` / ``num_sequences`` to every loss call of the step.
    Every rank must call this (it is a collective when distributed)."""
    if not masks:
        raise ValueError("global_counts: need at least one mask")
    device = masks[0].device
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for mask in masks:
        mask = mask.to(device=device, dtype=torch.bool)
        counts[0] += mask.sum()
        counts[1] += (mask.sum(dim=-1) > 0).sum()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(counts, group=process_group)
    counts = counts.clamp(min=1)  # an all-empty step gives loss 0, not 0 / 0
    return counts[0], counts[1]


def _positive(value, name: str):
    if isinstance(value, torch.Tensor):
        return value  # may live on the device; checking it would force a host sync
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return value


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman's k1/k3).

    k1 = log pi - log ref (unbiased, can be negative);
    k3 = exp(log ref - log pi) - (log ref - log pi) - 1 (unbiased, >= 0, lower variance).
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"kl_type must be one of {KL_ESTIMATORS}, got {kind!r}")
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    reverse = (-log_ratio).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(reverse) - reverse - 1.0


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor | None,
                  advantages: torch.Tensor, lengths: torch.Tensor, *,
                  response_mask: torch.Tensor | None = None,
                  clip_ratio_low: float = 0.2, clip_ratio_high: float | None = None,
                  dual_clip: float | None = None, aggregation: str = "token-mean",
                  num_tokens=None, num_sequences=None,
                  ref_logprobs: torch.Tensor | None = None, kl_coef: float = 0.0,
                  kl_type: str = "k3", entropy: torch.Tensor | None = None,
                  entropy_coef: float = 0.0) -> LossOutput:
    """Token-level PPO clipped surrogate (+ optional KL penalty and entropy bonus).

    logprobs       [rows, max_len] current policy (differentiable)
    old_logprobs   [rows, max_len] behaviour policy, or None for on-policy (= logprobs.detach())
    advantages     [rows] (one per trajectory) or [rows, max_len] (per token)
    lengths        [rows]; with ``response_mask`` [rows, max_len] defines the counted tokens
    clip_ratio_low/high  ratio clipped to [1 - low, 1 + high] (high defaults to low)
    dual_clip      c > 1: for negative advantages the loss is capped at -A * c (dual-clip PPO)
    ref_logprobs, kl_coef, kl_type  adds kl_coef * aggregate(kl_penalty(logprobs, ref, kl_type))
    entropy, entropy_coef           subtracts entropy_coef * aggregate(entropy)

    Per token: ratio = exp(logprobs - old), loss = max(-A ratio, -A clip(ratio)) (then the dual
    clip); aggregated with ``aggregation`` and the optional global normalisers.
    """
    mask = _check_and_mask(logprobs, lengths, response_mask, old_logprobs=old_logprobs,
                           ref_logprobs=ref_logprobs, entropy=entropy)
    clip_ratio_high = clip_ratio_low if clip_ratio_high is None else clip_ratio_high
    if not (0.0 <= clip_ratio_low < 1.0) or not clip_ratio_high >= 0.0:
        raise ValueError(f"clip ratios must satisfy 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, "
                         f"got {clip_ratio_low!r}, {clip_ratio_high!r}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip!r}")
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef!r} needs ref_logprobs (the reference policy's log-probs)")
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError(f"entropy_coef={entropy_coef!r} needs entropy (e.g. TreeOutput.entropy)")
    advantages = _per_token(advantages, logprobs, "advantages")
    # padding and unmasked positions may hold anything (0, -inf, NaN): neutralise them so that
    # no inf/NaN reaches the loss or leaks into gradients through 0 * NaN
    current = logprobs.detach()
    old_logprobs = current if old_logprobs is None else torch.where(mask, old_logprobs, current)
    if ref_logprobs is not None:
        ref_logprobs = torch.where(mask, ref_logprobs, current)
    if entropy is not None:
        entropy = torch.where(mask, entropy, torch.zeros_like(entropy))
    advantages = torch.where(mask, advantages, torch.zeros_like(advantages))

    log_ratio = (logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(mask)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual_clipped = (advantages < 0) & (per_token > cap)
        per_token = torch.where(dual_clipped, cap, per_token)

    normalisers = dict(num_tokens=num_tokens, num_sequences=num_sequences)
    loss = aggregate(per_token, mask, aggregation, **normalisers)
    n_local = mask.sum().clamp(min=1)
    metrics = {
        "pg_loss": loss.detach(),
        "clip_fraction": ((clipped > unclipped) & mask).sum() / n_local,
        "dual_clip_fraction": (dual_clipped & mask).sum() / n_local,
        "approx_kl_old": torch.where(mask, 0.5 * log_ratio.detach() ** 2, 0.0).sum() / n_local,
    }
    if ref_logprobs is not None:
        kl = aggregate(kl_penalty(logprobs, ref_logprobs, kl_type), mask, aggregation, **normalisers)
        if kl_coef != 0.0:
            loss = loss + kl_coef * kl
        metrics["kl_ref"] = kl.detach()
    if entropy is not None:
        entropy_term = aggregate(entropy, mask, aggregation, **normalisers)
        if entropy_coef != 0.0:
            loss = loss - entropy_coef * entropy_term
        metrics["entropy"] = entropy_term.detach()
    return LossOutput(loss, metrics)


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor | Sequence[Hashable], *,
                    scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages [rows]: (r - mean of its group) / (std of its group + eps).

    ``group_ids``: one id per row (ints, strings, ...); rows with equal ids form a group (e.g.
    the samples of one prompt/tree). ``scale_by_std=False`` only centres (Dr. GRPO). The std is
    the unbiased sample std; a group of one row gets advantage 0 (no baseline to compare with).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [rows], got shape {tuple(rewards.shape)}")
    if not rewards.dtype.is_floating_point:
        raise ValueError(f"rewards must be floating point, got {rewards.dtype}")
    group = _group_indices(group_ids, rewards.shape[0], rewards.device)
    n_groups = int(group.max().item()) + 1 if group.numel() else 0
    count = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, group, torch.ones_like(rewards))
    mean = torch.zeros_like(count).index_add_(0, group, rewards) / count
    centred = rewards - mean[group]
    if not scale_by_std:
        return centred
    sum_sq = torch.zeros_like(count).index_add_(0, group, centred ** 2)
    std = torch.sqrt(sum_sq / (count - 1).clamp(min=1))
    scale = std[group] + eps
    # a constant group (or a single row) has centred == 0 exactly: keep it 0 even with eps == 0
    return centred / torch.where(scale > 0, scale, torch.ones_like(scale))


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor | None, rewards: torch.Tensor,
              group_ids, lengths: torch.Tensor, *, scale_by_std: bool = True,
              kl_coef: float = 0.0, kl_type: str = "k3", **ppo_kwargs) -> LossOutput:
    """GRPO: PPO-clip loss with group-normalised, per-trajectory advantages.

    ``rewards`` [rows] and ``group_ids`` as in `grpo_advantages`; every other keyword as in
    `ppo_clip_loss` (``ref_logprobs`` with ``kl_coef`` > 0 gives GRPO's KL term, k3 by default).
    The advantages are returned in ``metrics["advantages"]``.
    """
    advantages = grpo_advantages(rewards.detach(), group_ids, scale_by_std=scale_by_std)
    out = ppo_clip_loss(logprobs, old_logprobs, advantages, lengths, kl_coef=kl_coef,
                        kl_type=kl_type, **ppo_kwargs)
    out.metrics["advantages"] = advantages
    return out


def _group_indices(group_ids, n_rows: int, device) -> torch.Tensor:
    if isinstance(group_ids, torch.Tensor):
        if group_ids.shape != (n_rows,) or group_ids.dtype.is_floating_point:
            raise ValueError(f"group_ids must be an integer [rows={n_rows}] tensor, got "
                             f"{group_ids.dtype} {tuple(group_ids.shape)}")
        return torch.unique(group_ids.to(device), return_inverse=True)[1]
    ids = list(group_ids)
    if len(ids) != n_rows:
        raise ValueError(f"group_ids must have one id per row ({n_rows}), got {len(ids)}")
    numbering: dict = {}
    return torch.tensor([numbering.setdefault(g, len(numbering)) for g in ids],
                        dtype=torch.long, device=device)


def _per_token(values: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    if values.shape == like.shape:
        return values.to(like.dtype)
    if values.shape == like.shape[:1]:
        return values.to(like.dtype)[:, None].expand_as(like)
    raise ValueError(f"{name} must be [rows] or [rows, max_len] = {tuple(like.shape)}, "
                     f"got {tuple(values.shape)}")


def _check_and_mask(logprobs, lengths, response_mask, **same_shape) -> torch.Tensor:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [rows, max_len], got shape {tuple(logprobs.shape)}")
    for name, tensor in same_shape.items():
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(f"{name} must have the shape of logprobs {tuple(logprobs.shape)}, "
                             f"got {tuple(tensor.shape)}")
    if lengths.shape != logprobs.shape[:1]:
        raise ValueError(f"lengths must be [rows={logprobs.shape[0]}], got {tuple(lengths.shape)}")
    return loss_mask(lengths.to(logprobs.device), logprobs.shape[1], response_mask)
