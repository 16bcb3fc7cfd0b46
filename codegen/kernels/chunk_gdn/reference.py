"""Plain-torch Gated DeltaNet: the chunkwise (WY / triangular solve) algorithm and a token loop.

Both follow docs/INTERFACES.md section 4 (`chunk_gdn`): varlen rows packed by `cu_seqlens`, chunks
aligned to each sequence start, an initial state per sequence, and exported boundary states that
are ordinary autograd outputs (so their gradients flow back through torch autograd; no custom
backward here). The chunked form mirrors transformers' `torch_chunk_gated_delta_rule` chunk by
chunk, so a sequence split at an aligned boundary and restarted from its exported state computes
the same chunks with the same entering states (bitwise in fp32 on one device).

Precision: fp64 inputs compute in fp64 (oracle tests at 1e-10); anything else computes in fp32.
"""
from __future__ import annotations

import torch

from .inputs import GDNShapes, validate_gdn_inputs


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, as transformers (and fla) do it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare_qk(q, k, shapes: GDNShapes, scale: float, use_qk_l2norm: bool, dtype: torch.dtype, norm=l2norm):
    """Cast, optionally l2-normalise (with `norm`), expand key heads to value heads, scale q."""
    q, k = q.to(dtype), k.to(dtype)
    if use_qk_l2norm:
        q, k = norm(q), norm(k)
    group = shapes.value_heads // shapes.key_heads
    if group > 1:  # value head h reads key head h // group
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    return q * scale, k


def _chunk_row_index(shapes: GDNShapes, chunk_size: int, device) -> tuple[torch.Tensor, list[int], list[int]]:
    """[NC, C] packed row of every chunk slot (R = padding row), and per chunk its sequence and index."""
    rows, chunk_seq, chunk_pos = [], [], []
    for n, (start, length) in enumerate(zip(shapes.seq_starts, shapes.seq_lengths)):
        for c, first in enumerate(range(0, length, chunk_size)):
            slot = [start + first + i if first + i < length else shapes.rows for i in range(chunk_size)]
            rows.append(slot)
            chunk_seq.append(n)
            chunk_pos.append(c)
    index = torch.tensor(rows, dtype=torch.long, device=device).reshape(-1, chunk_size)
    return index, chunk_seq, chunk_pos


def _to_chunks(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[R, H, ...] -> [NC, H, C, ...] with zero padding rows (zero k/v/beta and g=0 change nothing)."""
    padded = torch.cat([x, x.new_zeros((1,) + x.shape[1:])], dim=0)
    # contiguous: CPU matmuls over transposed views round differently with the batch size
    return padded[index].transpose(1, 2).contiguous()


def unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """(I + strictly_lower(a))^-1 by forward substitution, batched over leading dims.

    Elementwise products and row sums only, so every chunk's result is bitwise independent of how many
    chunks share the batch (torch.linalg.solve_triangular is not, on CPU).
    """
    size = a.shape[-1]
    inverse = -a.tril(-1)
    for i in range(1, size):
        row = inverse[..., i, :i].clone()
        above = inverse[..., :i, :i].clone()
        inverse[..., i, :i] = row + (row.unsqueeze(-1) * above).sum(-2)
    return inverse + torch.eye(size, dtype=a.dtype, device=a.device)


def chunk_gated_delta_rule_reference(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, export_seq=None,
                                     export_offset=None, chunk_size=64, use_qk_l2norm=False):
    """Chunkwise gated delta rule; returns (o [R, HV, V] in v's dtype, exported [E, HV, K, V] fp32/fp64)."""
    shapes = validate_gdn_inputs(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                 export_seq=export_seq, export_offset=export_offset, chunk_size=chunk_size)
    dtype = _compute_dtype(q)
    C = chunk_size
    q, k = _prepare_qk(q, k, shapes, scale, use_qk_l2norm, dtype)
    index, chunk_seq, chunk_pos = _chunk_row_index(shapes, C, q.device)
    n_chunks = index.shape[0]
    state = initial_state.to(dtype)
    if n_chunks == 0:
        return v.new_zeros(v.shape), state.new_zeros((0,) + state.shape[1:])

    # [NC, H, C, D] / [NC, H, C]
    q_c, k_c, v_c = (_to_chunks(x, index) for x in (q, k, v.to(dtype)))
    g_c, beta_c = (_to_chunks(x.to(dtype), index) for x in (g, beta))

    # Phase 1, per chunk, independent of the state (same operations as transformers).
    strictly_upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    g_cum = g_c.cumsum(dim=-1)
    decay = (g_cum.unsqueeze(-1) - g_cum.unsqueeze(-2)).masked_fill(strictly_upper, float("-inf")).exp()
    k_beta = k_c * beta_c.unsqueeze(-1)
    v_beta = v_c * beta_c.unsqueeze(-1)
    ut_system = (k_beta @ k_c.transpose(-1, -2)) * decay
    intra_attn = (q_c @ k_c.transpose(-1, -2)) * decay
    # (I + strictly_lower(ut_system))^-1: the WY representation of the chunk's delta-rule updates.
    wy = unit_lower_inverse(ut_system)
    new_values = wy @ v_beta
    k_cumdecay = wy @ (k_beta * g_cum.exp().unsqueeze(-1))
    q_decayed = q_c * g_cum.exp().unsqueeze(-1)
    k_to_end = k_c * (g_cum[..., -1:] - g_cum).exp().unsqueeze(-1)
    chunk_decay = g_cum[..., -1].exp()[..., None, None]

    return chunk_scan(state, chunk_seq, chunk_pos, index, shapes, new_values=new_values, k_cumdecay=k_cumdecay,
                      q_decayed=q_decayed, intra_attn=intra_attn, k_to_end=k_to_end, chunk_decay=chunk_decay,
                      out_dtype=v.dtype)


def chunk_scan(state, chunk_seq: list[int], chunk_pos: list[int], index: torch.Tensor, shapes: GDNShapes, *,
               new_values, k_cumdecay, q_decayed, intra_attn, k_to_end, chunk_decay, out_dtype):
    """Phase 2 of the chunked rule (GDN's and KDA's alike, once phase 1 has built the per-chunk terms): the
    scan, chunk index j of every sequence that has one, batched over sequences; returns (o, exported states)."""
    C = index.shape[1]
    n_chunks = index.shape[0]
    seq_of = torch.tensor(chunk_seq, device=state.device)
    pos_of = torch.tensor(chunk_pos, device=state.device)
    export_at: dict[tuple[int, int], list[int]] = {}
    for e, (s, off) in enumerate(zip(shapes.export_seq, shapes.export_offset)):
        export_at.setdefault((s, off // C - 1), []).append(e)
    exported: list[torch.Tensor | None] = [None] * len(shapes.export_seq)
    outputs = [None] * n_chunks
    for j in range(int(pos_of.max()) + 1):
        chunk_ids = torch.nonzero(pos_of == j).flatten()
        seqs = seq_of[chunk_ids]
        s_old = state[seqs]
        v_new = new_values[chunk_ids] - k_cumdecay[chunk_ids] @ s_old
        out = q_decayed[chunk_ids] @ s_old + intra_attn[chunk_ids] @ v_new
        s_new = s_old * chunk_decay[chunk_ids] + k_to_end[chunk_ids].transpose(-1, -2) @ v_new
        state = state.index_copy(0, seqs, s_new)
        for i, c in enumerate(chunk_ids.tolist()):
            outputs[c] = out[i]
            for e in export_at.get((chunk_seq[c], j), ()):
                exported[e] = s_new[i]

    o_chunks = torch.stack(outputs).transpose(1, 2).reshape(n_chunks * C, shapes.value_heads, shapes.value_dim)
    o = o_chunks[index.reshape(-1) < shapes.rows].to(out_dtype)
    states = torch.stack(exported) if exported else state.new_zeros((0,) + state.shape[1:])
    return o, states


def recurrent_gated_delta_rule_reference(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, export_seq=None,
                                         export_offset=None, chunk_size=64, use_qk_l2norm=False):
    """Token-by-token loop of the same rule (the oracle of the chunked oracle); same signature and outputs.

    Per token: S <- S exp(g_t); u_t = beta_t (v_t - S^T k_t); S <- S + k_t u_t^T; o_t = S^T (scale q_t).
    """
    shapes = validate_gdn_inputs(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                 export_seq=export_seq, export_offset=export_offset, chunk_size=chunk_size)
    dtype = _compute_dtype(q)
    q, k = _prepare_qk(q, k, shapes, scale, use_qk_l2norm, dtype)
    return token_loop(q, k, v, g.unsqueeze(-1), beta, initial_state, shapes, chunk_size)


def token_loop(q, k, v, g, beta, initial_state, shapes: GDNShapes, chunk_size: int):
    """The per-token recurrence on prepared q, k (GDN's and KDA's alike): g [R, H, K] or [R, H, 1] log decays
    scale the state's key rows; returns (o in v's dtype, the states at the exported offsets)."""
    dtype = q.dtype
    out_dtype = v.dtype
    v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)
    exported: list[torch.Tensor | None] = [None] * len(shapes.export_seq)
    outputs = []
    for n, (start, length) in enumerate(zip(shapes.seq_starts, shapes.seq_lengths)):
        s = initial_state[n].to(dtype)  # [H, K, V]
        wanted = {off: [e for e, (es, eo) in enumerate(zip(shapes.export_seq, shapes.export_offset))
                        if es == n and eo == off] for off in range(chunk_size, length + 1, chunk_size)}
        for t in range(start, start + length):
            s = s * g[t].exp()[:, :, None]
            u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", s, k[t]))
            s = s + k[t][:, :, None] * u[:, None, :]
            outputs.append(torch.einsum("hkv,hk->hv", s, q[t]))
            for e in wanted.get(t - start + 1, ()):
                exported[e] = s
    o = torch.stack(outputs).to(out_dtype) if outputs else v.new_zeros(v.shape, dtype=out_dtype)
    states = torch.stack(exported) if exported else initial_state.new_zeros((0,) + initial_state.shape[1:]).to(dtype)
    return o, states


# docs/INTERFACES.md names the token loop `recurrent_gated_delta_rule`.
recurrent_gated_delta_rule = recurrent_gated_delta_rule_reference


def plan_gated_delta_rule_reference(q, k, v, g, beta, *, scale, plan, initial_states=None, use_qk_l2norm=False,
                                    state_dtype=None, kernel=chunk_gated_delta_rule_reference):
    """`tree.gated_delta_rule` in plain torch: the same plan (tree_plan.TreeGDNPlan on q's device), run launch
    by launch with `kernel` (this file's chunked or token-loop reference) on the gathered packed rows. Every step
    is an ordinary differentiable op, so autograd sums the replayed rows' gradients onto their tokens and routes
    the exported states' gradients into the launches that made them. `state_dtype`: of the bank (fp32, or fp64
    for fp64 inputs). Host control flow reads only the plan's host fields: no device read."""
    index = plan.index
    dtype = state_dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    hv, kd, vd = v.shape[1], k.shape[2], v.shape[2]
    if not plan.identity_layout:
        q, k, v, g, beta = (x[plan.row_src] for x in (q, k, v, g, beta))
    zero = torch.zeros((hv, kd, vd), dtype=dtype, device=v.device)
    slots: list = [None] * index.num_slots
    caller = [] if initial_states is None else list(initial_states.to(dtype).unbind(0))

    def bank_row(row: int):
        if row == 0:
            return zero
        return slots[row - 1] if row - 1 < index.num_slots else caller[row - 1 - index.num_slots]

    exports_of: dict[int, list[tuple[int, int]]] = {}
    for seq, offset, slot in zip(index.export_seq, index.export_offset, index.export_slot_host):
        exports_of.setdefault(seq, []).append((offset, slot))
    bounds = [0]
    for length in index.seq_lengths:
        bounds.append(bounds[-1] + length)
    outputs = []
    for launch in plan.launches:
        first, stop = launch.first_seq, launch.first_seq + launch.num_seqs
        lo, hi = bounds[first], bounds[stop]
        mine = [(seq - first, offset, slot) for seq in range(first, stop)
                for offset, slot in dict.fromkeys(exports_of.get(seq, []))]
        as_host = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731 (host: no device read)
        out, exported = kernel(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], scale=scale,
                               initial_state=torch.stack([bank_row(r) for r in launch.init_host]),
                               cu_seqlens=as_host([b - lo for b in bounds[first:stop + 1]]),
                               export_seq=as_host([e[0] for e in mine]), export_offset=as_host([e[1] for e in mine]),
                               chunk_size=index.chunk_size, use_qk_l2norm=use_qk_l2norm)
        for state, (_, _, slot) in zip(exported.unbind(0), mine):
            slots[slot] = state.to(dtype)
        outputs.append(out)
    o = torch.cat(outputs) if outputs else v.new_zeros((0, hv, vd))
    if not plan.identity_layout:
        o = o[plan.own_pick]
    exported = [slots[s] for s in plan.output_slots_host]
    return o, torch.stack(exported) if exported else zero.new_zeros((0, hv, kd, vd))
