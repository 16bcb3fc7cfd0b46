"""The MoE combine kernels (codegen/kernels/moe_combine) against their plain-torch reference in float64, every
shared mode, output and gradient: under Triton's interpreter on the CPU (fp32 inputs: the interpreter truncates
16-bit stores) and in bf16 on a GPU. A token is combined alike wherever it sits, and the dispatch keeps the
reference for everything but 16-bit CUDA tensors. The dispatch to the experts' rows (`moe_dispatch`) sums its
gradient per token in slot order with the same pass."""
import pytest
import torch

from harts_compiler.codegen.kernels.moe_combine import (SHARED_MODES, MoECombineFunction, MoEDispatchFunction,
                                                        moe_combine, moe_combine_reference, moe_dispatch)
from harts_compiler.runtime.moe import sort_by_expert

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(mode, tokens, top_k, dim, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens * top_k, dim, generator=gen, dtype=torch.float64)
    position = torch.randperm(tokens * top_k, generator=gen).view(tokens, top_k)  # a sorted row per slot
    weight = torch.rand(tokens, top_k, generator=gen, dtype=torch.float64)
    shared = torch.randn(tokens, dim, generator=gen, dtype=torch.float64) if mode != "none" else None
    logit = torch.randn(tokens, 1, generator=gen, dtype=torch.float64) * 2 if mode == "sigmoid_gate" else None
    dy = torch.randn(tokens, dim, generator=gen, dtype=torch.float64)
    exact = (hidden, position, weight, shared, logit, dy)
    cast = tuple(t.to(DEVICE, dtype) if t is not None and t.is_floating_point() else
                 (t.to(DEVICE) if t is not None else None) for t in exact)
    return exact, cast


def grads(fn, hidden, position, weight, shared, logit, dy):
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None
              for t in (hidden, weight, shared, logit)]
    y = fn(leaves[0], position, leaves[1], leaves[2], leaves[3])
    live = [t for t in leaves if t is not None]
    return [y.detach()] + list(torch.autograd.grad(y, live, dy))


def relative(a, b):
    return ((a.double().cpu() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("mode", SHARED_MODES)
@pytest.mark.parametrize("tokens, top_k, dim", [(9, 4, 64), (5, 10, 2304), (3, 1, 48)])
def test_kernel_matches_the_float64_reference(mode, tokens, top_k, dim):
    if DEVICE == "cpu":
        dtype, bar = torch.float32, lambda ref_err: 1e-6  # fp32 against fp64
    else:
        dtype, bar = torch.bfloat16, lambda ref_err: 1.1 * ref_err + 1e-5  # bf16: at torch's own bf16 error
    exact, cast = inputs(mode, tokens, top_k, dim, dtype=dtype)
    got = grads(MoECombineFunction.apply, *cast)
    ref = grads(moe_combine_reference, *exact)
    torch_low = grads(moe_combine_reference, *cast)
    names = ["y", "dhidden", "dweight", "dshared", "dlogit"]
    for name, a, b, t in zip(names, got, ref, torch_low):
        assert a.dtype == t.dtype and a.shape == t.shape, name
        err, ref_err = relative(a, b), relative(t, b)
        assert err <= bar(ref_err), f"{mode} {name}: {err:.2e} (torch in {dtype}: {ref_err:.2e})"


def test_a_token_is_combined_alike_wherever_it_sits():
    # tree mode and trajectory-wise mode put one token at different rows and its slots at other sorted rows
    (_, _, _, _, _, _), (hidden, position, weight, shared, logit, dy) = inputs("sigmoid_gate", 40, 4, 128,
                                                                              dtype=torch.float32)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    rows = torch.randperm(160, generator=torch.Generator().manual_seed(2)).to(DEVICE)  # moves the sorted rows
    new_row = torch.empty_like(rows)
    new_row[rows] = torch.arange(160, device=DEVICE)
    a = grads(MoECombineFunction.apply, hidden, position, weight, shared, logit, dy)
    b = grads(MoECombineFunction.apply, hidden[rows], new_row[position[perm]], weight[perm], shared[perm],
              logit[perm], dy[perm])
    for i in (0, 2, 3, 4):  # y, dweight, dshared, dlogit are per token
        assert torch.equal(a[i][perm], b[i])
    assert torch.equal(a[1][rows], b[1])  # dhidden per sorted row


def test_empty_input():
    _, cast = inputs("add", 0, 4, 64, dtype=torch.float32)
    y, d_hidden, d_weight, d_shared = grads(MoECombineFunction.apply, *cast)
    assert y.shape == (0, 64) and d_hidden.shape == (0, 64) and d_weight.shape == (0, 4) and d_shared.shape == (0, 64)


def test_dispatch_keeps_the_reference_off_16_bit_cuda():
    exact, _ = inputs("sigmoid_gate", 6, 2, 32)
    hidden, position, weight, shared, logit, _ = exact
    assert torch.equal(moe_combine(hidden, position, weight, shared, logit),
                       moe_combine_reference(hidden, position, weight, shared, logit))
    with pytest.raises(ValueError, match="without shared"):
        moe_combine(hidden, position, weight, None, logit)


def test_wider_routing_weights():
    # Kimi's router returns fp32 weights for bf16 hidden rows: the kernels read them as fp32 and return their
    # gradient in their dtype (here fp64 weights with fp32 rows under the interpreter, fp32 with bf16 on a GPU)
    low, wide = (torch.float32, torch.float64) if DEVICE == "cpu" else (torch.bfloat16, torch.float32)
    exact, cast = inputs("add", 7, 8, 96, seed=3, dtype=low)
    hidden, position, weight, shared, _, dy = cast
    got = grads(MoECombineFunction.apply, hidden, position, exact[2].to(DEVICE, wide), shared, None, dy)
    ref = grads(moe_combine_reference, *exact)
    assert got[2].dtype == wide
    for a, b in zip(got, ref):
        assert relative(a, b) < (1e-6 if DEVICE == "cpu" else 1e-2)


def dispatch_grad(fn, x, routing, g):
    leaf = x.detach().clone().requires_grad_(True)
    rows = fn(leaf, routing.token_of, routing.position)
    return rows.detach(), torch.autograd.grad(rows, leaf, g)[0]


@pytest.mark.parametrize("tokens, top_k, dim, experts", [(33, 4, 64, 8), (7, 8, 2304, 32), (0, 4, 64, 8)])
def test_dispatch_gradient_is_the_slot_sum(tokens, top_k, dim, experts):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, dim, generator=gen, dtype=torch.float64)
    top = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]) if tokens else \
        torch.zeros(0, top_k, dtype=torch.long)
    g = torch.randn(tokens * top_k, dim, generator=gen, dtype=torch.float64)
    routing = sort_by_expert(top, experts)
    rows_ref, dx_ref = dispatch_grad(lambda x, t, p: x[t], x, routing, g)
    low = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    on = sort_by_expert(top.to(DEVICE), experts)
    rows, dx = dispatch_grad(MoEDispatchFunction.apply, x.to(DEVICE, low), on, g.to(DEVICE, low))
    assert torch.equal(rows.double().cpu(), x.to(low).double()[routing.token_of])
    _, dx_torch = dispatch_grad(lambda x, t, p: x[t], x.to(DEVICE, low), on, g.to(DEVICE, low))
    if tokens:  # one rounding of the fp32 slot sum: at least as close as torch's own low-precision scatter-add
        assert relative(dx, dx_ref) <= max(relative(dx_torch, dx_ref), 1e-6)


def test_dispatch_keeps_torch_indexing_off_16_bit_cuda():
    x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    routing = sort_by_expert(torch.tensor([[0, 1], [1, 2], [2, 0], [0, 1], [2, 1]]), 3)
    rows = moe_dispatch(x, routing.token_of, routing.position)
    assert rows.grad_fn.name() == "IndexBackward0" and torch.equal(rows, x[routing.token_of])
