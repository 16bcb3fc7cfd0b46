"""Where the GDN forward's error against fp32 comes from, without a GPU: the chunk algorithm in float64 with a
16-bit rounding at each point where the Triton kernels store or cast a tensor, each point switched off in turn.

The kernels' bf16 error against the fp32 reference (`bench/gdn_flashqla.py`, section 1) is the sum of many
roundings; this script says which of them matter, so that a precision fix costs a second dot only where it pays.
Points, by the kernels' names:
  q, k    the l2 norm's bf16 outputs (the output kernel reads the raw query and key and applies the norms to its
          dots' results, so in the current form q rounds nothing and k only what the other kernels read)
  T       the WY inverse, stored in bf16
  beta_k  the (beta exp(gc) k) operand of w's dot
  u_in    u's operand: T diag(beta) (current form), beta v (old form)
  wu      w and u, stored in bf16
  h       the state's bf16 copy that the dots read
  v_new   v_new, stored in bf16
  att     the gated q k^T before its dot with v_new
  v_dec   the decayed v_new before the state update

    python bench/gdn_rounding.py [--length 4096] [--seed 3] [--old]

--old: the form before (u from T (beta v), the output kernel on the l2 norm's bf16 rows).
"""
from __future__ import annotations

import argparse

import torch

from gdn_cases import make_inputs
from harts_compiler.codegen.kernels.chunk_gdn.reference import l2norm

CHUNK = 64
POINTS = ("q", "k", "T", "beta_k", "u_in", "wu", "h", "v_new", "att", "v_dec")


def rounded(x, on: bool):
    return x.to(torch.bfloat16).to(torch.float64) if on else x


def forward(q, k, v, g, beta, h0, on: dict, u_from_t_beta: bool, raw_out: bool):
    """o [L, V] of one sequence and head in float64, rounding at the points `on` names."""
    scale = q.shape[1] ** -0.5
    q = rounded(l2norm(q), on["q"] and not raw_out)
    k_out = l2norm(k) if raw_out else rounded(l2norm(k), on["k"])  # the key as the output kernel reads it
    k = rounded(l2norm(k), on["k"])
    state, outputs = h0.clone(), []
    for c0 in range(0, q.shape[0], CHUNK):
        rows = slice(c0, min(q.shape[0], c0 + CHUNK))
        qc, kc, vc, bc = q[rows], k[rows], v[rows], beta[rows]
        gc = g[rows].cumsum(0)
        decay = (gc[:, None] - gc[None, :]).clamp(max=0).exp()
        n = kc.shape[0]
        a = torch.tril(bc[:, None] * (kc @ kc.T) * decay, -1)
        t = rounded(torch.linalg.inv(torch.eye(n, dtype=a.dtype) + a), on["T"])
        w = rounded(t @ rounded((bc * gc.exp())[:, None] * kc, on["beta_k"]), on["wu"])
        if u_from_t_beta:
            u = rounded(rounded(t * bc[None, :], on["u_in"]) @ vc, on["wu"])
        else:
            u = rounded(t @ rounded(bc[:, None] * vc, on["u_in"]), on["wu"])
        s16 = rounded(state, on["h"])
        v_new = u - w @ s16
        att = torch.tril((qc @ k_out[rows].T) * decay)
        v16 = rounded(v_new, on["v_new"])
        outputs.append((gc.exp()[:, None] * (qc @ s16) + rounded(att, on["att"]) @ v16) * scale)
        state = state * gc[-1].exp() + kc.T @ rounded((gc[-1] - gc).exp()[:, None] * v_new, on["v_dec"])
    return torch.cat(outputs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--old", action="store_true", help="the form before (see above)")
    args = parser.parse_args()
    (q, k, v, g, beta, h0), _ = make_inputs([args.length], hk=1, hv=1, device="cpu", seed=args.seed)
    q, k, v, g, beta = (x.double()[:, 0] for x in (q, k, v, g, beta))
    inputs = (q, k, v, g, beta, h0.double()[0, 0])
    form = dict(u_from_t_beta=not args.old, raw_out=not args.old)
    exact = forward(*inputs, dict.fromkeys(POINTS, False), **form)

    def error(on):
        o = rounded(forward(*inputs, on, **form), True)  # the kernels store o in bf16
        return float((o - exact).norm() / exact.norm())
    every = dict.fromkeys(POINTS, True)
    print(f"{'old' if args.old else 'current'} form, {args.length} tokens: o's error against float64")
    print(f"  every point rounded        {error(every):.3e}")
    print(f"  only o's own rounding      {error(dict.fromkeys(POINTS, False)):.3e}")
    for point in POINTS:
        print(f"  all but {point:8s}           {error({**every, point: False}):.3e}")


if __name__ == "__main__":
    main()
