"""Every round of a tree microbatch in one autograd Function (DESIGN.md section 6).

The rounds of a plan differ only in their sequential part: a sequence of round r starts from a state
that an earlier round exported. Everything else is chunk-local. So the rounds' packed rows are laid
one after another in a single varlen layout, and

  forward:  gather the packed rows from the compact tokens (one gather per input; but see below)
            wy_fwd over every chunk of every round                      (2 launches)
            per round: state_fwd over its sequences, from states read in the export bank
            output_fwd over every chunk                                 (1 launch)
            keep each compact token's own row                           (1 gather)
  backward: dv_local over every chunk; per round in reverse: the reverse scan (the exported states'
            gradients injected), then its initial-state gradients summed into the bank slots they
            came from; chunk_bwd over every chunk; packed-row gradients back onto compact tokens.

The gathers move whole q/k/v-sized tensors (134 MB each at 32k rows, H=16, K=128, bf16): on the H200
they were 0.9 of a 4.9 ms step. Two ways around them: a plan whose packed rows are the compact tokens in
order skips them (identity_layout); and with `GDNKernelConfig.tree_rows_in_kernels` (the default) the
kernels read inputs and do, and write o and the kept gradients, through the plan's row maps
(index.PackedRows), so only the replayed rows' gradients are summed afterwards (agentic batch of
bench/gdn.py: 11.64 vs 12.31 ms on the H200).

A round's sequences of independent trees (no state hand-off between them) scan on their own CUDA
streams ("lanes", `GDNKernelConfig.tree_scan_lanes`): with round-major launches a tree's branches waited
for the longest root of the microbatch, not for their own (agentic batch: 10.24 vs 10.50 ms).

Each chunk runs the same kernel code with the same entering state as in a trajectory-wise call, so the
outputs equal trajectory-wise outputs bit for bit (the alignment rule of DESIGN.md section 6).
Against one chunk_gated_delta_rule call per round with autograd gathers between them, this removes
per layer and round 5 gathers, their sort-based scatter-add backward, and 6 launches of the
chunk-parallel kernels. Sums over duplicates (a bank state that several sequences start from, a
row that several sequences replay) are taken in a fixed order: results are deterministic.
"""
from __future__ import annotations

import torch

from ..interpreter_safe import interpreter_needs_fp32, interpreting
from .chunk_bwd import chunk_bwd
from .function import _group_sum, triton_supports
from .inputs import validate_gdn_tensors
from .l2norm import l2norm_fused
from .lanes import LaneStreams
from .segment_add import segment_add
from .state_bwd import dv_local_bwd, state_bwd_scan
from .state_fwd import output_fwd, state_fwd
from .tree_plan import TreeGDNPlan, TreeRoundSpec, plan_tree_gdn
from .wy_fwd import wy_fwd

__all__ = ["TreeGDNPlan", "TreeRoundSpec", "plan_tree_gdn", "tree_gated_delta_rule", "tree_supported"]


class TreeGatedDeltaRuleFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale: float, plan: TreeGDNPlan):
        index, rows = plan.index, plan.rows
        if plan.compact_io:  # the kernels assume dense rows; the runtime's v is a split view of one projection
            q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        else:  # the gathers write dense copies
            q, k, v, g, beta = (x.index_select(0, plan.row_src) for x in (q, k, v, g, beta))
        hv, kd, vd = v.shape[1], k.shape[2], v.shape[2]
        gc, T, w, u = wy_fwd(k, v, g, beta, index, rows)
        h = torch.empty(index.num_chunks, hv, kd, vd, device=k.device, dtype=k.dtype)
        v_new = torch.empty_like(u)
        bank = torch.zeros(1 + index.num_slots, hv, kd, vd, device=k.device, dtype=torch.float32)  # row 0: zeros
        with LaneStreams(plan.num_lanes, k.device) as lanes:
            for rnd in plan.rounds:
                with lanes.on(rnd.lane):
                    state_fwd(k, w, u, gc, bank, index, seqs=(rnd.first_seq, rnd.num_seqs),
                              out=(h, v_new, bank[1:]), rows=rows, launch_seqs=rnd.round_seqs,
                              initial_rows=rnd.init_row)
        o = output_fwd(q, k, v_new, gc, h, scale, index, rows)
        ctx.save_for_backward(q, k, v, beta, gc, T, w, v_new, h)
        ctx.scale, ctx.plan = scale, plan
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
        return o if plan.compact_io else o.index_select(0, plan.own_pick)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, beta, gc, T, w, v_new, h = ctx.saved_tensors
        plan: TreeGDNPlan = ctx.plan
        index, rows = plan.index, plan.rows
        hv, kd, vd = v.shape[1], k.shape[2], v.shape[2]
        if plan.compact_io:
            do = d_out.to(v.dtype).contiguous()
        else:  # replayed outputs are dropped
            do = torch.zeros_like(v_new).index_copy_(0, plan.own_pick, d_out.to(v.dtype))
        dv_local = dv_local_bwd(q, k, gc, do, ctx.scale, index, rows)
        dh = torch.empty(index.num_chunks, hv, kd, vd, device=q.device, dtype=k.dtype)
        dvn = torch.empty_like(v_new)
        bank_grad = torch.zeros(index.num_slots, hv, kd, vd, device=q.device, dtype=torch.float32)
        with LaneStreams(plan.num_lanes, q.device) as lanes:
            for rnd in reversed(plan.rounds):  # a round's exports are read only by later rounds (same lane)
                with lanes.on(rnd.lane):
                    dh0 = state_bwd_scan(q, k, w, gc, do, dv_local, bank_grad, ctx.scale, index, dh, dvn,
                                         seqs=(rnd.first_seq, rnd.num_seqs), rows=rows, launch_seqs=rnd.round_seqs)
                    if rnd.start_slots.numel():  # distinct slots of this lane's own states, summed in order
                        segment_add(bank_grad, rnd.start_slots, dh0, rnd.start_bounds, rnd.start_seqs)
        dq, dk, dv, dbeta, dg, *side = chunk_bwd(q, k, v, beta, gc, T, v_new, h, dh, do, dvn, ctx.scale, index, rows)
        names = ("q", "k", "v", "g", "beta")  # the order of ctx.dtypes and of the returned gradients
        per_token = dict(zip(names, (dq, dk, dv, dg, dbeta)))  # compact with row maps, else per packed row
        replayed = dict(zip(("k", "v", "beta", "g"), side[0])) if side else per_token  # side: by replay slot
        hk = q.shape[1]
        compact = []
        for name, dtype in zip(names, ctx.dtypes):
            per_key_head = name in ("q", "k")
            grad = _group_sum(per_token[name], hk) if per_key_head else per_token[name]
            if not plan.compact_io:
                grad = grad.index_select(0, plan.own_pick)
            # own row + the replays' sum, in fp32, rounded once; a replayed row's dq is exactly 0 (its do is 0).
            # Side slots are the replayed rows grouped by token; without them the replays are packed rows.
            if plan.replay_dst.numel() and name != "q":
                groups = replayed[name].shape[1] // hk if per_key_head else 1
                segment_add(grad, plan.replay_dst, replayed[name], plan.replay_bounds,
                            None if side else plan.replay_rows, groups=groups)
            compact.append(grad.to(dtype))
        return (*compact, None, None)


def tree_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `tree_gated_delta_rule` runs these inputs (else: one call per round, which falls back)."""
    return (q.is_cuda or interpreting()) and all(
        triton_supports(x.dtype, k.shape[2], v.shape[2], cuda=x.is_cuda) for x in (q, k, v))


def tree_gated_delta_rule(q, k, v, g, beta, *, scale: float, plan: TreeGDNPlan, use_qk_l2norm: bool = False):
    """Compact q, k [T, HK, K], v [T, HV, V], g, beta [T, HV] -> o [T, HV, V]: every round of `plan` run
    with the Triton kernels (CUDA, or the CPU interpreter) in one autograd Function."""
    rows = validate_gdn_tensors(q, k, v, g, beta, who="tree_gated_delta_rule")[0]
    if rows != plan.num_tokens:
        raise ValueError(f"tree_gated_delta_rule: `q` has {rows} rows, the plan was built for {plan.num_tokens} tokens")
    if not tree_supported(q, k, v):
        raise ValueError(f"tree_gated_delta_rule: the Triton kernels do not run {q.dtype} with K={k.shape[2]}, "
                         f"V={v.shape[2]} on {q.device.type} (they need CUDA or TRITON_INTERPRET=1, and "
                         "function.triton_supports); use one call per round with the reference")
    if plan.row_src.device != q.device:
        raise ValueError(f"tree_gated_delta_rule: the plan lives on {plan.row_src.device}, the inputs on {q.device}")
    if any(map(interpreter_needs_fp32, (q, k, v, beta))):  # the interpreter's 16-bit dots are wrong: fp32
        return tree_gated_delta_rule(q.float(), k.float(), v.float(), g, beta.float(), scale=scale, plan=plan,
                                     use_qk_l2norm=use_qk_l2norm).to(v.dtype)
    if use_qk_l2norm:  # on compact tokens: each once, and the replays gather the normalised rows
        q, k = l2norm_fused(q), l2norm_fused(k)
    return TreeGatedDeltaRuleFunction.apply(q, k, v, g, beta, float(scale), plan)
