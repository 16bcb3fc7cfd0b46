"""The RMS-norm kernels (codegen/kernels/rmsnorm) against their plain-torch reference in float64, every mode,
output and gradient: under Triton's interpreter on the CPU (fp32 inputs: the interpreter truncates 16-bit
stores) and in bf16 on a GPU. Rows are norm'd alike wherever they sit, and the dispatch keeps the reference for
everything but 16-bit CUDA tensors."""
import pytest
import torch

from harts_compiler.codegen.kernels.rmsnorm import MODES, RMSNormFunction, rms_norm, rms_norm_reference
from harts_compiler.codegen.kernels.rmsnorm import function as rmsnorm_function

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(mode, rows, dim, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=gen, dtype=torch.float64) * 3
    # Qwen's offset norm scales by 1 + w (w near 0), the others by w (near 1)
    w = torch.randn(dim, generator=gen, dtype=torch.float64) * 0.2 + (0.0 if mode == "offset" else 1.0)
    g = torch.randn(rows, dim, generator=gen, dtype=torch.float64) * 2 if mode.startswith("gated") else None
    dy = torch.randn(rows, dim, generator=gen, dtype=torch.float64)
    cast = [t.to(DEVICE, dtype) if t is not None else None for t in (x, w, g, dy)]
    return (x, w, g, dy), cast


def grads(fn, x, w, g, dy):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w) + ((g,) if g is not None else ())]
    y = fn(leaves[0], leaves[1], leaves[2] if g is not None else None)
    return [y.detach()] + list(torch.autograd.grad(y, leaves, dy))


def relative(a, b):
    return ((a.double().cpu() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows, dim", [(37, 128), (5, 2048), (300, 96)])
def test_kernel_matches_the_float64_reference(mode, rows, dim):
    if DEVICE == "cpu":
        dtype, bar = torch.float32, lambda ref_err: 1e-6  # fp32 against fp64
    else:
        dtype, bar = torch.bfloat16, lambda ref_err: 1.1 * ref_err + 1e-5  # bf16: at torch's own bf16 error
    exact, cast = inputs(mode, rows, dim, dtype=dtype)
    got = grads(lambda x, w, g: RMSNormFunction.apply(x, w, g, 1e-6, mode), *cast)
    ref = grads(lambda x, w, g: rms_norm_reference(x, w, 1e-6, mode, g), *exact)
    torch_low = grads(lambda x, w, g: rms_norm_reference(x, w, 1e-6, mode, g), *cast)
    names = ["y", "dx", "dw", "dgate"]
    for name, a, b, t in zip(names, got, ref, torch_low):
        assert a.dtype == t.dtype and a.shape == t.shape, name
        err, ref_err = relative(a, b), relative(t, b)
        assert err <= bar(ref_err), f"{mode} {name}: {err:.2e} (torch in {dtype}: {ref_err:.2e})"


def test_a_row_is_normed_alike_wherever_it_sits():
    # tree mode and trajectory-wise mode put one token's row at different positions and in different blocks
    _, (x, w, g, dy) = inputs("gated_silu", 200, 128, dtype=torch.float32)
    perm = torch.randperm(200, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    a = grads(lambda x, w, g: RMSNormFunction.apply(x, w, g, 1e-6, "gated_silu"), x, w, g, dy)
    b = grads(lambda x, w, g: RMSNormFunction.apply(x, w, g, 1e-6, "gated_silu"), x[perm], w, g[perm], dy[perm])
    for i in (0, 1, 3):  # y, dx, dgate are per row
        assert torch.equal(a[i][perm], b[i])


@pytest.mark.parametrize("mode", ["gated_silu", "gated_sigmoid"])
def test_a_strided_gate_is_read_in_place(mode):
    """GDN's gate z is a column slice of a wider projection, [T, heads, dim] with a row stride of the whole
    projection: the kernels read it without a copy and give what a contiguous gate gives, bitwise."""
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    _, (x, w, _, dy) = inputs(mode, 7 * 4, 32, dtype=dtype)
    wide = torch.randn(7, 3 * 4 * 32, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    gate = wide[:, 4 * 32:2 * 4 * 32].view(7, 4, 32)  # the middle slice, rows 384 apart
    assert not gate.is_contiguous()
    x, dy = x.view(7, 4, 32), dy.view(7, 4, 32)
    a = grads(lambda x, w, g: RMSNormFunction.apply(x, w, g, 1e-6, mode), x, w, gate, dy)
    b = grads(lambda x, w, g: RMSNormFunction.apply(x, w, g, 1e-6, mode), x, w, gate.contiguous(), dy)
    for u, v in zip(a, b):
        assert u.shape == v.shape and torch.equal(u, v)


def test_weight_gradient_partials_over_many_programs(monkeypatch):
    # each program walks several row blocks when there are more blocks than programs
    monkeypatch.setattr(rmsnorm_function, "MAX_PROGRAMS", 3)
    exact, cast = inputs("offset", 300, 64, seed=4, dtype=torch.float32)
    got = grads(lambda x, w, g: RMSNormFunction.apply(x, w, g, 1e-6, "offset"), *cast)
    ref = grads(lambda x, w, g: rms_norm_reference(x, w, 1e-6, "offset", g), *exact)
    assert relative(got[2], ref[2]) < 1e-6


def test_empty_input():
    _, (x, w, g, dy) = inputs("offset", 0, 128, dtype=torch.float32)
    y, dx, dw = grads(lambda x, w, g: RMSNormFunction.apply(x, w, g, 1e-6, "offset"), x, w, g, dy)
    assert y.shape == (0, 128) and dx.shape == (0, 128) and not dw.any()


def test_dispatch_keeps_the_reference_off_16_bit_cuda():
    x, w = torch.randn(4, 3, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    assert torch.equal(rms_norm(x, w, 1e-6, "offset"), rms_norm_reference(x, w, 1e-6, "offset"))
    with pytest.raises(ValueError, match="needs gate"):
        rms_norm(x, w, 1e-6, "gated_silu")
    with pytest.raises(ValueError, match="one of"):
        rms_norm(x, w, 1e-6, "layer")
