"""Kimi Delta Attention (per-key-channel decay) with GDN's contract: packed rows, chunk-aligned state export,
initial states from a bank, run over the same `chunk_gdn.TreeGDNPlan` rounds. Plain torch for now
(`reference.py`); the model's rounds go through `runtime.ops.linear_attention`."""
from .reference import (chunk_kimi_delta_attention_reference, plan_kimi_delta_attention_reference,
                        recurrent_kimi_delta_attention_reference, validate_kda_inputs)

__all__ = ["chunk_kimi_delta_attention_reference", "plan_kimi_delta_attention_reference",
           "recurrent_kimi_delta_attention_reference", "validate_kda_inputs"]
