"""Chunkwise Gated DeltaNet with state export and gradient injection (docs/INTERFACES.md section 4)."""
from .reference import (
    chunk_gated_delta_rule_reference,
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_reference,
)

__all__ = [
    "chunk_gated_delta_rule_reference",
    "recurrent_gated_delta_rule",
    "recurrent_gated_delta_rule_reference",
]
