"""Tree attention on the H200: correctness at realistic size, then fwd+bwd timings.

    python bench/attention.py            # sweep, check, table: SDPA (trajectories) / Flex / ours
    python bench/attention.py --no-flex  # skip FlexAttention (its compile takes a minute)
    python bench/attention.py --sdpa-backends  # SDPA per backend vs ours, anchors only

First every candidate launch shape of configs.CANDIDATES_256 is timed kernel by kernel on the
first anchor (and checked against the fp32 reference); the fastest correct one per kernel makes
the config used for the rest of the run (printed; configs.py ships it after review).

Shapes: Qwen3-Next full attention, 16 query heads, 2 KV heads, head dim 256, bf16. Cases: the
three anchor trees (ANCHORS: root P + B branches of L tokens) and, when the generator is
importable, one generated agentic (swe preset) tree of about 31k compact tokens. "ideal" = trajectory
attention pairs / tree attention pairs; "of ideal" = (SDPA ms / ours ms) / ideal. Two
baselines: SDPA forced to its flash backend (FA2 kernels) and SDPA as torch chooses (cuDNN attention
on the H200, about 1.6x faster at head dim 256: docs/tree_attention_kernels.md).

The block lists are built on the host at every tile the timed kernels use and uploaded once per case,
as a launch plan carries them (`device_block_index`), outside the timed calls.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))  # fixtures, offline tools
from common import kernel_ms  # noqa: E402
from harts_compiler.codegen.kernels.tree_attention import (  # noqa: E402
    build_block_index, config_for, tree_attention, tree_attention_fp32_oracle)
from harts_compiler.codegen.kernels.tree_attention.backward import bwd_delta, bwd_dkdv, bwd_dq  # noqa: E402
from harts_compiler.codegen.kernels.tree_attention.configs import CANDIDATES_256, KernelConfig  # noqa: E402
from harts_compiler.codegen.kernels.tree_attention.forward import tree_attention_forward  # noqa: E402
from harts_compiler.codegen.kernels.upload import to_device  # noqa: E402
from tree_layouts import TreeLayout, anchor_tree, layout_from_parents  # noqa: E402

HQ, HKV, D = 16, 2, 256
SCALE = D ** -0.5
ANCHORS = {"P4096 B8 L3584": (4096, 8, 3584), "P16384 B8 L2048": (16384, 8, 2048),
           "P2048 B16 L1920": (2048, 16, 1920)}


def log(*parts):
    print(*parts, flush=True)


def device_block_index(subtree_end: torch.Tensor, tiles):
    """The tree mask's block lists at every (block_m, block_n) of `tiles` (the first is the index's own),
    built on the host and uploaded to subtree_end's device in one copy."""
    host_end = subtree_end.cpu().numpy()
    first, *rest = dict.fromkeys(tuple(tile) for tile in tiles)
    return to_device(build_block_index(host_end, *first).with_tiles(host_end, rest), subtree_end.device)


def launch_tiles(launches) -> list[tuple[int, int]]:
    """The (block_m, block_n) tiles of kernel launches (configs.py dicts)."""
    return [(launch["block_m"], launch["block_n"]) for launch in launches]


def bench_ms(fn, rep=300):
    return kernel_ms(fn, torch.device("cuda"), rep_ms=rep, warmup_ms=50)


def generated_layout() -> TreeLayout | None:
    """One generated 'swe' rollout tree (1 task, lengths scaled by 0.25: ~31k compact tokens)."""
    try:
        from harts_compiler.generator import generate
        batch = generate("swe", seed=1, tasks=1, scale=0.25)
        lengths = [len(tokens) for tokens in batch.node_tokens]
        return layout_from_parents(list(batch.node_parent), lengths,
                                   ends=[node for _, node in batch.ends])
    except Exception as exc:  # the generator is optional here: the anchors run without it
        log(f"generated batch unavailable: {exc!r}")
        return None


def pair_counts(layout: TreeLayout):
    tree = int((layout.subtree_end - np.arange(layout.num_tokens)).sum())
    traj = int(sum(len(p) * (len(p) + 1) // 2 for p in layout.paths))
    return traj, tree


def random_qkv(n_tokens, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda h: torch.randn(n_tokens, h, D, generator=gen, device="cuda").bfloat16()
    return make(HQ), make(HKV), make(HKV), make(HQ)


def fp32_reference(q, k, v, do, subtree_end):
    return tree_attention_fp32_oracle(q, k, v, do, subtree_end, scale=SCALE, query_chunk=512)


def rel(a, b):
    return ((a.float() - b).norm() / b.norm()).item()


# ---------------------------------------------------------------- trajectory-wise SDPA baseline
def sdpa_fn(q, k, v, do, paths, expand_kv=False, backend="flash"):
    """fwd+bwd closure of SDPA flash causal over the trajectories (one batch when lengths agree).
    ``expand_kv``: K/V heads repeated to the query heads before timing (plain MHA flash, the
    gradient then has HQ heads; a trainer would add a reduction, not counted here)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    lengths = {len(p) for p in paths}
    groups = [paths] if len(lengths) == 1 else [[p] for p in paths]
    prepared = []
    for group in groups:
        index = torch.as_tensor(np.stack(group), device="cuda")            # [B, L]
        group = HQ // HKV if expand_kv else 1
        leaves = [x[index].repeat_interleave(1 if x is q else group, 2).transpose(1, 2)
                  .contiguous().requires_grad_() for x in (q, k, v)]
        prepared.append((leaves, do[index].transpose(1, 2).contiguous()))

    def run():
        for leaves, grad_out in prepared:
            if backend == "flash":
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    out = sdpa_gqa(*leaves)
            else:  # torch picks the backend
                out = sdpa_gqa(*leaves)
            torch.autograd.grad(out, leaves, grad_out)
    return run


def sdpa_backends(config):
    """SDPA fwd+bwd on the anchors under each backend (and torch's own choice), KV expanded to
    16 heads; plus ours again (run-to-run spread). Explains which baseline a table used."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "default": None}
    for name, shape in ANCHORS.items():
        layout = anchor_tree(*shape)
        subtree_end = layout.subtree_end_tensor("cuda")
        q, k, v, do = random_qkv(layout.num_tokens, 4)
        index = torch.as_tensor(np.stack(layout.paths), device="cuda")
        leaves = [x[index].repeat_interleave(1 if x is q else HQ // HKV, 2).transpose(1, 2)
                  .contiguous().requires_grad_() for x in (q, k, v)]
        grad_out = do[index].transpose(1, 2).contiguous()
        row = dict(case=name)
        for backend_name, backend in backends.items():
            def run():
                if backend is None:
                    out = torch.nn.functional.scaled_dot_product_attention(
                        *leaves, is_causal=True, scale=SCALE)
                else:
                    with sdpa_kernel(backend):
                        out = torch.nn.functional.scaled_dot_product_attention(
                            *leaves, is_causal=True, scale=SCALE)
                torch.autograd.grad(out, leaves, grad_out)
            try:
                row[backend_name] = round(bench_ms(run), 2)
            except Exception as exc:
                row[backend_name] = f"failed: {type(exc).__name__}"
        block_index = device_block_index(subtree_end, config.tiles)
        row["ours"] = round(bench_ms(ours_fn(q, k, v, do, subtree_end, block_index, config)), 2)
        log(json.dumps(row))


def sdpa_gqa(q, k, v):
    """Causal SDPA with GQA; [B, H, L, D]. Uses enable_gqa where the backend takes it, else
    repeats K/V heads (counted in the time, as a trajectory-wise trainer would do it)."""
    try:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                scale=SCALE, enable_gqa=True)
    except RuntimeError:
        group = q.shape[1] // k.shape[1]
        return torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=True,
            scale=SCALE)


def sdpa_errors(q, k, v, do, paths, max_paths=8):
    """SDPA flash (bf16) vs fp32 reference on whole trajectories (the baseline's own error)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    num, den = np.zeros(4), np.zeros(4)
    for path in paths[:max_paths]:
        index = torch.as_tensor(path, device="cuda")
        chain = torch.full((len(path),), len(path), dtype=torch.int32, device="cuda")
        ref = fp32_reference(q[index], k[index], v[index], do[index], chain)
        leaves = [x[index].transpose(0, 1)[None].requires_grad_() for x in (q, k, v)]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = sdpa_gqa(*leaves)
            grads = torch.autograd.grad(out, leaves, do[index].transpose(0, 1)[None])
        for slot, (a, b) in enumerate(zip([out, *grads], ref)):
            a = a[0].transpose(0, 1).float()
            num[slot] += (a - b).norm().item() ** 2
            den[slot] += b.norm().item() ** 2
    return np.sqrt(num / den).tolist()


# ---------------------------------------------------------------- FlexAttention anchor
def flex_fn(q, k, v, do, subtree_end):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    n_tokens = q.shape[0]

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx])

    block_mask = create_block_mask(mask_mod, 1, None, n_tokens, n_tokens, device="cuda")
    compiled = torch.compile(flex_attention)
    leaves = [x.transpose(0, 1)[None].contiguous().requires_grad_() for x in (q, k, v)]
    grad_out = do.transpose(0, 1)[None].contiguous()

    def run():
        out = compiled(*leaves, block_mask=block_mask, scale=SCALE, enable_gqa=True)
        torch.autograd.grad(out, leaves, grad_out)
    return run


# ---------------------------------------------------------------- ours
def ours_fn(q, k, v, do, subtree_end, index, config=None):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

    def run():
        out = tree_attention(*leaves, subtree_end, scale=SCALE, block_index=index, config=config)
        torch.autograd.grad(out, leaves, do)
    return run


def _compile_worker(jobs):
    """Compile kernels in a separate process (fills Triton's on-disk cache)."""
    n_tokens = 512  # same specialisation as the benchmark sizes (T % 16 == 0, aligned pointers)
    layout = anchor_tree(128, 3, 128)
    subtree_end = layout.subtree_end_tensor("cuda")
    q, k, v, do = random_qkv(n_tokens, 0)
    first = CANDIDATES_256["fwd"][0]
    index = device_block_index(subtree_end, launch_tiles([first] + [launch for _, launch in jobs]))
    o, lse = tree_attention_forward(q, k, v, subtree_end, index, SCALE, first)
    delta = bwd_delta(o, do)
    for kind, launch in jobs:
        try:
            if kind == "fwd":
                tree_attention_forward(q, k, v, subtree_end, index, SCALE, launch)
            elif kind == "dq":
                bwd_dq(q, k, v, do, lse, delta, subtree_end, index, SCALE, launch)
            else:
                bwd_dkdv(q, k, v, do, lse, delta, subtree_end, index, SCALE, launch)
        except Exception as exc:
            print(f"compile {kind} {launch}: {exc!r}", flush=True)
    torch.cuda.synchronize()
    return len(jobs)


def precompile(jobs, workers=8):
    start = time.time()
    chunks = [jobs[i::workers] for i in range(workers) if jobs[i::workers]]
    ctx = __import__("multiprocessing").get_context("spawn")
    with ProcessPoolExecutor(max_workers=len(chunks), mp_context=ctx) as pool:
        list(pool.map(_compile_worker, chunks))
    log(f"precompiled {len(jobs)} kernels in {time.time() - start:.1f}s")


def sweep(out_dir) -> KernelConfig:
    """Time every candidate launch shape per kernel on the first anchor; return the fastest
    correct one per kernel (error within 1.25x of the shipped shape's)."""
    layout = anchor_tree(*ANCHORS["P4096 B8 L3584"])
    subtree_end = layout.subtree_end_tensor("cuda")
    q, k, v, do = random_qkv(layout.num_tokens, 1)
    jobs = [(kind, launch) for kind in ("fwd", "dq", "dkdv") for launch in CANDIDATES_256[kind]]
    precompile(jobs)
    ref = fp32_reference(q, k, v, do, subtree_end)
    first = CANDIDATES_256["fwd"][0]
    index = device_block_index(subtree_end, launch_tiles([first] + [launch for _, launch in jobs]))
    o, lse = tree_attention_forward(q, k, v, subtree_end, index, SCALE, first)
    delta = bwd_delta(o, do)
    _, tree_pairs = pair_counts(layout)
    matmuls = {"fwd": 2, "dq": 3, "dkdv": 4}
    rows, best = [], {}
    for kind, launch in jobs:
        try:
            if kind == "fwd":
                run = lambda: tree_attention_forward(q, k, v, subtree_end, index, SCALE, launch)
                errs = [rel(run()[0], ref[0])]
            elif kind == "dq":
                run = lambda: bwd_dq(q, k, v, do, lse, delta, subtree_end, index, SCALE, launch)
                errs = [rel(run(), ref[1])]
            else:
                run = lambda: bwd_dkdv(q, k, v, do, lse, delta, subtree_end, index, SCALE, launch)
                dk, dv = run()
                errs = [rel(dk, ref[2]), rel(dv, ref[3])]
            ms = bench_ms(run, rep=200)
        except Exception as exc:
            errs, ms = [float("nan")], float("nan")
            log(f"{kind} {launch} failed: {exc!r}"[:300])
        tflops = matmuls[kind] * 2 * tree_pairs * HQ * D / ms / 1e9
        rows.append(dict(kind=kind, launch=launch, ms=ms, errors=errs, tflops=tflops))
        log(f"{kind:5s} {json.dumps(launch):80s} {ms:8.3f} ms {tflops:5.0f} TFLOP/s  "
            f"err {' '.join(f'{e:.2e}' for e in errs)}")
        first_err = next(r["errors"] for r in rows if r["kind"] == kind)
        correct = all(np.isfinite(e) and e <= 1.25 * f for e, f in zip(errs, first_err))
        if correct and np.isfinite(ms) and ms < best.get(kind, (float("inf"),))[0]:
            best[kind] = (ms, launch)
    with open(os.path.join(out_dir, "sweep.json"), "w") as handle:
        json.dump(rows, handle, indent=1)
    shipped = config_for(D)
    chosen = KernelConfig(**{kind: best[kind][1] if kind in best else getattr(shipped, kind)
                             for kind in ("fwd", "dq", "dkdv")})
    log(f"chosen config: {chosen}")
    return chosen


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-sweep", action="store_true", help="use the shipped config")
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--sdpa-backends", action="store_true",
                        help="only time SDPA per backend vs ours (shipped config)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    torch.manual_seed(0)
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    if args.sdpa_backends:
        return sdpa_backends(config_for(D))
    config = config_for(D) if args.no_sweep else sweep(args.out)
    precompile([("fwd", config.fwd), ("dq", config.dq), ("dkdv", config.dkdv)], workers=3)
    cases = {name: anchor_tree(*shape) for name, shape in ANCHORS.items()}
    generated = generated_layout()
    if generated is not None:
        cases["generated swe 1 task x0.25"] = generated
    results = {}
    # correctness at realistic size: first anchor, 32k compact tokens
    name = next(iter(cases))
    layout = cases[name]
    subtree_end = layout.subtree_end_tensor("cuda")
    q, k, v, do = random_qkv(layout.num_tokens, 2)
    index = device_block_index(subtree_end, config.tiles)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = tree_attention(*leaves, subtree_end, scale=SCALE, block_index=index, config=config)
    ours = [out, *torch.autograd.grad(out, leaves, do)]
    ref = fp32_reference(q, k, v, do, subtree_end)
    ours_err = [rel(a, b) for a, b in zip(ours, ref)]
    sdpa_err = sdpa_errors(q, k, v, do, layout.paths)
    log(f"errors vs fp32 on {name} (T={layout.num_tokens}): o dq dk dv")
    log("  ours        " + " ".join(f"{e:.2e}" for e in ours_err))
    log("  SDPA flash  " + " ".join(f"{e:.2e}" for e in sdpa_err))
    results["errors"] = dict(case=name, ours=ours_err, sdpa=sdpa_err)
    del ours, ref, leaves, out
    table = []
    for name, layout in cases.items():
        subtree_end = layout.subtree_end_tensor("cuda")
        q, k, v, do = random_qkv(layout.num_tokens, 3)
        traj_pairs, tree_pairs = pair_counts(layout)
        start = time.time()
        index = device_block_index(subtree_end, config.tiles)  # host build + one upload
        torch.cuda.synchronize()
        row = dict(case=name, compact=layout.num_tokens, traj=layout.trajectory_tokens,
                   ideal=traj_pairs / tree_pairs, index_ms=(time.time() - start) * 1e3)
        row["ours"] = bench_ms(ours_fn(q, k, v, do, subtree_end, index, config))
        row["sdpa_gqa"] = bench_ms(sdpa_fn(q, k, v, do, layout.paths, expand_kv=False))
        row["sdpa_mha"] = bench_ms(sdpa_fn(q, k, v, do, layout.paths, expand_kv=True))
        # the baseline is the faster of the two ways to run GQA through SDPA flash
        row["sdpa"] = min(row["sdpa_gqa"], row["sdpa_mha"])
        # torch's own backend choice (cuDNN attention on the H200)
        row["sdpa_default"] = bench_ms(sdpa_fn(q, k, v, do, layout.paths, expand_kv=True,
                                               backend=None))
        row["flex"] = float("nan")
        if not args.no_flex:
            try:
                row["flex"] = bench_ms(flex_fn(q, k, v, do, subtree_end))
            except Exception as exc:
                log(f"flex failed on {name}: {exc!r}"[:400])
        flops = 4 * tree_pairs * HQ * D * 3.5  # fwd 2 matmuls + bwd 5 matmuls, 2 flop/MAC
        row["ours_tflops"] = flops / row["ours"] / 1e9
        log(json.dumps(row))
        table.append(row)
        torch.cuda.empty_cache()
    results["table"] = table
    with open(os.path.join(args.out, "attention.json"), "w") as handle:
        json.dump(results, handle, indent=1)
    log(f"\nconfig: {config}")
    log("\n| case | compact | traj tokens | ideal (pairs) | SDPA flash ms (gqa / kv expanded) "
        "| SDPA default ms | Flex tree ms | ours ms | vs SDPA flash | of ideal "
        "| vs SDPA default | of ideal | vs Flex | ours TFLOP/s |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        speed = r["sdpa"] / r["ours"]
        speed_default = r["sdpa_default"] / r["ours"]
        log(f"| {r['case']} | {r['compact']} | {r['traj']} | {r['ideal']:.2f}x "
            f"| {r['sdpa_gqa']:.1f} / {r['sdpa_mha']:.1f} | {r['sdpa_default']:.1f} "
            f"| {r['flex']:.1f} | {r['ours']:.1f} | {speed:.2f}x | {speed / r['ideal']:.0%} "
            f"| {speed_default:.2f}x | {speed_default / r['ideal']:.0%} "
            f"| {r['flex'] / r['ours']:.2f}x | {r['ours_tflops']:.0f} |")


if __name__ == "__main__":
    sys.exit(main())
