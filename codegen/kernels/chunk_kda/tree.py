"""Every round of a microbatch's KDA plan in one autograd Function: GDN's tree.py with KDA's kernels.

The plan is GDN's `TreeGDNPlan` (chunk_gdn/tree_plan.py), unchanged: the rounds' packed rows laid one after
another in one varlen layout, the export bank, the lanes, the replay groups and the row maps. So

  forward:  intra_fwd over every chunk of every round (gc, Aqk, T, then w, u, kg)   (2 launches)
            per round (and lane): scan_fwd over its sequences, from states read in the bank
            output_fwd over every chunk                                          (1 launch)
  backward: bwd_prep over every chunk (qg, dv_local); per round in reverse: scan_bwd (the exported states'
            gradients injected), then its initial-state gradients summed into the bank rows they came from;
            chunk_bwd over every chunk (3 launches); the replayed rows' gradients summed onto their tokens.

Each chunk runs the same kernel code with the same entering state as in a trajectory-wise call, so outputs
equal trajectory-wise outputs bit for bit. Sums over duplicates run in segment_add, in a fixed order.
The plan plumbing (checks, state banks, lane streams, gradient sums) is GDN's tree.py's, shared.
"""
from __future__ import annotations

import torch

from ..chunk_gdn.inputs import validate_gdn_tensors
from ..chunk_gdn.l2norm import normalize_qk
from ..chunk_gdn.tree import (check_plan_call, input_gradients, scan_rounds, scan_rounds_backward, state_bank,
                              state_bank_grad)
from ..chunk_gdn.tree_plan import TreeGDNPlan
from ..interpreter_safe import interpreter_needs_fp32
from .chunk_bwd import chunk_bwd
from .config import KDAKernelConfig
from .intra_fwd import intra_fwd
from .reference import check_kda_gate
from .state_bwd import bwd_prep, scan_bwd
from .state_fwd import output_fwd, scan_fwd


class TreeKimiDeltaAttentionFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_states, scale: float, plan: TreeGDNPlan, config: KDAKernelConfig,
                use_qk_l2norm: bool):
        index, rows = plan.index, plan.rows
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype, initial_states.dtype)
        # on compact tokens (each once; replays read the normalised rows), in fp32 as fla does
        q, k, l2norm_saved = normalize_qk(q, k, use_qk_l2norm)
        hv, kd, vd = v.shape[1], k.shape[2], v.shape[2]
        gc, T, Aqk, w, u, kg = intra_fwd(q, k, v, g, beta, index, config, rows)
        h = torch.empty(index.num_chunks, hv, kd, vd, device=k.device, dtype=k.dtype)
        v_new = torch.empty_like(u)
        bank = state_bank(plan, initial_states, (hv, kd, vd), k.device)
        scan_rounds(plan, k.device, lambda launch: scan_fwd(
            kg, w, u, gc, bank, index, seqs=(launch.first_seq, launch.num_seqs), out=(h, v_new, bank[1:]),
            launch_seqs=launch.round_seqs, initial_rows=launch.init_row, order=launch.scan_order))
        o = output_fwd(q, gc, Aqk, v_new, h, scale, index, config, rows)
        exported = bank[1:][plan.output_slots]
        ctx.save_for_backward(q, k, v, beta, gc, T, Aqk, w, kg, v_new, h, *l2norm_saved)
        ctx.scale, ctx.plan, ctx.config = scale, plan, config
        return o, exported

    @staticmethod
    def backward(ctx, d_out, d_exported):
        q, k, v, beta, gc, T, Aqk, w, kg, v_new, h, *l2norm_saved = ctx.saved_tensors
        plan: TreeGDNPlan = ctx.plan
        index, rows, config = plan.index, plan.rows, ctx.config
        hv, kd, vd = v.shape[1], k.shape[2], v.shape[2]
        do = torch.zeros_like(v) if d_out is None else d_out.to(v.dtype).contiguous()
        qg, dv_local = bwd_prep(q, gc, Aqk, do, ctx.scale, index, config, rows)
        dh = torch.empty(index.num_chunks, hv, kd, vd, device=q.device, dtype=k.dtype)
        dvn = torch.empty_like(v_new)
        bank_grad = state_bank_grad(plan, d_exported, (hv, kd, vd), q.device)
        scan_rounds_backward(plan, q.device, bank_grad, lambda launch: scan_bwd(
            qg, kg, w, gc, do, dv_local, bank_grad, index, dh, dvn, seqs=(launch.first_seq, launch.num_seqs),
            rows=rows, launch_seqs=launch.round_seqs, order=launch.scan_order))
        chunk_grads = chunk_bwd(q, k, v, beta, gc, T, v_new, h, dh, do, dvn, ctx.scale, index, config, rows)
        grads = input_gradients(plan, ctx.dtypes, q.shape[1], chunk_grads, l2norm_saved)
        d_initial = bank_grad[index.num_slots:].to(ctx.dtypes[5]) if ctx.needs_input_grad[5] else None
        return (*grads, d_initial, None, None, None, None)


def validate_kda_tensors(q, k, v, g, beta, *, who: str):
    """Types and shapes of q, k [T, HK, K], v [T, HV, V], g [T, HV, K], beta [T, HV]: (T, HK, HV, K, V)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, v)):
        return validate_gdn_tensors(q, k, v, g, beta, who=who)  # names the argument that is not a tensor
    check_kda_gate(q, v, g, who=who)
    return validate_gdn_tensors(q, k, v, g[..., 0], beta, who=who)


def kimi_delta_attention(q, k, v, g, beta, *, scale: float, plan: TreeGDNPlan, initial_states=None,
                         use_qk_l2norm: bool = False, config: KDAKernelConfig | None = None):
    """Compact q, k [T, HK, K], v [T, HV, V], g [T, HV, K] (log decays <= 0), beta [T, HV] ->
    (o [T, HV, V], exported [E, HV, K, V] fp32): every round of `plan` (a device plan: `upload.to_device`) with
    the Triton kernels (CUDA, or the CPU interpreter) in one autograd Function. `initial_states`
    [plan.num_initial, HV, K, V] (fp32/fp64, may take gradients) are the states the plan's caller-started
    sequences begin from."""
    tokens = validate_kda_tensors(q, k, v, g, beta, who="kimi_delta_attention")[0]
    initial_states = check_plan_call(q, k, v, plan, initial_states, tokens=tokens, who="kimi_delta_attention",
                                     reference="plan_kimi_delta_attention_reference")
    if any(map(interpreter_needs_fp32, (q, k, v, beta))):  # the interpreter's 16-bit dots are wrong: fp32
        o, exported = kimi_delta_attention(q.float(), k.float(), v.float(), g, beta.float(), scale=scale, plan=plan,
                                           initial_states=initial_states, use_qk_l2norm=use_qk_l2norm, config=config)
        return o.to(v.dtype), exported
    return TreeKimiDeltaAttentionFunction.apply(q, k, v, g, beta, initial_states, float(scale), plan,
                                                config or KDAKernelConfig(), use_qk_l2norm)
