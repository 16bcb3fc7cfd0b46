"""The external kernels the benchmarks compare against: fla (flash-linear-attention) and FlashQLA, both optional
and never a runtime dependency, and torch's SDPA for full attention. Each chunk function (fla's signature:
[1, T, H, D] inputs) is put behind our single-call signature (`single_call`, the kernel benchmarks) or the
runtime's `gdn_kernel` / `kda_kernel` signature (`trajectory_kernel`, the end-to-end baseline); SDPA runs per
trajectory behind the runtime's `attention_kernel` signature (`TrajectorySDPA`).

Import from a script in bench/ as `from anchors import ...`.
"""
from __future__ import annotations

import os

import numpy as np
import torch


def import_fla(rule: str = "gdn"):
    """fla's chunk function of a linear-attention rule ("gdn": chunk_gated_delta_rule, "kda": chunk_kda), or
    None when fla is not importable.

    fla refuses its gated dqkwg kernel (GDN) on Triton < 3.7.1 + Hopper because Triton miscompiles it at
    BK = 64; at K = V = 128 it runs with BK = 128, which is compiled correctly, so that guard is lifted.
    fla 0.6.0 hands chunk_gated_delta_rule to FlashQLA whenever FlashQLA is importable; FLA_FLASH_QLA=0 (set here
    unless the caller set it) keeps "fla" meaning fla's own kernels, FlashQLA being an anchor of its own."""
    os.environ.setdefault("FLA_FLASH_QLA", "0")
    try:
        if rule == "kda":
            from fla.ops.kda import chunk_kda as chunk
        else:
            import fla.ops.common.chunk_o as chunk_o
            chunk_o.TRITON_ABOVE_3_7_1 = True
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk
    except Exception as exc:  # noqa: BLE001 - fla is an optional anchor
        print(f"fla unavailable: {exc!r}")
        return None
    return chunk


def import_flashqla():
    """FlashQLA's Gated DeltaNet chunk function (PyPI flash-qla, TileLang kernels; fla's call signature), or None
    when it is not importable."""
    try:
        from flash_qla import chunk_gated_delta_rule
    except Exception as exc:  # noqa: BLE001 - FlashQLA is an optional anchor
        print(f"FlashQLA unavailable: {exc!r}")
        return None
    return chunk_gated_delta_rule


def single_call(chunk):
    """A chunk function with fla's signature ([1, T, H, D] inputs) behind our single-call signature (packed rows
    [T, H, D], an initial state per sequence, no mid-sequence exports): (o, final states), the kernel
    benchmarks' anchor; None for None."""
    if chunk is None:
        return None

    def call(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, use_qk_l2norm=False, output_final_state=True,
             **_):
        o, final = chunk(q[None], k[None], v[None], g[None], beta[None], scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm,
                         cu_seqlens=cu_seqlens.long())
        return o[0], final
    return call


def fla_single_call(rule: str = "gdn"):
    """fla's chunk kernel of a rule behind our single-call signature (`single_call`); None when fla is not
    importable."""
    return single_call(import_fla(rule))


def trajectory_kernel(chunk):
    """A chunk function with fla's signature behind the runtime's `gdn_kernel` / `kda_kernel` signature, for
    trajectory-wise microbatches (every sequence starts from the zero state, no state exports): the baseline a
    trainer without HARTS would run. Grouped value heads go in as they are (fla and FlashQLA take HV a multiple
    of H natively; expanding q / k would cost the baseline a copy and a group sum). None for None."""
    if chunk is None:
        return None

    def kernel(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, export_seq=None, export_offset=None,
               chunk_size=64, use_qk_l2norm=False):
        if export_seq is not None and len(export_seq):
            raise ValueError("trajectory_kernel: trajectory-wise microbatches only (no state exports)")
        o, _ = chunk(q[None], k[None], v[None], g[None], beta[None], scale=scale, initial_state=None,
                     output_final_state=False, use_qk_l2norm_in_kernel=use_qk_l2norm,
                     cu_seqlens=cu_seqlens.to(q.device).long())
        exported = v.new_empty((0, v.shape[1], k.shape[2], v.shape[2]), dtype=torch.float32)
        return o[0], exported
    return kernel


def fla_trajectory_kernel(rule: str = "gdn"):
    """fla's chunk kernel of a linear-attention rule ("gdn": chunk_gated_delta_rule, "kda": chunk_kda) as a
    trajectory-wise kernel (`trajectory_kernel`); None when fla is not importable."""
    return trajectory_kernel(import_fla(rule))


class TrajectorySDPA:
    """Causal attention per trajectory through `torch.nn.functional.scaled_dot_product_attention` with torch's own
    backend choice (cuDNN on the H200 for these shapes): what a trajectory-wise trainer gets from torch, behind the
    runtime's `attention_kernel` signature `(q, k, v, plan, *, scale)`. K/V heads are expanded to the query heads.
    Trajectory-wise microbatches only: each trajectory is a run of rows whose keys end together (`subtree_end`);
    `add(plan, index)` records a plan's runs on the host, so the step reads nothing back from the device."""

    def __init__(self):
        self.runs = {}

    def add(self, plan, index) -> None:
        ends = np.asarray(index.subtree_end)
        starts = np.flatnonzero(np.r_[True, ends[1:] != ends[:-1]])
        if not np.array_equal(ends[starts], np.r_[starts[1:], ends.size]):
            raise ValueError("TrajectorySDPA: a microbatch of whole trajectories only (each one run of rows)")
        self.runs[id(plan)] = list(zip(starts.tolist(), ends[starts].tolist()))

    def __call__(self, q, k, v, plan, *, scale):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        outs = [torch.nn.functional.scaled_dot_product_attention(
                    *(x[start:end].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, scale=scale)
                for start, end in self.runs[id(plan)]]
        return torch.cat([o[0].transpose(0, 1) for o in outs])
