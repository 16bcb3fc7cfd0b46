"""Digests of the GDN kernels' outputs and gradients: run it on two versions of the code and compare the lines to
show that a kernel change kept every bit (or find the first tensor that moved).

Fixed-seed inputs on the GPU (bf16, K = V = 128, l2norm in the kernel): three trajectory-wise calls (full-width
scans, a mix of short and long sequences at 16 key / 32 value heads, one lone sequence whose scans run narrow)
and three tree batches (two anchors, two small trees), each through the tree Function and trajectory-wise.
One line per case: sha1 (12 hex digits) of o and of every input gradient.

    python3 bench/gdn_digests.py > a.txt   # on each version, then: diff a.txt b.txt
    python3 bench/gdn_digests.py --configs default dv_buffer   # a launch variant's lines beside the default's
"""
from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gdn_cases import CONFIG_VARIANTS, make_inputs, single_call_plan, tree_case  # noqa: E402
from harts_compiler.codegen.kernels.chunk_gdn import GDNKernelConfig, gated_delta_rule  # noqa: E402

CALLS = [("8 x 7,680 H16/16", [7680] * 8, 16, 16), ("5 mixed H16/32", [300, 4100, 64, 1000, 2900], 16, 32),
         ("1 x 32,768 H16/32", [32768], 16, 32)]
TREES = [[(4096, 8, 3584)], [(16384, 8, 2048)], [(700, 3, 300), (2000, 5, 900)]]


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:12]


def print_digests(label: str, config: GDNKernelConfig):
    torch.manual_seed(0)
    for name, lengths, hk, hv in CALLS:
        tensors, cu = make_inputs(lengths, hk=hk, hv=hv, seed=5)
        leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
        o = gated_delta_rule(*leaves[:5], scale=128 ** -0.5, plan=single_call_plan(cu, config=config),
                             initial_states=leaves[5], use_qk_l2norm=True)[0]
        do = torch.randn(o.shape, device=o.device, generator=torch.Generator(o.device).manual_seed(1)).to(o.dtype)
        grads = torch.autograd.grad(o, leaves, do)
        print(f"[{label}] {name}: o {digest(o)} " + " ".join(f"d{n} {digest(g)}" for n, g in
                                                            zip(("q", "k", "v", "g", "beta", "h0"), grads)), flush=True)
    for trees in TREES:
        case = tree_case(trees, config)
        for mode, fn, leaves, do in (("tree", case.ours_tree, case.compact, case.do_tree),
                                     ("trajectory-wise", case.ours_traj, case.traj, case.do_traj)):
            o = fn(*leaves)
            grads = torch.autograd.grad(o, leaves, do)
            print(f"[{label}] {trees} {mode}: o {digest(o)} " + " ".join(digest(g) for g in grads), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["default"], choices=["default", *CONFIG_VARIANTS],
                        help="launch configurations to digest, one block of lines each (gdn_cases.CONFIG_VARIANTS)")
    for name in parser.parse_args().configs:
        print_digests(name, CONFIG_VARIANTS[name][1] if name in CONFIG_VARIANTS else GDNKernelConfig())


if __name__ == "__main__":
    main()
