"""Gated DeltaNet over a microbatch's rounds (docs/design.md section 6): the launch plan's GDN part, run by the
kernels its target chose (Triton: every round in one autograd Function; torch: the same plan launch by launch
with the plain-torch reference)."""
from __future__ import annotations

import torch

from harts_compiler.codegen import LaunchPlan
from harts_compiler.codegen.kernels.chunk_gdn import gated_delta_rule, plan_gated_delta_rule_reference


def gated_delta_rule_rounds(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, plan: LaunchPlan, *, scale: float, state_dtype: torch.dtype,
                            use_qk_l2norm: bool = True, kernel=None) -> torch.Tensor:
    """Compact q, k [T, HK, K], v [T, HV, V], g, beta [T, HV] -> o [T, HV, V] (dtype of v). `kernel`: a
    reference kernel for the torch path (tests pass the token-loop oracle; the target then runs torch)."""
    if plan.target.gdn_triton:
        return gated_delta_rule(q, k, v, g, beta, scale=scale, plan=plan.gdn, use_qk_l2norm=use_qk_l2norm)[0]
    extra = {} if kernel is None else {"kernel": kernel}
    return plan_gated_delta_rule_reference(q, k, v, g, beta, scale=scale, plan=plan.gdn, state_dtype=state_dtype,
                                           use_qk_l2norm=use_qk_l2norm, **extra)[0]
