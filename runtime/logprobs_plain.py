"""Temporary plain lm_head + log-softmax + gather, used until `runtime/ops/logprobs.py` lands.

Same signature and outputs as the chunked autograd Function `ops.logprobs.token_logprobs`
(DESIGN.md section 5), but it materialises [T, vocab] logits: fine for tests and tiny models only.
"""
from __future__ import annotations

import torch

from harts_compiler.codegen.index import MicrobatchIndex

from .layers import compute_dtype


def token_logprobs_plain(hidden: torch.Tensor, lm_head_weight: torch.Tensor, index: MicrobatchIndex,
                         *, chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [T, D], lm_head_weight [V, D] -> (logprobs, entropy) [rows, max_len] (fp32, fp64 for fp64)."""
    logits = (hidden @ lm_head_weight.t()).to(compute_dtype(hidden.dtype))
    lse = torch.logsumexp(logits, dim=-1)
    entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    target_logprob = logits[index.target_src, index.target_token] - lse[index.target_src]
    if target_logprob.numel() == 0:  # only single-token trajectories: nothing is predicted
        target_logprob = lse.new_zeros(1)
    logprobs = torch.where(index.row_target >= 0, target_logprob[index.row_target.clamp(min=0)], 0.0)
    row_entropy = torch.where(index.row_pred >= 0, entropy[index.row_pred.clamp(min=0)], 0.0)
    return logprobs, row_entropy
