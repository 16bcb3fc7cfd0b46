"""What a tree run as pieces carries between them, and the peak memory of its step (the stated memory model).

Per piece p (its `codegen.index.PieceContext`), summed over the layers that read each kind:

    carried(p) = context keys x K/V bytes per token (full-attention layers)
               + carried conv rows x conv channels + carried replay rows x (q, k, v, g, beta) (linear layers)
               + carried states x HV x K x V x 4 bytes (fp32, linear layers)

A step runs every piece's forward, then the backwards, last piece first (`runtime.pieces`), so every piece's
autograd graph is alive at the peak; with activation recomputation a piece keeps its layer inputs, then one
layer's activations are alive at a time:

    peak(tree) = sum_p [ kept(p) + carried(p) ] + max_p transient(p)

With `TreeModel(offload_piece_inputs=True)` the pieces before the last keep their layer inputs in host memory
(runtime/ops/offload.py) and bring back one layer's at a time, so on the device

    peak(tree, offloaded) = sum_p carried(p) + kept(last) + max_p transient(p)

and sum_{p < last} kept(p) waits in pinned host memory.

kept and transient come from `verify_memory.activation_bytes` (kept: the checkpointed layer inputs; transient:
the rest of that estimate). Parameters, gradients and optimizer state are not included (they do not depend on
the plan). The numbers are an estimate to compare plans and budgets by, not a measurement.
"""
from __future__ import annotations

import dataclasses

from .verify_memory import Footprint, activation_bytes


@dataclasses.dataclass(frozen=True)
class PieceMemory:
    tokens: int
    context_tokens: int
    carried_bytes: int
    kept_bytes: int
    transient_bytes: int


def _per_row_bytes(config, dtype_bytes: int) -> dict[str, int]:
    attention = sum(kind == "full_attention" for kind in config.layer_types)
    linear = len(config.layer_types) - attention
    qk_dim, v_dim = config.attention_head_dims
    kv_heads = config.num_attention_heads if config.is_kimi else config.num_key_value_heads  # MLA: per head
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    heads = config.linear_num_value_heads
    decay = heads * config.linear_key_head_dim if config.is_kimi else heads  # KDA: per key channel
    return {
        "kv": attention * kv_heads * (qk_dim + v_dim) * dtype_bytes,
        "conv": linear * (2 * key_dim + value_dim) * dtype_bytes,
        "replay": linear * ((2 * key_dim + value_dim + heads) * dtype_bytes + 4 * decay),
        "state": linear * heads * config.linear_key_head_dim * config.linear_value_head_dim * 4,
    }


def piece_memory(chain, config, dtype_bytes: int, *, checkpointing: bool = True) -> list[PieceMemory]:
    """The memory model's numbers for every piece of a `codegen.pieces.PieceChain`."""
    row = _per_row_bytes(config, dtype_bytes)
    out = []
    for index in chain.indices:
        ctx = index.context
        carried = (ctx.num_keys * row["kv"] + ctx.conv_rows * row["conv"] + ctx.replay_rows * row["replay"]
                   + ctx.num_states * row["state"])
        size = Footprint(tokens=index.num_tokens, linear_rows=sum(len(r.row_src) for r in index.rounds))
        total = activation_bytes(config, dtype_bytes, index.chunk_size, size, checkpointing=checkpointing)
        kept = config.num_hidden_layers * config.hidden_size * size.tokens * dtype_bytes if checkpointing else total
        out.append(PieceMemory(tokens=index.num_tokens, context_tokens=ctx.num_keys, carried_bytes=int(carried),
                               kept_bytes=int(kept), transient_bytes=int(max(total - kept, 0))))
    return out


def offloaded_bytes(pieces: list[PieceMemory]) -> int:
    """What `offload_piece_inputs` keeps in host memory: the layer inputs of every piece but the last."""
    return sum(p.kept_bytes for p in pieces[:-1])


def predicted_peak(pieces: list[PieceMemory], *, offloaded: bool = False) -> int:
    """peak(tree) of the memory model, or peak(tree, offloaded) (module docstring)."""
    kept = sum(p.kept_bytes for p in pieces) - (offloaded_bytes(pieces) if offloaded else 0)
    return kept + sum(p.carried_bytes for p in pieces) + max((p.transient_bytes for p in pieces), default=0)
