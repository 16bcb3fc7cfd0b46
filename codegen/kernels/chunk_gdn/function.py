"""The public single-call wrapper, with fla's signature: one packed varlen call is a one-round plan.

Forward:  wy_fwd (gc, T, w, u)  ->  state_fwd (h, v_new, export bank)  ->  output_fwd (o)
Backward: state_bwd (dv_local's A^T where the scan does not form it; reverse scan with injected export gradients
          -> dh, dvn, dh0)
          -> chunk_bwd (dq, dk, dw, dgc; WY backward -> dk, dv, dbeta, dg)
Every kernel has a fixed launch configuration (no autotuning) and no atomics, so the same chunk with
the same entering state gives the same bits in any packing: tree mode reproduces trajectory mode.
There is one execution path: `tree.gated_delta_rule` over a `TreeGDNPlan`; this wrapper builds the plan
of one call (`tree_plan.plan_single_call`) from host values and uploads it.
"""
from __future__ import annotations

from ..interpreter_safe import interpreting
from ..upload import to_device
from .config import GDNKernelConfig, triton_supports
from .inputs import validate_gdn_inputs
from .reference import chunk_gated_delta_rule_reference
from .tree import gated_delta_rule
from .tree_plan import CHUNK_SIZE, plan_single_call


def run_single_call(q, k, v, g, beta, *, validate, reference, tree, plan_config: GDNKernelConfig | None, scale,
                    initial_state, cu_seqlens, export_seq, export_offset, chunk_size, use_qk_l2norm, **tree_kwargs):
    """One packed varlen call of a delta-rule family: `validate`s the arguments (inputs.validate_gdn_inputs or
    the family's own), then runs `tree` (the family's plan runner, given `tree_kwargs` too) over the call's
    one-round plan where the Triton kernels take the inputs, else `reference` (the plain-torch single call)."""
    shapes = validate(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, export_seq=export_seq,
                      export_offset=export_offset, chunk_size=chunk_size)
    triton_ok = (q.is_cuda or interpreting()) and chunk_size == CHUNK_SIZE and all(
        triton_supports(x.dtype, shapes.key_dim, shapes.value_dim, cuda=q.is_cuda) for x in (q, k, v))
    if not triton_ok:
        return reference(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                         export_seq=export_seq, export_offset=export_offset, chunk_size=chunk_size,
                         use_qk_l2norm=use_qk_l2norm)
    plan = to_device(plan_single_call(shapes.seq_lengths, shapes.export_seq, shapes.export_offset,
                                      chunk_size=chunk_size, config=plan_config), q.device)
    return tree(q, k, v, g, beta, scale=scale, plan=plan, initial_states=initial_state, use_qk_l2norm=use_qk_l2norm,
                **tree_kwargs)


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, export_seq=None,
                           export_offset=None, chunk_size=CHUNK_SIZE, use_qk_l2norm=False,
                           config: GDNKernelConfig | None = None):
    """Chunkwise Gated DeltaNet (docs/INTERFACES.md section 4): (o [R, HV, V], exported [E, HV, K, V] fp32).

    Runs the Triton kernels on CUDA (or under TRITON_INTERPRET=1) where `triton_supports` admits the inputs,
    the plain-torch reference otherwise. Reads `cu_seqlens` and the exports on the host to plan the call: a
    model runs its rounds through `tree.gated_delta_rule` with a plan built once instead.
    """
    return run_single_call(q, k, v, g, beta, validate=validate_gdn_inputs, reference=chunk_gated_delta_rule_reference,
                           tree=gated_delta_rule, plan_config=config, scale=scale, initial_state=initial_state,
                           cu_seqlens=cu_seqlens, export_seq=export_seq, export_offset=export_offset,
                           chunk_size=chunk_size, use_qk_l2norm=use_qk_l2norm)
