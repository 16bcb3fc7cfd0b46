"""The loss a data-parallel step minimises per microbatch, with batch-global normalisers.

A loss function is called once per non-empty (rank, slot) as `loss_fn(output, context)` and
returns a scalar tensor or a `LossOutput`. Its values, summed over all microbatches of all ranks,
must be the loss of the whole batch: that holds for the token-level objectives of
`harts_compiler.objectives` when they are given the global normalisers in `context.normalisers`
(a sum over microbatches of sums over their tokens, divided by one batch-wide constant).

MoE load-balancing loss: `TreeOutput.aux_loss` is the trajectory-wise aux loss of *one
microbatch* (normalised by that microbatch's trajectory tokens); it is not a sum over tokens, so
the batch's aux loss cannot be split exactly over microbatches without a second pass. The step
weights each microbatch's aux loss by its share of the batch's trajectory tokens
(`context.aux_weight`), so the weighted terms add up to a token-weighted mean of per-microbatch
aux losses (Megatron-style per-microbatch balancing; equal to the batch's aux loss with one
microbatch).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Union

import torch

from harts_compiler.objectives import LossOutput, ppo_clip_loss

from .dp_inputs import GlobalNormalisers, RowInputs
from .model import TreeOutput


@dataclasses.dataclass(frozen=True)
class LossContext:
    """What a loss function gets besides the model output of one microbatch."""

    rows: RowInputs  # per-trajectory inputs gathered into the output's row order
    normalisers: GlobalNormalisers  # batch-global denominators (all ranks, all slots)
    aux_weight: float  # this microbatch's trajectory tokens / the batch's trajectory tokens


LossFn = Callable[[TreeOutput, LossContext], Union[torch.Tensor, LossOutput]]


@dataclasses.dataclass(frozen=True)
class PPOObjective:
    """PPO-clip (GRPO when the advantages are group-normalised) with optional KL and entropy terms
    and a token-weighted MoE aux loss; see `harts_compiler.objectives.ppo_clip_loss`."""

    aggregation: str = "token-mean"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float | None = None
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_type: str = "k3"
    entropy_coef: float = 0.0
    aux_loss_coef: float = 0.0

    def __call__(self, output: TreeOutput, context: LossContext) -> LossOutput:
        rows, norm = context.rows, context.normalisers
        result = ppo_clip_loss(
            output.logprobs, rows.old_logprobs, rows.advantages, output.lengths,
            response_mask=rows.response_mask, clip_ratio_low=self.clip_ratio_low,
            clip_ratio_high=self.clip_ratio_high, dual_clip=self.dual_clip,
            aggregation=self.aggregation, num_tokens=norm.num_tokens,
            num_sequences=norm.num_sequences, ref_logprobs=rows.ref_logprobs,
            kl_coef=self.kl_coef, kl_type=self.kl_type, entropy=output.entropy,
            entropy_coef=self.entropy_coef)
        if self.aux_loss_coef and output.aux_loss is not None:
            aux = context.aux_weight * output.aux_loss
            result.loss = result.loss + self.aux_loss_coef * aux
            result.metrics["aux_loss"] = aux.detach()
        return result
