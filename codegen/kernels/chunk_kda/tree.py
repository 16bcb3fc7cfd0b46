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
"""
from __future__ import annotations

import torch

from ..chunk_gdn.config import triton_supports
from ..chunk_gdn.inputs import validate_gdn_tensors
from ..chunk_gdn.l2norm import l2norm_fused
from ..chunk_gdn.lanes import LaneStreams
from ..chunk_gdn.tree import _group_sum
from ..chunk_gdn.tree_plan import CHUNK_SIZE, TreeGDNPlan
from ..interpreter_safe import interpreter_needs_fp32, interpreting
from ..segment_add import segment_add
from .chunk_bwd import chunk_bwd
from .config import KDAKernelConfig
from .intra_fwd import intra_fwd
from .reference import check_kda_gate
from .state_bwd import bwd_prep, scan_bwd
from .state_fwd import output_fwd, scan_fwd


class TreeKimiDeltaAttentionFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_states, scale: float, plan: TreeGDNPlan, config: KDAKernelConfig):
        index, rows = plan.index, plan.rows
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        hv, kd, vd = v.shape[1], k.shape[2], v.shape[2]
        gc, T, Aqk, w, u, kg = intra_fwd(q, k, v, g, beta, index, config, rows)
        h = torch.empty(index.num_chunks, hv, kd, vd, device=k.device, dtype=k.dtype)
        v_new = torch.empty_like(u)
        zero_and_slots = torch.zeros(1 + index.num_slots, hv, kd, vd, device=k.device, dtype=torch.float32)
        # rows [1 + num_slots, ...) of the bank are the caller's initial states
        bank = torch.cat([zero_and_slots, initial_states.to(torch.float32)]) if plan.num_initial else zero_and_slots
        with LaneStreams(plan.num_lanes, k.device) as lanes:
            for launch in plan.launches:
                with lanes.on(launch.lane):
                    scan_fwd(kg, w, u, gc, bank, index, seqs=(launch.first_seq, launch.num_seqs),
                             out=(h, v_new, bank[1:]), launch_seqs=launch.round_seqs, initial_rows=launch.init_row)
        o = output_fwd(q, gc, Aqk, v_new, h, scale, index, config, rows)
        exported = bank[1:][plan.output_slots]
        ctx.save_for_backward(q, k, v, beta, gc, T, Aqk, w, kg, v_new, h)
        ctx.scale, ctx.plan, ctx.config = scale, plan, config
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype, initial_states.dtype)
        return o, exported

    @staticmethod
    def backward(ctx, d_out, d_exported):
        q, k, v, beta, gc, T, Aqk, w, kg, v_new, h = ctx.saved_tensors
        plan: TreeGDNPlan = ctx.plan
        index, rows, config = plan.index, plan.rows, ctx.config
        hv, kd, vd = v.shape[1], k.shape[2], v.shape[2]
        do = torch.zeros_like(v) if d_out is None else d_out.to(v.dtype).contiguous()
        qg, dv_local = bwd_prep(q, gc, Aqk, do, ctx.scale, index, config, rows)
        dh = torch.empty(index.num_chunks, hv, kd, vd, device=q.device, dtype=k.dtype)
        dvn = torch.empty_like(v_new)
        bank_grad = torch.zeros(index.num_slots + plan.num_initial, hv, kd, vd, device=q.device, dtype=torch.float32)
        if d_exported is not None and plan.output_slots_host:
            d_exported = d_exported.to(torch.float32)
            if len(set(plan.output_slots_host)) == len(plan.output_slots_host):  # each state returned once
                bank_grad[plan.output_slots] = d_exported
            else:  # duplicates summed in a fixed order (index_add_ may use atomics on CUDA)
                for e, slot in enumerate(plan.output_slots_host):
                    bank_grad[slot] += d_exported[e]
        with LaneStreams(plan.num_lanes, q.device) as lanes:
            for launch in reversed(plan.launches):  # a round's exports are read only by later rounds (same lane)
                with lanes.on(launch.lane):
                    dh0 = scan_bwd(qg, kg, w, gc, do, dv_local, bank_grad, index, dh, dvn,
                                   seqs=(launch.first_seq, launch.num_seqs), rows=rows, launch_seqs=launch.round_seqs)
                    if launch.start_slots.numel():  # distinct grad-bank rows of this launch, summed in order
                        segment_add(bank_grad, launch.start_slots, dh0, launch.start_bounds, launch.start_seqs)
        dq, dk, dv, dbeta, dg, *side = chunk_bwd(q, k, v, beta, gc, T, v_new, h, dh, do, dvn, ctx.scale, index,
                                                 config, rows)
        names = ("q", "k", "v", "g", "beta")  # the order of ctx.dtypes and of the returned gradients
        per_token = dict(zip(names, (dq, dk, dv, dg, dbeta)))
        replayed = dict(zip(("k", "v", "beta", "g"), side[0])) if side else {}  # by replay slot
        hk = q.shape[1]
        grads = []
        for name, dtype in zip(names, ctx.dtypes):
            per_key_head = name in ("q", "k")
            grad = _group_sum(per_token[name], hk) if per_key_head else per_token[name]
            # own row + the replays' sum, in fp32, rounded once; a replayed row's dq is exactly 0 (its do is 0)
            if plan.replay_dst.numel() and name != "q":
                groups = replayed[name].shape[1] // hk if per_key_head else 1
                grad = grad.contiguous()
                segment_add(grad, plan.replay_dst, replayed[name], plan.replay_bounds, groups=groups)
            grads.append(grad.to(dtype))
        d_initial = bank_grad[index.num_slots:].to(ctx.dtypes[5]) if ctx.needs_input_grad[5] else None
        return (*grads, d_initial, None, None, None)


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
    who = "kimi_delta_attention"
    tokens, _, hv, kd, vd = validate_kda_tensors(q, k, v, g, beta, who=who)
    if not (q.is_cuda or interpreting()) or not all(triton_supports(x.dtype, kd, vd, cuda=q.is_cuda)
                                                    for x in (q, k, v)):
        raise ValueError(f"{who}: the Triton kernels do not run {q.dtype} with K={kd}, V={vd} on {q.device.type} "
                         "(they need CUDA or TRITON_INTERPRET=1, and chunk_gdn.triton_supports); use "
                         "plan_kimi_delta_attention_reference")
    if plan.index.chunk_size != CHUNK_SIZE:
        raise ValueError(f"{who}: the plan has chunk_size {plan.index.chunk_size}, the Triton kernels run {CHUNK_SIZE}")
    if tokens != plan.num_tokens:
        raise ValueError(f"{who}: `q` has {tokens} rows, the plan was built for {plan.num_tokens} tokens")
    if not isinstance(plan.own_pick, torch.Tensor) or plan.own_pick.device != q.device:
        where = plan.own_pick.device if isinstance(plan.own_pick, torch.Tensor) else "the host"
        raise ValueError(f"{who}: the plan lives on {where}, the inputs on {q.device} (upload it with to_device)")
    if initial_states is None:
        if plan.num_initial:
            raise ValueError(f"{who}: the plan starts {plan.num_initial} sequences from given states, but no "
                             "`initial_states` were passed")
        initial_states = q.new_zeros((0, hv, kd, vd), dtype=torch.float32)
    elif tuple(initial_states.shape) != (plan.num_initial, hv, kd, vd):
        raise ValueError(f"{who}: `initial_states` has shape {tuple(initial_states.shape)}, expected "
                         f"{(plan.num_initial, hv, kd, vd)}")
    if any(map(interpreter_needs_fp32, (q, k, v, beta))):  # the interpreter's 16-bit dots are wrong: fp32
        o, exported = kimi_delta_attention(q.float(), k.float(), v.float(), g, beta.float(), scale=scale, plan=plan,
                                           initial_states=initial_states, use_qk_l2norm=use_qk_l2norm, config=config)
        return o.to(v.dtype), exported
    if use_qk_l2norm:  # on compact tokens (each once; replays read the normalised rows), in fp32 as fla does
        q, k = l2norm_fused(q), l2norm_fused(k)
    return TreeKimiDeltaAttentionFunction.apply(q, k, v, g, beta, initial_states, float(scale), plan,
                                                config or KDAKernelConfig())
