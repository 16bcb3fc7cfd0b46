"""Chunked log-prob restoration vs dense log_softmax + gather on the GPU (fwd+bwd).

    python bench/logprobs.py                       # T=32768, V=151936, D=2048, bf16
    python bench/logprobs.py --tokens 8192 --chunks 2048 4096 --json out.json

Both variants produce per-trajectory log-probs *and* entropies and backpropagate a random
weighted sum of both into hidden and lm_head_weight (torch.autograd.grad, so no .grad buffers
linger). Reports median wall time (CUDA events), peak extra memory over the inputs, achieved
matmul TFLOP/s (chunked: 4 matmuls of 2*T*V*D — logits, recomputed logits, d hidden, d weight;
dense: 3) and the max difference of the outputs to the dense variant.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from harts_compiler.codegen import trajectory_index
from harts_compiler.runtime.ops.logprobs import token_logprobs
from harts_compiler.runtime.ops.logprobs_reference import dense_token_logprobs


def measure(fn, hidden, weight, grads, repeats):
    """(median ms fwd+bwd, median ms fwd, peak extra bytes, outputs) of one variant."""
    def step():
        logprobs, entropy = fn(hidden, weight)
        loss = (logprobs * grads[0]).sum() + (entropy * grads[1]).sum()
        return logprobs, entropy, torch.autograd.grad(loss, (hidden, weight))

    outputs = step()  # warm-up, and the outputs for the accuracy check
    outputs = tuple(o.detach() for o in outputs[:2]) + tuple(outputs[2])
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    times = {"fwd+bwd": [], "fwd": []}
    for _ in range(repeats):
        for kind in times:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if kind == "fwd":
                with torch.no_grad():
                    fn(hidden, weight)
            else:
                step()
            end.record()
            torch.cuda.synchronize()
            times[kind].append(start.elapsed_time(end))
    return statistics.median(times["fwd+bwd"]), statistics.median(times["fwd"]), peak, outputs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--chunks", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-dense", action="store_true")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/logprobs.py needs CUDA")

    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    T, V, D = args.tokens, args.vocab, args.dim
    per_traj = T // args.trajectories
    lengths = [per_traj] * (args.trajectories - 1) + [T - per_traj * (args.trajectories - 1)]
    token_lists = [torch.randint(0, V, (n,)).tolist() for n in lengths]
    index = trajectory_index(token_lists, device=device)
    hidden = torch.randn(T, D, device=device, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, D, device=device, dtype=dtype) * D ** -0.5).requires_grad_()
    grads = [torch.randn(index.row_target.shape, device=device) for _ in range(2)]
    flops_per_matmul = 2 * T * V * D

    variants = [(f"chunked c={c}", 4, lambda h, w, c=c: token_logprobs(h, w, index, chunk_tokens=c))
                for c in args.chunks]
    # the same op with its element-wise work in plain torch instead of the Triton kernels
    variants.append((f"torch-ew c={args.chunks[0]}", 4,
                     lambda h, w: token_logprobs(h, w, index, chunk_tokens=args.chunks[0], use_triton=False)))
    if not args.skip_dense:
        variants.append(("dense", 3, lambda h, w: dense_token_logprobs(h, w, index)))
    print(f"T={T} V={V} D={D} bf16, {args.trajectories} trajectories, GPU {torch.cuda.get_device_name()}")
    print(f"{'variant':<18}{'fwd+bwd ms':>12}{'fwd ms':>10}{'peak GiB':>10}{'TFLOP/s':>10}"
          f"{'|dlp|':>10}{'|dH|':>10}{'|dgh| rel':>11}{'|dgw| rel':>11}")
    results, reference = [], None
    for name, n_matmuls, fn in reversed(variants):  # dense first: it is the accuracy reference
        try:
            total_ms, fwd_ms, peak, outputs = measure(fn, hidden, weight, grads, args.repeats)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            print(f"{name:<18}{'OOM':>12}")
            results.append({"variant": name, "oom": True})
            continue
        if reference is None:
            reference = outputs
        diffs = [(o.float() - r.float()).abs().max().item() for o, r in zip(outputs, reference)]
        for i in (2, 3):  # gradients relative to their scale
            diffs[i] /= reference[i].float().abs().max().item()
        tflops = n_matmuls * flops_per_matmul / (total_ms * 1e-3) / 1e12
        row = {"variant": name, "fwd_bwd_ms": total_ms, "fwd_ms": fwd_ms, "peak_gib": peak / 2 ** 30,
               "tflops": tflops, "max_diff_logprobs": diffs[0], "max_diff_entropy": diffs[1],
               "rel_diff_grad_hidden": diffs[2], "rel_diff_grad_weight": diffs[3]}
        results.append(row)
        print(f"{name:<18}{total_ms:>12.1f}{fwd_ms:>10.1f}{peak / 2 ** 30:>10.2f}{tflops:>10.0f}"
              f"{diffs[0]:>10.2e}{diffs[1]:>10.2e}{diffs[2]:>11.2e}{diffs[3]:>11.2e}")
        del outputs
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"T": T, "V": V, "D": D, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
