"""16-bit inputs on the CPU: Triton's interpreter (triton 3.6) gets tl.dot of bf16 operands wrong, so the
kernels with dots run such inputs in fp32 there and cast back (codegen/kernels/interpreter_safe.py).
Only meaningful under TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)."""
import os

import pytest
import torch

from harts_compiler.codegen.kernels.chunk_gdn import chunk_gated_delta_rule, chunk_gated_delta_rule_reference
from harts_compiler.codegen.kernels.interpreter_safe import interpreter_needs_fp32

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU interpreter behaviour")


def _gdn_case(rows: int, dim: int, seed: int, heads: int = 2):
    """fp32 q, k, v, g, beta of one sequence and the call's other arguments."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(rows, heads, dim, generator=gen) for _ in range(3))
    g, beta = -torch.rand(rows, heads, generator=gen) * 0.1, torch.rand(rows, heads, generator=gen)
    common = dict(scale=dim ** -0.5, initial_state=torch.zeros(1, heads, dim, dim),
                  cu_seqlens=torch.tensor([0, rows]), use_qk_l2norm=True)
    return (q, k, v, g, beta), common


def test_only_sixteen_bit_cpu_tensors_are_widened():
    assert interpreter_needs_fp32(torch.zeros(1, dtype=torch.bfloat16))
    assert interpreter_needs_fp32(torch.zeros(1, dtype=torch.float16))
    assert not interpreter_needs_fp32(torch.zeros(1))


def test_bf16_gdn_on_the_interpreter_is_right():
    """Before the fp32 widening this was off by ~1e10 (the interpreter's bf16 dots)."""
    (q, k, v, g, beta), common = _gdn_case(rows=130, dim=32, seed=0)
    common.update(export_seq=torch.tensor([0]), export_offset=torch.tensor([128]))
    leaves = [t.bfloat16().requires_grad_(True) for t in (q, k, v)]
    got, got_state = chunk_gated_delta_rule(*leaves, g, beta.bfloat16(), **common)
    want, want_state = chunk_gated_delta_rule_reference(q, k, v, g, beta, **common)
    assert got.dtype == torch.bfloat16 and got_state.dtype == torch.float32
    assert float((got.float() - want).norm() / want.norm()) < 2e-2
    assert float((got_state - want_state).norm() / want_state.norm()) < 2e-2
    grads = torch.autograd.grad(got.float().sum(), leaves)
    assert all(gr.dtype == torch.bfloat16 and torch.isfinite(gr).all() for gr in grads)


def test_mixed_dtypes_are_widened_too():
    """bf16 q/k with fp32 v: any 16-bit operand would reach a broken interpreter dot."""
    (q, k, v, g, beta), common = _gdn_case(rows=70, dim=16, seed=2)
    leaves = [q.bfloat16().requires_grad_(True), k.bfloat16().requires_grad_(True), v.requires_grad_(True)]
    got, _ = chunk_gated_delta_rule(*leaves, g, beta, **common)
    want, _ = chunk_gated_delta_rule_reference(q, k, v, g, beta, **common)
    assert float((got - want).norm() / want.norm()) < 2e-2
    grads = torch.autograd.grad(got.sum(), leaves)
    assert [gr.dtype for gr in grads] == [torch.bfloat16, torch.bfloat16, torch.float32]

