"""The model's RMS norms, fwd + bwd: the Triton kernels (codegen/kernels/rmsnorm) against the plain-torch chain they
replace, at the 2.25B bench model's shapes for a 65,536-token microbatch, bf16, in one run:

    python bench/rmsnorm.py [--tokens 65536]
    python bench/rmsnorm.py --device cpu --tiny      # toy sizes on the CPU (interpreter; checks it runs)

Rows per case: the decoder layers' two norms ([T, 2048], offset), GDN's gated output norm ([T x 32 heads, 128],
gated_silu), attention's q / k norms ([T x 16, 256] and [T x 2, 256], offset). Prints ms and GB/s of each and
the Triton / torch speed ratio, plus the largest relative difference of y and dx between the two.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, kernel_ms  # noqa: E402
from harts_compiler.codegen.kernels.rmsnorm import RMSNormFunction, rms_norm_reference  # noqa: E402


def cases(tokens: int) -> list[tuple[str, int, int, str]]:
    return [("decoder norm [T, 2048]", tokens, 2048, "offset"),
            ("GDN gated norm [32T, 128]", 32 * tokens, 128, "gated_silu"),
            ("attention q norm [16T, 256]", 16 * tokens, 256, "offset"),
            ("attention k norm [2T, 256]", 2 * tokens, 256, "offset")]


def step(fn, x, w, g, dy):
    leaves = [x, w] + ([g] if g is not None else [])
    y = fn(x, w, g)
    return torch.autograd.grad(y, leaves, dy)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="64 tokens (the interpreter on the CPU)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter truncates bf16 stores
    tokens = 64 if args.tiny else args.tokens
    rows = []
    for name, n, dim, mode in cases(tokens):
        x = torch.randn(n, dim, device=device, dtype=dtype).requires_grad_(True)
        w = (torch.randn(dim, device=device, dtype=dtype) * 0.1).requires_grad_(True)
        g = torch.randn(n, dim, device=device, dtype=dtype).requires_grad_(True) if mode == "gated_silu" else None
        dy = torch.randn(n, dim, device=device, dtype=dtype)
        fused = lambda x, w, g, mode=mode: RMSNormFunction.apply(x, w, g, 1e-6, mode)  # noqa: E731
        plain = lambda x, w, g, mode=mode: rms_norm_reference(x, w, 1e-6, mode, g)  # noqa: E731
        ms = {label: kernel_ms(lambda fn=fn: step(fn, x, w, g, dy), device) for label, fn in
              (("triton", fused), ("torch", plain))}
        # bytes a fused pass must move: x (and gate) and y forward; x, (gate,) dy, dx (, dgate) backward
        tensors = 5 + (3 if g is not None else 0)
        gbytes = tensors * n * dim * x.element_size() / 1e9
        diff = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                for a, b in zip(step(fused, x, w, g, dy)[:1] + (fused(x, w, g),),
                                step(plain, x, w, g, dy)[:1] + (plain(x, w, g),))]
        rows.append(dict(case=name, triton=ms["triton"], torch=ms["torch"], speed=ms["torch"] / ms["triton"],
                         gbs=gbytes / ms["triton"] * 1e3, dx=diff[0], y=diff[1]))
    print(f"{device}, {dtype}, {tokens} tokens: fwd + bwd ms")
    print(format_table(rows, [("case", "case"), ("triton", "triton ms"), ("torch", "torch ms"),
                              ("speed", "triton / torch speed"), ("gbs", "triton GB/s (min traffic)"),
                              ("y", "max rel. diff y"), ("dx", "max rel. diff dx")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
