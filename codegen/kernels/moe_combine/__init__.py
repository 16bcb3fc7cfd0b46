"""MoE dispatch and output combination (routed slots and the shared expert): one Triton pass each way, plain torch
as reference."""
from .function import MoECombineFunction, MoEDispatchFunction, moe_combine, moe_dispatch, triton_supports
from .reference import SHARED_MODES, moe_combine_reference, shared_mode

__all__ = ["MoECombineFunction", "MoEDispatchFunction", "SHARED_MODES", "moe_combine", "moe_combine_reference",
           "moe_dispatch", "shared_mode", "triton_supports"]
