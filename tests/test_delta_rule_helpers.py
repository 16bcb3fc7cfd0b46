"""Inputs, one call's outputs and gradients, and the error measure that the GDN and KDA kernel tests share.

The two families differ in their gate only (g [R, HV] for GDN, [R, HV, K] for KDA): the callers draw it with
`gate(generator, rows, value_heads, key_dim)`, between v and beta, so each test's data stays what it was.
"""
import torch

# what `outputs_and_grads` returns, in order
NAMES = ["o", "exported", "dq", "dk", "dv", "dg", "dbeta", "d_initial_state"]


def interpreter_inputs(lengths, gate, hk=1, hv=2, kd=16, vd=32, seed=0):
    """fp32 CPU leaves q, k (unit rows: a stable delta rule), v, g, beta, one initial state per sequence, and
    cu_seqlens, at the sizes the Triton interpreter runs."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(lengths)
    tensors = [
        torch.randn(rows, hk, kd, generator=gen),
        torch.nn.functional.normalize(torch.randn(rows, hk, kd, generator=gen), dim=-1),
        torch.randn(rows, hv, vd, generator=gen),
        gate(gen, rows, hv, kd),
        torch.rand(rows, hv, generator=gen),
        torch.randn(len(lengths), hv, kd, vd, generator=gen) * 0.1,
    ]
    cu = torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)
    return [t.requires_grad_(True) for t in tensors], cu


def cuda_inputs(lengths, gate, hk, hv, kd=128, vd=128, seed=0):
    """bf16 q, k, v, beta, the gate, fp32 initial states (one per sequence) and cu_seqlens on CUDA: the
    models' dtypes."""
    gen = torch.Generator("cuda").manual_seed(seed)
    rows = sum(lengths)
    q = torch.randn(rows, hk, kd, device="cuda", generator=gen).bfloat16()
    k = torch.randn(rows, hk, kd, device="cuda", generator=gen).bfloat16()
    v = torch.randn(rows, hv, vd, device="cuda", generator=gen).bfloat16()
    g = gate(gen, rows, hv, kd)
    beta = torch.sigmoid(torch.randn(rows, hv, device="cuda", generator=gen)).bfloat16()
    h0 = torch.randn(len(lengths), hv, kd, vd, device="cuda", generator=gen) * 0.05
    cu = torch.tensor([0] + list(lengths), device="cuda").cumsum(0).to(torch.int32)
    return [q, k, v, g, beta, h0], cu


def outputs_and_grads(fn, leaves, cu, *, scale, with_do=True, **kw):
    """[o, exported, then the gradients of `leaves` = (q, k, v, g, beta, initial state)] of the single call `fn`
    (`kw`: exports, l2norm, launch config), under random gradients of o and of the exported states drawn on o's
    device (o's is zero without `with_do`: the exported states' alone)."""
    q, k, v, g, beta, h0 = leaves
    o, exported = fn(q, k, v, g, beta, scale=scale, initial_state=h0, cu_seqlens=cu, **kw)
    gen = torch.Generator(o.device).manual_seed(1)
    do = torch.randn(o.shape, device=o.device, generator=gen) if with_do else torch.zeros(o.shape, device=o.device)
    ds = torch.randn(exported.shape, device=o.device, generator=gen)
    return [o, exported, *torch.autograd.grad((o * do).sum() + (exported * ds).sum(), leaves)]


def forward_backward(fn, leaves, cu, export_seq, export_offset, with_do=True, **kw):
    """The interpreter tests' call: `outputs_and_grads` at scale 0.4 with these exports."""
    return outputs_and_grads(fn, leaves, cu, scale=0.4, with_do=with_do, export_seq=export_seq,
                             export_offset=export_offset, **kw)


def run_call(fn, tensors, cu, exports, upcast=False, **kw):
    """The GPU tests' call: `outputs_and_grads` on fresh leaves of `tensors` (fp32 copies with `upcast`, for the
    reference) at scale K^-0.5 with l2norm, as the models run."""
    leaves = [(t.float() if upcast else t).detach().requires_grad_(True) for t in tensors]
    return outputs_and_grads(fn, leaves, cu, scale=leaves[0].shape[-1] ** -0.5, use_qk_l2norm=True, **exports,
                             **kw)


def rel(a, b):
    """||a - b|| / ||b|| in fp64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
