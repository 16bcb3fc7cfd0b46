"""Dense plain-torch oracle of `token_logprobs`: full [T, V] logits, log_softmax, gather.

No deduplication, no chunking, no custom backward: every (row, p) reads the log-softmax row of
the compact token predicting it (`index.row_pred`) at the token it predicts. Only for tests and
benchmarks (it holds [T, V] logits and their softmax in fp32).
"""
from __future__ import annotations

import torch


def dense_token_logprobs(hidden: torch.Tensor, lm_head_weight: torch.Tensor, index, *,
                         temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `token_logprobs` (logprobs, entropy) [rows, max_len]."""
    acc_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = (hidden @ lm_head_weight.t()).to(acc_dtype) / temperature  # [T, V]
    log_p = torch.log_softmax(logits, dim=-1)
    token_entropy = -(log_p.exp() * log_p).sum(dim=-1)  # [T]
    row_pred, row_target, target_token = (torch.as_tensor(getattr(index, name), device=hidden.device).long()
                                          for name in ("row_pred", "row_target", "target_token"))
    valid = row_pred >= 0
    pred = row_pred.clamp(min=0)
    predicted = torch.where(valid, target_token[row_target.clamp(min=0)], 0) \
        if target_token.numel() else torch.zeros_like(pred)
    logprobs = log_p[pred, predicted].masked_fill(~valid, 0.0)
    entropy = token_entropy[pred].masked_fill(~valid, 0.0)
    return logprobs, entropy
