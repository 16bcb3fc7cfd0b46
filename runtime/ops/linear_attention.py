"""Linear attention over a microbatch's rounds (docs/design.md section 6): one interface for both delta rules.

`linear_attention_rounds(..., rule=...)` runs the launch plan's GDN part (a `TreeGDNPlan`: packed rows, replay,
state exports and hand-offs between rounds) for
- "gdn": Gated DeltaNet, one log decay per head, g [T, HV] (Triton: every round in one autograd Function; torch:
  the same plan launch by launch with the plain-torch reference);
- "kda": Kimi Delta Attention, one log decay per key channel, g [T, HV, K] (Triton: `chunk_kda`'s kernels over the
  same plan in one autograd Function; torch: the plain-torch reference with the same plan runner).
"""
from __future__ import annotations

import torch

from harts_compiler.codegen import LaunchPlan
from harts_compiler.codegen.kernels.chunk_gdn import gated_delta_rule, plan_gated_delta_rule_reference
from harts_compiler.codegen.kernels.chunk_kda import kimi_delta_attention, plan_kimi_delta_attention_reference

RULES = ("gdn", "kda")


def linear_attention_rounds(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            plan: LaunchPlan, *, rule: str, scale: float, state_dtype: torch.dtype,
                            use_qk_l2norm: bool = True, kernel=None, carry=None) -> torch.Tensor:
    """Compact q, k [T, HK, K], v [T, HV, V], g [T, HV] (gdn) or [T, HV, K] (kda), beta [T, HV] -> o [T, HV, V]
    (dtype of v). `kernel`: a reference kernel of the rule for the torch path (tests pass the token loops).
    `carry`: the layer's `ops.carry.LayerCarry` in a piece of a split tree (carried rows and states in, the
    states later pieces start from out)."""
    if rule not in RULES:
        raise ValueError(f"linear_attention_rounds: rule={rule!r} is not one of {RULES}")
    T = beta.shape[0]  # own rows (in a piece q, k, v have the carried replay rows after them)
    initial = None
    if carry is not None:
        (q, k, v, g, beta), initial = carry.linear_inputs(q, k, v, g, beta)
    extra = {} if kernel is None else {"kernel": kernel}
    if rule == "gdn" and plan.target.gdn_triton:
        o, states = gated_delta_rule(q, k, v, g, beta, scale=scale, plan=plan.gdn, initial_states=initial,
                                     use_qk_l2norm=use_qk_l2norm)
    elif rule == "gdn":
        o, states = plan_gated_delta_rule_reference(q, k, v, g, beta, scale=scale, plan=plan.gdn,
                                                    initial_states=initial, state_dtype=state_dtype,
                                                    use_qk_l2norm=use_qk_l2norm, **extra)
    elif plan.target.gdn_triton:
        o, states = kimi_delta_attention(q, k, v, g, beta, scale=scale, plan=plan.gdn, initial_states=initial,
                                         use_qk_l2norm=use_qk_l2norm)
    else:
        o, states = plan_kimi_delta_attention_reference(q, k, v, g, beta, scale=scale, plan=plan.gdn,
                                                        initial_states=initial, state_dtype=state_dtype,
                                                        use_qk_l2norm=use_qk_l2norm, **extra)
    if carry is not None:
        carry.keep_states(states)
        o = o[:T]  # the carried replay rows' outputs are not this piece's
    return o


def gated_delta_rule_rounds(q, k, v, g, beta, plan: LaunchPlan, *, scale: float, state_dtype: torch.dtype,
                            use_qk_l2norm: bool = True, kernel=None, carry=None) -> torch.Tensor:
    """`linear_attention_rounds` with rule="gdn"."""
    return linear_attention_rounds(q, k, v, g, beta, plan, rule="gdn", scale=scale, state_dtype=state_dtype,
                                   use_qk_l2norm=use_qk_l2norm, kernel=kernel, carry=carry)
