"""What one layer of a piece reads from earlier pieces and keeps for later ones (codegen/pieces.py).

A mixer of a piece asks its `LayerCarry` to extend its own rows with the carried ones:
- attention: context K/V in front of its own K/V (the piece's queries are the last T keys);
- short conv: carried conv inputs after its own rows (the conv table points there), and the carried replay rows
  of q, k, v appended to its outputs (the conv kernel writes both without concatenating the layer's rows);
- linear attention: carried replay rows of g and beta after its own rows, and the carried states its fragments
  start from.
At the same time it keeps the rows (and states) that later pieces read. Both directions are ordinary tensors:
gradients of what later pieces read flow back into this piece's graph.
"""
from __future__ import annotations

import torch


class _OwnGradient(torch.autograd.Function):
    """Identity whose backward copies the gradient. A carried input is concatenated with the piece's own rows, so
    its gradient may arrive as a slice of the whole tensor's gradient (the rounds' dg/dbeta, dK/dV), and the
    producing piece only consumes it after every later piece's backward: a slice would keep the whole [rows, width]
    buffer of every layer alive until then (measured: +15 GiB of a 65k-token piece's step), the copy only the
    carried rows."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.clone()


class _KeepRows(torch.autograd.Function):
    """(x, x[rows]): x itself, for the layer to go on with, and the rows a later piece reads. The backward adds
    the kept rows' gradient into x's own gradient in place; autograd's gather backward would build a zero tensor
    of x's size and add it to x's gradient: two passes over every kept-from tensor of every layer of every
    piece, for a few carried rows (the conv's and the rounds' carried rows are at most a chunk per cut)."""

    @staticmethod
    def forward(ctx, x, rows):
        ctx.rows, ctx.shape = rows, x.shape  # a plan tensor: nothing for activation checkpointing to save
        return x.view_as(x), x[rows]

    @staticmethod
    def backward(ctx, grad, grad_kept):
        if grad_kept is None:
            return grad, None
        if grad is None:
            grad = grad_kept.new_zeros(ctx.shape)
        elif not grad.is_contiguous():  # a strided gradient may overlap itself: add out of place
            return grad.index_add(0, ctx.rows, grad_kept), None
        # distinct rows: one addend per element, so the sum is the same as autograd's own
        return grad.index_add_(0, ctx.rows, grad_kept), None


def _keep_rows(x: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _KeepRows.apply(x, rows) if x.requires_grad else (x, x[rows])


def _carried(value, dtype):
    return _OwnGradient.apply(value.to(dtype))


class LayerCarry:
    """Carried inputs of one layer (`inputs`: kind -> tensor or tuple of tensors) and what it keeps (`kept`)."""

    def __init__(self, piece, inputs: dict):
        self.piece = piece  # the plan's PieceLaunch (device tensors)
        self.inputs = inputs
        self.kept: dict = {}

    def _keep(self, kind: str, value) -> None:
        # recomputation under activation checkpointing runs the layer again: the first forward's tensors are
        # the ones later pieces read
        self.kept.setdefault(kind, value)

    def attention_keys(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.piece.kv_out
        (k, kept_k), (v, kept_v) = _keep_rows(k, rows), _keep_rows(v, rows)
        self._keep("kv", (kept_k, kept_v))
        if "kv" not in self.inputs:
            return k, v
        context_k, context_v = self.inputs["kv"]
        return torch.cat([_carried(context_k, k.dtype), k]), torch.cat([_carried(context_v, v.dtype), v])

    def conv_rows(self, parts) -> tuple:
        """Keeps the conv input rows later pieces read; returns (the parts for the conv to read, the carried conv
        input rows [C, Ch] or None, per part the carried replay rows of its output [R, Ch_i] or None) for the
        conv (q, k, v parts)."""
        rows = self.piece.conv_out
        parts, kept = zip(*(_keep_rows(p, rows) for p in parts))
        self._keep("conv", torch.cat(kept, dim=1))
        dtype = parts[0].dtype
        tail = _carried(self.inputs["conv"], dtype) if "conv" in self.inputs else None
        appended = [None] * len(parts)
        if "replay" in self.inputs:
            appended = [_carried(c.reshape(c.shape[0], -1), dtype) for c in self.inputs["replay"][:len(parts)]]
        return parts, tail, appended

    def linear_inputs(self, q, k, v, g, beta):
        """(q, k, v, g, beta) with the carried replay rows after the own rows (q, k, v have them from the conv),
        and the carried states."""
        rows = self.piece.replay_out
        (q, k, v, g, beta), kept = zip(*(_keep_rows(t, rows) for t in (q, k, v, g, beta)))
        self._keep("replay", kept)
        if "replay" in self.inputs:
            g, beta = (torch.cat([t, _carried(c, t.dtype)]) for t, c in zip((g, beta), self.inputs["replay"][3:]))
        return (q, k, v, g, beta), self.inputs.get("states")

    def keep_states(self, states: torch.Tensor) -> None:
        self._keep("states", states)
