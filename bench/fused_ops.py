"""The model's fused elementwise kernels, fwd + bwd, against the plain-torch chains they replace, at the 2.25B bench
model's shapes for a 65,536-token microbatch, bf16, in one run:

    python bench/fused_ops.py [--tokens 65536]
    python bench/fused_ops.py --device cpu --tiny      # toy sizes on the CPU (interpreter; checks it runs)

RMS norms (codegen/kernels/rmsnorm): the decoder layers' two norms ([T, 2048], offset), GDN's gated output norm
([T x 32 heads, 128], gated_silu), attention's q / k norms ([T x 16, 256] and [T x 2, 256], offset), against
transformers' fp32 chain. MoE combine (codegen/kernels/moe_combine): 4 routed slots + the sigmoid-gated shared
expert at [T, 2048] (Qwen3-Next), against the chain it replaced (weight multiply, index_copy back to token order,
slot sum, gate multiply, add). MoE dispatch (the same folder): each token's row copied to its 4 sorted rows (32
experts), whose backward sums them per token in slot order, against torch's indexing (a sort-based scatter-add
backward). Prints ms and GB/s of each and the Triton / torch speed ratio, plus the largest
relative difference of the output and the first input's gradient between the two.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, kernel_ms  # noqa: E402
from harts_compiler.codegen.kernels.moe_combine import MoECombineFunction, MoEDispatchFunction  # noqa: E402
from harts_compiler.codegen.kernels.rmsnorm import RMSNormFunction, rms_norm_reference  # noqa: E402


def norm_case(name, rows, dim, mode, device, dtype):
    """(name, leaves, fused fn, torch fn, bytes a fused fwd + bwd must move) of one RMS norm."""
    x = torch.randn(rows, dim, device=device, dtype=dtype)
    w = torch.randn(dim, device=device, dtype=dtype) * 0.1
    g = torch.randn(rows, dim, device=device, dtype=dtype) if mode == "gated_silu" else None
    leaves = [t.requires_grad_(True) for t in (x, w, g) if t is not None]
    fused = lambda *t: RMSNormFunction.apply(t[0], t[1], g if g is None else t[2], 1e-6, mode)  # noqa: E731
    plain = lambda *t: rms_norm_reference(t[0], t[1], 1e-6, mode, g if g is None else t[2])  # noqa: E731
    # x (and gate) and y forward; x, (gate,) dy, dx (, dgate) backward
    tensors = 5 + (3 if g is not None else 0)
    return name, leaves, fused, plain, tensors * rows * dim * x.element_size()


def combine_case(name, tokens, top_k, dim, device, dtype):
    """The MoE combine with a sigmoid-gated shared expert, and the torch chain it replaced."""
    hidden = torch.randn(tokens * top_k, dim, device=device, dtype=dtype)
    position = torch.randperm(tokens * top_k, device=device).view(tokens, top_k)
    order = torch.empty_like(position.view(-1)).scatter_(0, position.view(-1),
                                                          torch.arange(tokens * top_k, device=device))
    weight = torch.rand(tokens, top_k, device=device, dtype=dtype)
    shared = torch.randn(tokens, dim, device=device, dtype=dtype)
    logit = torch.randn(tokens, 1, device=device, dtype=dtype)
    leaves = [t.requires_grad_(True) for t in (hidden, weight, shared, logit)]

    def plain(h, w, s, g):
        h = h * w.reshape(-1)[order, None]
        slots = torch.index_copy(torch.empty_like(h), 0, order, h)
        return slots.view(tokens, top_k, dim).sum(1) + torch.sigmoid(g) * s

    fused = lambda h, w, s, g: MoECombineFunction.apply(h, position, w, s, g)  # noqa: E731
    # hidden, shared, y forward; dy, hidden, shared, dhidden, dshared backward
    return name, leaves, fused, plain, (4 * top_k + 4) * tokens * dim * hidden.element_size()


def dispatch_case(name, tokens, top_k, experts, dim, device, dtype):
    """Each token's row to its top_k rows sorted by expert, and torch's indexing."""
    from harts_compiler.runtime.moe import sort_by_expert

    top = torch.rand(tokens, experts, device=device).topk(top_k, dim=1).indices
    routing = sort_by_expert(top, experts)
    x = torch.randn(tokens, dim, device=device, dtype=dtype).requires_grad_(True)
    fused = lambda x: MoEDispatchFunction.apply(x, routing.token_of, routing.position)  # noqa: E731
    plain = lambda x: x[routing.token_of]  # noqa: E731
    # x read, k rows written forward; k rows read, dx written backward
    return name, [x], fused, plain, (2 * top_k + 2) * tokens * dim * x.element_size()


def step(fn, leaves, dy):
    y = fn(*leaves)
    return torch.autograd.grad(y, leaves, dy)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="64 tokens (the interpreter on the CPU)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter truncates bf16 stores
    t = 64 if args.tiny else args.tokens
    cases = [norm_case("decoder norm [T, 2048]", t, 2048, "offset", device, dtype),
             norm_case("GDN gated norm [32T, 128]", 32 * t, 128, "gated_silu", device, dtype),
             norm_case("attention q norm [16T, 256]", 16 * t, 256, "offset", device, dtype),
             norm_case("attention k norm [2T, 256]", 2 * t, 256, "offset", device, dtype),
             combine_case("MoE combine 4 slots + gated shared [T, 2048]", t, 4, 2048, device, dtype),
             dispatch_case("MoE dispatch 4 of 32 experts [T, 2048]", t, 4, 32, 2048, device, dtype)]
    rows = []
    for name, leaves, fused, plain, nbytes in cases:
        y = fused(*leaves).detach()
        dy = torch.randn_like(y)
        ms = {label: kernel_ms(lambda fn=fn: step(fn, leaves, dy), device) for label, fn in
              (("triton", fused), ("torch", plain))}
        diff = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                for a, b in ((y, plain(*leaves)), (step(fused, leaves, dy)[0], step(plain, leaves, dy)[0]))]
        rows.append(dict(case=name, triton=ms["triton"], torch=ms["torch"], speed=ms["torch"] / ms["triton"],
                         gbs=nbytes / 1e9 / ms["triton"] * 1e3, y=diff[0], dx=diff[1]))
    print(f"{device}, {dtype}, {t} tokens: fwd + bwd ms")
    print(format_table(rows, [("case", "case"), ("triton", "triton ms"), ("torch", "torch ms"),
                              ("speed", "triton / torch speed"), ("gbs", "triton GB/s (min traffic)"),
                              ("y", "max rel. diff y"), ("dx", "max rel. diff d(first input)")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
