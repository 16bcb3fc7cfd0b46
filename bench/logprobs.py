"""Chunked log-prob restoration vs dense log_softmax + gather on the GPU (fwd+bwd).

    python bench/logprobs.py                       # T=32768, V=151936, D=2048, bf16
    python bench/logprobs.py --tokens 8192 --chunks 2048 4096 --json out.json
    python bench/logprobs.py --tree 4096 8 3584     # one root of 4096 tokens, 8 branches of 3584

Both variants produce per-trajectory log-probs *and* entropies and backpropagate a random
weighted sum of both into hidden and lm_head_weight (torch.autograd.grad, so no .grad buffers
linger). Reports median wall time (host clock around a full sync), peak extra memory over the inputs, achieved
matmul TFLOP/s (chunked: 4 matmuls of 2*T*V*D — logits, recomputed logits, d hidden, d weight;
dense: 3) and the max difference of the outputs to the dense variant.

With ``--tree P B L`` the batch is one compiled tree (harts_compiler.compile +
build_microbatch_index): the op runs on the P + B*L compact tokens, against the same op and the
dense variant on the B trajectories of P + L tokens each (trajectory hidden states gathered from
the compact ones, so the log-probs must agree; gradient columns are then not comparable: n/a).
"""
from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import numpy as np
import torch

from common import median, peak_memory, time_calls
from harts_compiler.codegen import trajectory_index
from harts_compiler.codegen.kernels.logprobs import dense_token_logprobs, target_plan_of, token_logprobs
from harts_compiler.codegen.kernels.upload import to_device


def measure(fn, hidden, weight, grads, repeats):
    """(median ms fwd+bwd, median ms fwd, peak extra bytes, outputs) of one variant."""
    device = hidden.device

    def step():
        logprobs, entropy = fn(hidden, weight)
        loss = (logprobs * grads[0]).sum() + (entropy * grads[1]).sum()
        return logprobs, entropy, torch.autograd.grad(loss, (hidden, weight))

    def forward():
        with torch.no_grad():
            fn(hidden, weight)

    outputs = step()  # warm-up, and the outputs for the accuracy check
    outputs = tuple(o.detach() for o in outputs[:2]) + tuple(outputs[2])
    with peak_memory(device) as memory:
        step()
    peak = float("nan") if memory["gib"] is None else memory["gib"] * 2**30
    # host timing around a full sync: launch gaps count, as they do in training
    total = time_calls(step, device, warmup=0, repeat=repeats)
    forward_only = time_calls(forward, device, warmup=0, repeat=repeats)
    return median(total), median(forward_only), peak, outputs


def tree_case(prefix, branches, branch_length, vocab):
    """(tree index, trajectory-wise index, compact -> trajectory token map) of one compiled tree, host tables."""
    import harts_compiler as hc

    root = torch.randint(0, vocab, (prefix,)).tolist()
    token_lists = [root + torch.randint(0, vocab, (branch_length,)).tolist() for _ in range(branches)]
    ids = [f"b{j}" for j in range(branches)]
    plan = hc.compile(hc.TreeBatch.from_trajectories(token_lists, ids), hc.CompileOptions())
    (microbatch,) = plan.microbatches()
    tree = microbatch.build_index()
    rows = [token_lists[ids.index(t)] for t in tree.trajectory_ids]
    # trajectory token p has the hidden state of the compact token predicting p + 1; a row's last
    # token predicts nothing, so any compact token will do there (its logits are never read)
    source = np.concatenate([np.concatenate([tree.row_pred[r, 1:len(t)], tree.row_pred[r, 1:2]])
                             for r, t in enumerate(rows)])
    return tree, trajectory_index(rows), torch.as_tensor(source)


def targets_on(index, vocab: int, chunk_tokens: int, device):
    """The device TargetPlan of host index tables (for the Triton path on CUDA, as the runtime lowers it): planned
    and uploaded once, outside the timed calls."""
    return to_device(target_plan_of(index, vocab, chunk_tokens, triton=torch.device(device).type == "cuda"), device)


def dense_tables(index, device) -> SimpleNamespace:
    """The index tables the dense variant reads, on the device once (it would copy host tables every call)."""
    return SimpleNamespace(**{name: torch.as_tensor(getattr(index, name), device=device)
                              for name in ("row_pred", "row_target", "target_token")})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--chunks", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-dense", action="store_true")
    parser.add_argument("--tree", type=int, nargs=3, metavar=("P", "B", "L"), default=None,
                        help="one tree: root of P tokens, B branches of L tokens (overrides --tokens)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script only "
                        "(fp32, Triton under TRITON_INTERPRET=1; use tiny sizes)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/logprobs.py needs CUDA (or --device cpu for a smoke test)")

    torch.manual_seed(0)
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    V, D = args.vocab, args.dim
    if args.tree is None:
        T = args.tokens
        per_traj = T // args.trajectories
        lengths = [per_traj] * (args.trajectories - 1) + [T - per_traj * (args.trajectories - 1)]
        index = trajectory_index([torch.randint(0, V, (n,)).tolist() for n in lengths])
        hidden = torch.randn(T, D, device=device, dtype=dtype).requires_grad_()
        traj_index, traj_hidden = index, hidden
        shape = f"{args.trajectories} trajectories"
    else:
        index, traj_index, source = tree_case(*args.tree, V)
        T = index.num_tokens
        hidden = torch.randn(T, D, device=device, dtype=dtype).requires_grad_()
        traj_hidden = hidden.detach()[source.to(device)].requires_grad_()
        shape = (f"tree P={args.tree[0]} B={args.tree[1]} L={args.tree[2]}: {T} compact tokens, "
                 f"{traj_hidden.shape[0]} trajectory tokens")
    weight = (torch.randn(V, D, device=device, dtype=dtype) * D ** -0.5).requires_grad_()
    grads = [torch.randn(index.row_target.shape, device=device) for _ in range(2)]

    # (name, rows through the 2*V*D matmuls, fn(hidden, weight), the hidden leaf it takes)
    # (each chunked variant reads a TargetPlan of its chunk size, planned once: chunk_tokens is part of it)
    c0 = args.chunks[0]
    plans = {c: targets_on(index, V, c, device) for c in args.chunks}
    variants = [(f"chunked c={c}", 4 * T, lambda h, w, c=c: token_logprobs(h, w, plans[c]), hidden)
                for c in args.chunks]
    # the same op with its element-wise work in plain torch instead of the Triton kernels
    variants.append((f"torch-ew c={c0}", 4 * T,
                     lambda h, w: token_logprobs(h, w, plans[c0], use_triton=False), hidden))
    n_traj = traj_hidden.shape[0]
    if args.tree is not None:
        traj_plan = targets_on(traj_index, V, c0, device)
        variants.append((f"traj chunked c={c0}", 4 * n_traj,
                         lambda h, w: token_logprobs(h, w, traj_plan), traj_hidden))
    if not args.skip_dense:
        dense_index = dense_tables(traj_index, device)
        variants.append(("dense" if args.tree is None else "traj dense", 3 * n_traj,
                         lambda h, w: dense_token_logprobs(h, w, dense_index), traj_hidden))
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU smoke test"
    print(f"T={T} V={V} D={D} {str(dtype)[6:]}, {shape}, {where}")
    print(f"{'variant':<22}{'fwd+bwd ms':>12}{'fwd ms':>10}{'peak GiB':>10}{'TFLOP/s':>10}"
          f"{'|dlp|':>10}{'|dH|':>10}{'|dgh| rel':>11}{'|dgw| rel':>11}")
    results, reference = [], None
    for name, matmul_rows, fn, leaf in reversed(variants):  # dense first: the accuracy reference
        try:
            total_ms, fwd_ms, peak, outputs = measure(fn, leaf, weight, grads, args.repeats)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            print(f"{name:<22}{'OOM':>12}")
            results.append({"variant": name, "oom": True})
            continue
        if reference is None:
            reference = outputs
        # max |difference| (gradients: relative to their scale); n/a (nan) for grad hidden across
        # tree and trajectory mode, whose hidden states are different tensors
        diffs = [(o.float() - r.float()).abs().max().item() if o.shape == r.shape else float("nan")
                 for o, r in zip(outputs, reference)]
        for i in (2, 3):
            diffs[i] /= reference[i].float().abs().max().item()
        tflops = matmul_rows * 2 * V * D / (total_ms * 1e-3) / 1e12
        row = {"variant": name, "fwd_bwd_ms": total_ms, "fwd_ms": fwd_ms, "peak_gib": peak / 2 ** 30,
               "tflops": tflops, "max_diff_logprobs": diffs[0], "max_diff_entropy": diffs[1],
               "rel_diff_grad_hidden": diffs[2], "rel_diff_grad_weight": diffs[3]}
        results.append(row)
        print(f"{name:<22}{total_ms:>12.1f}{fwd_ms:>10.1f}{peak / 2 ** 30:>10.2f}{tflops:>10.0f}"
              f"{diffs[0]:>10.2e}{diffs[1]:>10.2e}{diffs[2]:>11.2e}{diffs[3]:>11.2e}")
        del outputs
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"T": T, "V": V, "D": D, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
