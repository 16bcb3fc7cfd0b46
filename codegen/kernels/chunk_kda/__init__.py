"""Kimi Delta Attention (per-key-channel decay) with GDN's contract: packed rows, chunk-aligned state export,
initial states from a bank, run over the same `chunk_gdn.TreeGDNPlan` rounds (docs/kda_kernels.md).

`kimi_delta_attention` runs a plan with the Triton kernels in one autograd Function, `chunk_kimi_delta_attention`
is the fla-style single call; `reference.py` holds the plain-torch forms they are tested against.
"""
from .config import KDAKernelConfig
from .function import chunk_kimi_delta_attention
from .reference import (chunk_kimi_delta_attention_reference, plan_kimi_delta_attention_reference,
                        recurrent_kimi_delta_attention_reference, validate_kda_inputs)
from .tree import kimi_delta_attention

__all__ = ["KDAKernelConfig", "chunk_kimi_delta_attention", "chunk_kimi_delta_attention_reference",
           "kimi_delta_attention", "plan_kimi_delta_attention_reference", "recurrent_kimi_delta_attention_reference",
           "validate_kda_inputs"]
