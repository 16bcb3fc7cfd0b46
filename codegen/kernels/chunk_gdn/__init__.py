"""Chunkwise Gated DeltaNet with state export and gradient injection (docs/INTERFACES.md section 4)."""
from .function import ChunkGatedDeltaRuleFunction, chunk_gated_delta_rule
from .index import GDNIndex, GDNKernelConfig, prepare_gdn_index
from .reference import (
    chunk_gated_delta_rule_reference,
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_reference,
)

__all__ = [
    "ChunkGatedDeltaRuleFunction",
    "GDNIndex",
    "GDNKernelConfig",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_reference",
    "prepare_gdn_index",
    "recurrent_gated_delta_rule",
    "recurrent_gated_delta_rule_reference",
]
