"""Chunkwise Gated DeltaNet with state export and gradient injection (docs/INTERFACES.md section 4).

One execution path: `gated_delta_rule` runs a `TreeGDNPlan` (every round of a microbatch, or one packed call)
with the Triton kernels; `plan_gated_delta_rule_reference` runs the same plan in plain torch.
"""
from .config import GDNKernelConfig
from .function import chunk_gated_delta_rule, triton_supports
from .index import GDNIndex, prepare_gdn_index
from .reference import (chunk_gated_delta_rule_reference, plan_gated_delta_rule_reference,
                        recurrent_gated_delta_rule, recurrent_gated_delta_rule_reference)
from .tree import gated_delta_rule
from .tree_plan import CHUNK_SIZE, TreeGDNPlan, plan_single_call, plan_tree_gdn

__all__ = [
    "CHUNK_SIZE",
    "GDNIndex",
    "GDNKernelConfig",
    "TreeGDNPlan",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_reference",
    "gated_delta_rule",
    "plan_gated_delta_rule_reference",
    "plan_single_call",
    "plan_tree_gdn",
    "prepare_gdn_index",
    "recurrent_gated_delta_rule",
    "recurrent_gated_delta_rule_reference",
    "triton_supports",
]
