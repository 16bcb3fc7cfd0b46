"""Validation of `chunk_gated_delta_rule` arguments, shared by the reference and the Triton path.

Bad input must fail here with a message naming the field, not deep inside a kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GDNShapes:
    rows: int            # R, packed rows of all sequences
    key_heads: int       # HK
    value_heads: int     # HV (HV % HK == 0)
    key_dim: int         # K
    value_dim: int       # V
    seq_lengths: tuple[int, ...]   # per sequence, from cu_seqlens
    seq_starts: tuple[int, ...]
    export_seq: tuple[int, ...]
    export_offset: tuple[int, ...]


def _shape_error(name: str, tensor: torch.Tensor, expected: str, who: str = "chunk_gated_delta_rule") -> ValueError:
    return ValueError(f"{who}: `{name}` has shape {tuple(tensor.shape)}, expected {expected}")


def check_exports(export_seq, export_offset, seq_lengths, chunk_size: int, *, who: str) -> None:
    """Each export (sequence, offset) names a sequence, at a positive multiple of the chunk size inside it.
    `who` prefixes the messages (the caller, and where the lists come from)."""
    if len(export_seq) != len(export_offset):
        raise ValueError(f"{who}: `export_seq` ({len(export_seq)}) and `export_offset` ({len(export_offset)}) "
                         "differ in length")
    for i, (s, o) in enumerate(zip(export_seq, export_offset)):
        s, o = int(s), int(o)
        if not 0 <= s < len(seq_lengths):
            raise ValueError(f"{who}: `export_seq[{i}]`={s} is not a sequence index in [0, {len(seq_lengths)})")
        if o <= 0 or o % chunk_size != 0 or o > seq_lengths[s]:
            raise ValueError(f"{who}: `export_offset[{i}]`={o} must be a positive multiple of chunk_size={chunk_size} "
                             f"and <= length {seq_lengths[s]} of sequence {s}")


def validate_gdn_tensors(q, k, v, g, beta, *, who: str) -> tuple[int, int, int, int, int]:
    """Types, shapes and dtypes of q, k [R, HK, K], v [R, HV, V], g, beta [R, HV]: (R, HK, HV, K, V).
    `who` names the caller in the messages."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise _shape_error("q", q, "[R, HK, K]", who)
    rows, hk, kd = q.shape
    if k.shape != q.shape:
        raise _shape_error("k", k, f"{list(q.shape)} (same as q)", who)
    if v.dim() != 3 or v.shape[0] != rows:
        raise _shape_error("v", v, f"[{rows}, HV, V]", who)
    hv, vd = v.shape[1], v.shape[2]
    if hk == 0 or hv % hk != 0:
        raise ValueError(f"{who}: value heads of `v` ({hv}) must be a multiple of key heads of `q`/`k` ({hk})")
    if g.shape != (rows, hv):
        raise _shape_error("g", g, f"[{rows}, {hv}]", who)
    if beta.shape != (rows, hv):
        raise _shape_error("beta", beta, f"[{rows}, {hv}]", who)
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not t.is_floating_point():
            raise TypeError(f"{who}: `{name}` must be a float tensor, got {t.dtype}")
    return rows, hk, hv, kd, vd


def validate_gdn_inputs(q, k, v, g, beta, *, initial_state, cu_seqlens, export_seq, export_offset,
                        chunk_size: int) -> GDNShapes:
    """Check shapes/dtypes against docs/INTERFACES.md section 4 and return the sizes. Reads `cu_seqlens` and the
    exports on the host (the single-call API and the reference; a model's plan is checked once by codegen)."""
    rows, hk, hv, kd, vd = validate_gdn_tensors(q, k, v, g, beta, who="chunk_gated_delta_rule")
    for name, t in (("initial_state", initial_state), ("cu_seqlens", cu_seqlens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"chunk_gated_delta_rule: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_gated_delta_rule: `chunk_size` must be a positive int, got {chunk_size!r}")
    if not initial_state.is_floating_point():
        raise TypeError(f"chunk_gated_delta_rule: `initial_state` must be a float tensor, got {initial_state.dtype}")
    if initial_state.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"chunk_gated_delta_rule: `initial_state` must be fp32 or fp64, got {initial_state.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError("chunk_gated_delta_rule: `cu_seqlens` must be a 1-D int32/int64 tensor [N+1], got "
                         f"shape {tuple(cu_seqlens.shape)} dtype {cu_seqlens.dtype}")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != rows or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"chunk_gated_delta_rule: `cu_seqlens` must start at 0, be non-decreasing and end at "
                         f"R={rows}; got first={bounds[0]} last={bounds[-1]}")
    n_seq = len(bounds) - 1
    if initial_state.shape != (n_seq, hv, kd, vd):
        raise _shape_error("initial_state", initial_state, f"[{n_seq}, {hv}, {kd}, {vd}]")
    lengths = tuple(b - a for a, b in zip(bounds, bounds[1:]))

    if (export_seq is None) != (export_offset is None):
        raise ValueError("chunk_gated_delta_rule: `export_seq` and `export_offset` must be given together")
    e_seq: tuple[int, ...] = ()
    e_off: tuple[int, ...] = ()
    if export_seq is not None:
        e_seq = tuple(int(x) for x in torch.as_tensor(export_seq).reshape(-1).tolist())
        e_off = tuple(int(x) for x in torch.as_tensor(export_offset).reshape(-1).tolist())
        check_exports(e_seq, e_off, lengths, chunk_size, who="chunk_gated_delta_rule")
    return GDNShapes(rows=rows, key_heads=hk, value_heads=hv, key_dim=kd, value_dim=vd, seq_lengths=lengths,
                     seq_starts=tuple(bounds[:-1]), export_seq=e_seq, export_offset=e_off)
