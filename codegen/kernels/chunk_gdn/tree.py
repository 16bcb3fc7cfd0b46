"""Every round of a microbatch's GDN plan in one autograd Function (docs/design.md section 6).

The rounds of a plan differ only in their sequential part: a sequence of round r starts from a state
that an earlier round exported. Everything else is chunk-local. So the rounds' packed rows are laid
one after another in a single varlen layout (tree_plan.py), and

  forward:  wy_fwd over every chunk of every round                      (2 launches)
            per round (and lane): state_fwd over its sequences, from states read in the bank
            output_fwd over every chunk                                 (1 launch)
  backward: dv_local's A^T over the chunks of the scan launches that do not form it; per round
            in reverse: the reverse scan (the exported states' gradients injected), then its initial-state
            gradients summed into the bank rows they came from; chunk_bwd over every chunk; the replayed
            rows' gradients summed onto their tokens.

The kernels read q, k, v, g, beta and do on the compact tokens and write o and the kept gradients there,
through the plan's row maps (index.PackedRows); a plan whose packed rows are the compact tokens in order
(trajectory-wise) needs no maps. A round's sequences of independent trees scan on their own CUDA streams
("lanes"), so a tree's branches start when its own root is scanned.

Each chunk runs the same kernel code with the same entering state as in a trajectory-wise call, so the
outputs equal trajectory-wise outputs bit for bit (the alignment rule). Sums over duplicates (a bank state
that several sequences start from, a row that several sequences replay) are taken in a fixed order.
"""
from __future__ import annotations

import torch

from ..interpreter_safe import interpreter_needs_fp32, interpreting
from .chunk_bwd import chunk_bwd
from .config import triton_supports
from .inputs import validate_gdn_tensors
from .l2norm import group_sum, l2norm_rows_backward, normalize_qk
from .lanes import LaneStreams
from ..segment_add import segment_add
from .state_bwd import gated_at_bwd, state_bwd_scan
from .state_fwd import output_fwd, state_fwd
from .tree_plan import CHUNK_SIZE, TreeGDNPlan
from .wy_fwd import wy_fwd


# The helpers below are the plan plumbing that chunk_kda's tree.py runs with its own kernels.

def check_plan_call(q, k, v, plan: TreeGDNPlan, initial_states, *, tokens: int, who: str, reference: str):
    """The Triton kernels run these inputs with this device plan: returns the initial states ([0, HV, K, V]
    zeros when the plan starts no sequence from given states). `reference` names the plain-torch path the
    messages point to."""
    hv, kd, vd = v.shape[1], k.shape[2], v.shape[2]
    if not (q.is_cuda or interpreting()) or not all(triton_supports(x.dtype, kd, vd, cuda=q.is_cuda)
                                                    for x in (q, k, v)):
        raise ValueError(f"{who}: the Triton kernels do not run {q.dtype} with K={kd}, V={vd} on {q.device.type} "
                         f"(they need CUDA or TRITON_INTERPRET=1, and chunk_gdn.triton_supports); use {reference}")
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
        return q.new_zeros((0, hv, kd, vd), dtype=torch.float32)
    if tuple(initial_states.shape) != (plan.num_initial, hv, kd, vd):
        raise ValueError(f"{who}: `initial_states` has shape {tuple(initial_states.shape)}, expected "
                         f"{(plan.num_initial, hv, kd, vd)}")
    return initial_states


def state_bank(plan: TreeGDNPlan, initial_states, state_shape, device) -> torch.Tensor:
    """The scans' state bank [1 + num_slots + num_initial, HV, K, V] fp32: row 0 the zero state, then the
    export slots (written by the scans), then the caller's initial states."""
    zero_and_slots = torch.zeros(1 + plan.index.num_slots, *state_shape, device=device, dtype=torch.float32)
    if not plan.num_initial:
        return zero_and_slots
    return torch.cat([zero_and_slots, initial_states.to(torch.float32)])


def state_bank_grad(plan: TreeGDNPlan, d_exported, state_shape, device) -> torch.Tensor:
    """The gradient bank [num_slots + num_initial, HV, K, V] fp32 (the state bank without its zero row), holding
    the returned states' gradients at their slots."""
    bank_grad = torch.zeros(plan.index.num_slots + plan.num_initial, *state_shape, device=device,
                            dtype=torch.float32)
    if d_exported is not None and plan.output_slots_host:
        d_exported = d_exported.to(torch.float32)
        if len(set(plan.output_slots_host)) == len(plan.output_slots_host):  # each state returned once
            bank_grad[plan.output_slots] = d_exported
        else:  # duplicates summed in a fixed order (index_add_ may use atomics on CUDA)
            for e, slot in enumerate(plan.output_slots_host):
                bank_grad[slot] += d_exported[e]
    return bank_grad


def scan_rounds(plan: TreeGDNPlan, device, scan) -> None:
    """`scan(launch)` for every launch of the plan, in round order, each on its lane's stream."""
    with LaneStreams(plan.num_lanes, device) as lanes:
        for launch in plan.launches:
            with lanes.on(launch.lane):
                scan(launch)


def scan_rounds_backward(plan: TreeGDNPlan, device, bank_grad: torch.Tensor, scan) -> None:
    """`scan(launch)` for every launch in reverse round order (a round's exports are read only by later rounds,
    on the same lane); it returns its sequences' initial-state gradients, which are summed here, in order, into
    the distinct grad-bank rows they started from."""
    with LaneStreams(plan.num_lanes, device) as lanes:
        for launch in reversed(plan.launches):
            with lanes.on(launch.lane):
                dh0 = scan(launch)
                if launch.start_slots.numel():
                    segment_add(bank_grad, launch.start_slots, dh0, launch.start_bounds, launch.start_seqs)


def input_gradients(plan: TreeGDNPlan, dtypes, key_heads: int, chunk_grads, l2norm_saved=()) -> list:
    """The gradients of q, k, v, g, beta on the compact tokens, in `dtypes`, from chunk_bwd's `chunk_grads`
    (dq, dk, dv, dbeta, dg per value head [, the replayed rows' dk, dv, dbeta, dg by replay slot]): q's and k's
    summed over each key head's group, and every token that other rows replay given their gradients too. With
    `l2norm_saved` (`l2norm.normalize_qk`: q and k were normalised inside the Function) dq and dk go through the
    l2 norm's backward from fp32, which rounds them to q's and k's dtypes."""
    dq, dk, dv, dbeta, dg, *side = chunk_grads
    unnormalise = dict(zip(("q", "k"), (l2norm_saved[:2], l2norm_saved[2:]))) if l2norm_saved else {}
    names = ("q", "k", "v", "g", "beta")  # the order of `dtypes` and of the returned gradients
    per_token = dict(zip(names, (dq, dk, dv, dg, dbeta)))
    replayed = dict(zip(("k", "v", "beta", "g"), side[0])) if side else {}  # by replay slot
    grads = []
    for name, dtype in zip(names, dtypes):
        grad = per_token[name]
        groups = grad.shape[1] // key_heads if name in ("q", "k") else 1  # value heads per key head
        # own row + the replays' sum, per value head, in grad's form (fp32 or block-scaled fp16 wherever heads are
        # summed or the l2 norm's backward runs next); a replayed row's dq is exactly 0 (its do is 0). Then the
        # value heads' sum, in the order of every token's.
        if plan.replay_dst.numel() and name != "q":
            segment_add(grad, plan.replay_dst, replayed[name], plan.replay_bounds)
        if name in unnormalise:  # the l2 norm's backward sums the value heads' rows itself
            grads.append(l2norm_rows_backward(*unnormalise[name], grad, groups=groups))
        else:
            grads.append(group_sum(grad, groups).to(dtype))
    return grads


class TreeGatedDeltaRuleFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_states, scale: float, plan: TreeGDNPlan, use_qk_l2norm: bool):
        index, rows = plan.index, plan.rows
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))  # the runtime's v is a split view
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype, initial_states.dtype)
        # on compact tokens (each once; replays read the normalised rows), in fp32 as fla does
        q, k, l2norm_saved = normalize_qk(q, k, use_qk_l2norm)
        hv, kd, vd = v.shape[1], k.shape[2], v.shape[2]
        gc, T, w, u = wy_fwd(k, v, g, beta, index, rows)
        h = torch.empty(index.num_chunks, hv, kd, vd, device=k.device, dtype=k.dtype)
        v_new = torch.empty_like(u)
        bank = state_bank(plan, initial_states, (hv, kd, vd), k.device)
        scan_rounds(plan, k.device, lambda launch: state_fwd(
            k, w, u, gc, bank, index, seqs=(launch.first_seq, launch.num_seqs), out=(h, v_new, bank[1:]), rows=rows,
            launch_seqs=launch.round_seqs, initial_rows=launch.init_row, order=launch.scan_order))
        # the output reads the raw query and key and their norms' reciprocals (l2norm_saved: raw q, its rstd, raw k,
        # its rstd), not the bf16 normalised rows: o's error a fifth lower
        if l2norm_saved:
            q_raw, q_rstd, k_raw, k_rstd = l2norm_saved
            o = output_fwd(q_raw, k_raw, v_new, gc, h, scale, index, rows, rstd=(q_rstd, k_rstd))
        else:
            o = output_fwd(q, k, v_new, gc, h, scale, index, rows)
        exported = bank[1:][plan.output_slots]
        ctx.save_for_backward(q, k, v, beta, gc, T, w, v_new, h, *l2norm_saved)
        ctx.scale, ctx.plan = scale, plan
        return o, exported

    @staticmethod
    def backward(ctx, d_out, d_exported):
        q, k, v, beta, gc, T, w, v_new, h, *l2norm_saved = ctx.saved_tensors
        plan: TreeGDNPlan = ctx.plan
        index, rows = plan.index, plan.rows
        hv, kd, vd = v.shape[1], k.shape[2], v.shape[2]
        do = torch.zeros_like(v) if d_out is None else d_out.to(v.dtype).contiguous()
        gated_at = gated_at_buffer(plan, q, k, gc, do, ctx.scale)
        dh = torch.empty(index.num_chunks, hv, kd, vd, device=q.device, dtype=k.dtype)
        dvn = torch.empty_like(v_new)
        bank_grad = state_bank_grad(plan, d_exported, (hv, kd, vd), q.device)
        initial_grad = ctx.needs_input_grad[5]
        scan_rounds_backward(plan, q.device, bank_grad, lambda launch: state_bwd_scan(
            q, k, w, gc, do, bank_grad, ctx.scale, index, dh, dvn, seqs=(launch.first_seq, launch.num_seqs),
            gated_at=gated_at_of(launch, gated_at), rows=rows, launch_seqs=launch.round_seqs,
            initial_state_grad=initial_grad, order=launch.scan_order))
        chunk_grads = chunk_bwd(q, k, v, beta, gc, T, v_new, h, dh, do, dvn, ctx.scale, index, rows,
                                dk_fp32=bool(l2norm_saved))
        grads = input_gradients(plan, ctx.dtypes, q.shape[1], chunk_grads, l2norm_saved)
        d_initial = bank_grad[index.num_slots:].to(ctx.dtypes[5]) if initial_grad else None
        return (*grads, d_initial, None, None, None)


def gated_at_buffer(plan: TreeGDNPlan, q, k, gc, do, scale):
    """(A^T, its first chunk, its chunks) over the chunks from the first to the last backward scan launch that does
    not form A^T itself (`GDNKernelConfig.scan_forms_dv_local`: narrow, or short sequences), or None where every
    launch forms its own (state_bwd.py)."""
    hv, vd = do.shape[1], do.shape[2]
    readers = [launch for launch in plan.launches if not plan.index.config.scan_forms_dv_local(
        launch.round_seqs, launch.longest_chunks, hv, vd, k.element_size())]
    if not readers:
        return None
    chunks = (min(launch.chunks[0] for launch in readers), max(launch.chunks[1] for launch in readers))
    return gated_at_bwd(q, k, gc, scale, plan.index, chunks, do.dtype, plan.rows), chunks[0], chunks


def gated_at_of(launch, buffer):
    """What `launch`'s backward scan takes as `gated_at`: the buffer where it covers the launch's chunks (every
    launch that does not form A^T, and those between them, which read it as well), else None."""
    if buffer is None or not buffer[2][0] <= launch.chunks[0] <= launch.chunks[1] <= buffer[2][1]:
        return None
    return buffer[:2]


def gated_delta_rule(q, k, v, g, beta, *, scale: float, plan: TreeGDNPlan, initial_states=None,
                     use_qk_l2norm: bool = False):
    """Compact q, k [T, HK, K], v [T, HV, V], g, beta [T, HV] -> (o [T, HV, V], exported [E, HV, K, V] fp32):
    every round of `plan` (a device plan: `upload.to_device`) with the Triton kernels (CUDA, or the CPU
    interpreter) in one autograd Function. `initial_states` [plan.num_initial, HV, K, V] (fp32/fp64, may take
    gradients) are the states the plan's caller-started sequences begin from."""
    tokens = validate_gdn_tensors(q, k, v, g, beta, who="gated_delta_rule")[0]
    initial_states = check_plan_call(q, k, v, plan, initial_states, tokens=tokens, who="gated_delta_rule",
                                     reference="plan_gated_delta_rule_reference")
    if any(map(interpreter_needs_fp32, (q, k, v, beta))):  # the interpreter's 16-bit dots are wrong: fp32
        o, exported = gated_delta_rule(q.float(), k.float(), v.float(), g, beta.float(), scale=scale, plan=plan,
                                       initial_states=initial_states, use_qk_l2norm=use_qk_l2norm)
        return o.to(v.dtype), exported
    return TreeGatedDeltaRuleFunction.apply(q, k, v, g, beta, initial_states, float(scale), plan, use_qk_l2norm)
