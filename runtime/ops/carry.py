"""What one layer of a piece reads from earlier pieces and keeps for later ones (codegen/pieces.py).

A mixer of a piece asks its `LayerCarry` to extend its own rows with the carried ones:
- attention: context K/V in front of its own K/V (the piece's queries are the last T keys);
- short conv: carried conv inputs after its own rows (the conv table points there);
- linear attention: carried replay rows after its own rows, and the carried states its fragments start from.
At the same time it keeps the rows (and states) that later pieces read. Both directions are ordinary tensors:
gradients of what later pieces read flow back into this piece's graph.
"""
from __future__ import annotations

import torch


class _OwnGradient(torch.autograd.Function):
    """Identity whose backward copies the gradient. A carried input is concatenated with the piece's own rows, so
    its gradient arrives as a slice of the whole tensor's gradient (conv dx, the rounds' dq/dk/dv, dK/dV), and the
    producing piece only consumes it after every later piece's backward: a slice would keep the whole [rows, width]
    buffer of every layer alive until then (measured: +15 GiB of a 65k-token piece's step), the copy only the
    carried rows."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.clone()


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
        self._keep("kv", (k[rows], v[rows]))
        if "kv" not in self.inputs:
            return k, v
        context_k, context_v = self.inputs["kv"]
        return torch.cat([_carried(context_k, k.dtype), k]), torch.cat([_carried(context_v, v.dtype), v])

    def conv_inputs(self, mixed: torch.Tensor) -> torch.Tensor:
        self._keep("conv", mixed[self.piece.conv_out])
        if "conv" not in self.inputs:
            return mixed
        return torch.cat([mixed, _carried(self.inputs["conv"], mixed.dtype)])

    def linear_inputs(self, q, k, v, g, beta):
        """(q, k, v, g, beta) with the carried replay rows after the own rows, and the carried states."""
        own = (q, k, v, g, beta)
        rows = self.piece.replay_out
        self._keep("replay", tuple(t[rows] for t in own))
        if "replay" in self.inputs:
            own = tuple(torch.cat([t, _carried(c, t.dtype)]) for t, c in zip(own, self.inputs["replay"]))
        return own, self.inputs.get("states")

    def keep_states(self, states: torch.Tensor) -> None:
        self._keep("states", states)
