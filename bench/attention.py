"""Tree attention on the H200: correctness at realistic size, then forward and backward timings.

    python bench/attention.py                       # sweep, check, table: both shapes, every case
    python bench/attention.py --shapes gqa --no-flex --no-sweep --cases P4096,suffix
    python bench/attention.py --device cpu --tiny   # toy sizes on CPU (tests/test_benches_cpu.py)

Shapes: "gqa" = Qwen3-Next full attention (16 query heads, 2 KV heads, head dim 256); "mla" = Kimi
Linear's MLA (16 heads, q/k head dim 192 = 128 nope + 64 rope, v head dim 128), bf16. Cases: the
anchor trees (root P + B branches of L tokens), long trees (P32768 B8 L8192; a single 128k
trajectory; the largest full-length generated swe tree of at most 64k compact tokens), and the suffix
case: the P32768 root as context keys of an earlier microbatch, the 8 branches of 8192 as queries.

First (unless --no-sweep) every candidate launch shape of the shape's candidates (configs.CANDIDATES_256
/ CANDIDATES_MLA) is timed kernel by kernel on the first anchor and checked against the fp32 reference;
the fastest correct one per kernel makes the config of the rest of the run (printed; configs.py ships
it after review). The sweep tunes the Triton launches: a shape the Gluon kernels serve on this device
(head dim 256 on Hopper) runs its shipped Gluon launches without one.

Conventions (as before): "ideal" = trajectory attention pairs / tree attention pairs (visible pairs
only, queries of the suffix only); an anchor's "of ideal" = (anchor ms / ours ms) / ideal, which is
ours' TFLOP/s on the tree's pairs over the anchor's on the trajectories' pairs. Anchors run
trajectory by trajectory (one batch per distinct length): SDPA under its cuDNN backend, SDPA flash
(FA2), FlexAttention with a causal mask; plus FlexAttention with the tree mask over the compact
tokens. Suffix queries run against their trajectory's keys with a lower-right causal mask. TFLOP/s
count 2 flop per MAC over visible pairs: forward q k^T and p v, backward 5 matmuls (scores and dp
recomputed); "bwd" = fwd+bwd time minus fwd time. MLA anchors that want one head dim (flash) get v
padded with zeros to 192, counted in their time. The block lists are built on the host at every tile
the timed kernels use and uploaded once per case (as a launch plan carries them), outside the timed calls.
Errors (the first case and the first suffix case): ours, SDPA cuDNN and SDPA flash against one fp32 oracle of the
tree, on the same compact rows (bench/attention_errors.py says how the trajectories map onto them).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))  # fixtures, offline tools
from attention_errors import anchor_errors, error_table  # noqa: E402
from common import format_table, kernel_ms, rel_error, write_json  # noqa: E402
from harts_compiler.codegen.kernels.tree_attention import (  # noqa: E402
    build_block_index, config_for, tree_attention, tree_attention_fp32_oracle)
from harts_compiler.codegen.kernels.tree_attention.backward import bwd_delta, bwd_dkdv, bwd_dq  # noqa: E402
from harts_compiler.codegen.kernels.tree_attention.configs import CANDIDATES_256, CANDIDATES_MLA  # noqa: E402
from harts_compiler.codegen.kernels.tree_attention.forward import tree_attention_forward  # noqa: E402
from harts_compiler.codegen.kernels.tree_attention.function import hopper_launches  # noqa: E402
from harts_compiler.codegen.kernels.upload import to_device  # noqa: E402
from tree_layouts import TreeLayout, anchor_tree, layout_from_parents  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shape:
    hq: int
    hkv: int
    d: int     # q/k head dim
    dv: int    # v head dim


SHAPES = {"gqa": Shape(16, 2, 256, 256), "mla": Shape(16, 16, 192, 128)}
TINY_SHAPES = {"gqa": Shape(4, 2, 32, 32), "mla": Shape(2, 2, 48, 32)}
CANDIDATES = {"gqa": CANDIDATES_256, "mla": CANDIDATES_MLA}
ANCHORS = {"P4096 B8 L3584": (4096, 8, 3584), "P16384 B8 L2048": (16384, 8, 2048),
           "P2048 B16 L1920": (2048, 16, 1920), "P32768 B8 L8192": (32768, 8, 8192)}


def log(*parts):
    print(*parts, flush=True)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    layout: TreeLayout
    num_queries: int  # the last num_queries compact tokens query (all: the plain case)

    @property
    def offset(self) -> int:
        return self.layout.num_tokens - self.num_queries


def cases(tiny: bool) -> list[Case]:
    if tiny:
        anchor = anchor_tree(64, 3, 48)
        return [Case("P64 B3 L48", anchor, anchor.num_tokens),
                Case("single 256", layout_from_parents([-1], [256]), 256), Case("P64 ctx + B3 L48", anchor, 3 * 48)]
    out = [Case(name, anchor_tree(*shape), anchor_tree(*shape).num_tokens) for name, shape in ANCHORS.items()]
    out.append(Case("single 131072", layout_from_parents([-1], [131072]), 131072))
    generated = generated_layout(65536)
    if generated is not None:
        out.append(Case(f"generated swe {generated.num_tokens}", generated, generated.num_tokens))
    long_tree = anchor_tree(32768, 8, 8192)
    out.append(Case("P32768 ctx + B8 L8192", long_tree, 8 * 8192))
    return out


def generated_layout(budget: int) -> TreeLayout | None:
    """The full-length generated 'swe' tree (1 task, lengths unscaled) with the most rollouts that fits
    `budget` compact tokens (the preset's own rollout count first)."""
    try:
        from harts_compiler.generator import generate
        from harts_compiler.generator.presets import PRESETS
        for rollouts in range(PRESETS["swe"].rollouts, 0, -1):
            batch = generate("swe", seed=1, tasks=1, rollouts=rollouts)
            lengths = [len(tokens) for tokens in batch.node_tokens]
            if sum(lengths) <= budget:
                log(f"generated swe: {rollouts} rollouts, {sum(lengths)} compact tokens")
                return layout_from_parents(list(batch.node_parent), lengths, ends=[node for _, node in batch.ends])
        log(f"generated swe: no full-length tree within {budget} compact tokens")
    except Exception as exc:  # the generator is optional here: the other cases run without it
        log(f"generated batch unavailable: {exc!r}")
    return None


def pair_counts(case: Case) -> tuple[int, int]:
    """(trajectory pairs, tree pairs), counting only the query rows >= offset of each."""
    ends, offset = case.layout.subtree_end.astype(np.int64), case.offset
    tree = int(np.maximum(ends - np.maximum(np.arange(ends.size), offset), 0).sum())
    traj = 0
    for path in case.layout.paths:
        context = int((np.asarray(path) < offset).sum())  # preorder: a path's context rows are its prefix
        traj += len(path) * (len(path) + 1) // 2 - context * (context + 1) // 2
    return traj, tree


def flops(pairs: int, shape: Shape) -> tuple[float, float]:
    """(fwd, bwd) flop over `pairs` visible pairs: fwd q k^T + p v; bwd q k^T, do v^T, p^T do, ds k, ds^T q."""
    return 2.0 * pairs * shape.hq * (shape.d + shape.dv), 2.0 * pairs * shape.hq * (3 * shape.d + 2 * shape.dv)


def random_qkv(n_tokens, shape: Shape, seed, device, dtype):
    gen = torch.Generator(device=device).manual_seed(seed)
    make = lambda h, d: torch.randn(n_tokens, h, d, generator=gen, device=device).to(dtype)  # noqa: E731
    return make(shape.hq, shape.d), make(shape.hkv, shape.d), make(shape.hkv, shape.dv), make(shape.hq, shape.dv)


def device_block_index(subtree_end: torch.Tensor, tiles, num_queries: int):
    """The block lists at every (block_m, block_n) of `tiles`, built on the host, uploaded in one copy."""
    host_end = subtree_end.cpu().numpy()
    first, *rest = dict.fromkeys(tuple(tile) for tile in tiles)
    index = build_block_index(host_end, *first, num_queries=num_queries).with_tiles(host_end, rest)
    return to_device(index, subtree_end.device)


def fwd_and_total(forward, leaves, grad_out, device, rep):
    """(fwd ms, fwd+bwd ms) of `forward()` -> output, gradients of `leaves` under `grad_out`."""
    def fwd():
        return forward()

    def total():
        torch.autograd.grad(forward(), leaves, grad_out)
    return kernel_ms(fwd, device, rep_ms=rep), kernel_ms(total, device, rep_ms=rep)


# ---------------------------------------------------------------- trajectory-wise anchors
def trajectory_groups(case: Case, q, k, v, do, owned_only: bool = False):
    """Per distinct (length, context): (context, q / do rows past the context and k / v of the whole paths
    [B, H, L, D], the paths' compact indices [B, L], which of their query rows hold a token first [B, L - context]).
    owned_only: a query row's do only in the first path that holds its token, zero in the others (errors against
    the tree's oracle: bench/attention_errors.py)."""
    seen = np.zeros(case.layout.num_tokens, bool)
    groups = {}
    for path in case.layout.paths:
        context = int((np.asarray(path) < case.offset).sum())
        groups.setdefault((len(path), context), []).append((path, ~seen[path]))
        seen[path] = True
    out = []
    for (_, context), members in groups.items():
        index = torch.as_tensor(np.stack([path for path, _ in members]), device=q.device)
        owned = torch.as_tensor(np.stack([first for _, first in members])[:, context:], device=q.device)
        take = lambda x, rows: x[rows].transpose(1, 2).contiguous()  # noqa: E731
        g_do = take(do, index[:, context:])
        if owned_only:
            g_do = g_do * owned[:, None, :, None].to(g_do.dtype)
        out.append((context, take(q, index[:, context:]).requires_grad_(), take(k, index).requires_grad_(),
                    take(v, index).requires_grad_(), g_do, index, owned))
    return out


def sdpa_anchor(groups, backend, scale):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    import torch.nn.functional as F

    def call(context, q, k, v):
        kw = dict(is_causal=True) if context == 0 else dict(attn_mask=causal_lower_right(q.shape[2], k.shape[2]))
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=q.shape[1] != k.shape[1], **kw)

    def one(context, q, k, v):
        """Natively where the backend takes the shapes, else (one head dim, no GQA: flash on MLA) with v
        padded with zeros to q's head dim and K/V heads repeated, both counted in the time."""
        try:
            return call(context, q, k, v)
        except RuntimeError:
            group, value_dim = q.shape[1] // k.shape[1], v.shape[-1]
            if value_dim != q.shape[-1]:
                v = F.pad(v, (0, q.shape[-1] - value_dim))
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            return call(context, q, k, v)[..., :value_dim]
    return one


def flex_anchor(scale, device):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    compiled = torch.compile(flex_attention)
    masks = {}

    def one(context, q, k, v):
        key = (context, q.shape[2], k.shape[2])
        if key not in masks:
            masks[key] = create_block_mask(lambda b, h, qi, ki: ki <= qi + context, None, None, q.shape[2],
                                           k.shape[2], device=device)
        return compiled(q, k, v, block_mask=masks[key], scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return one


def time_anchor(one, groups, device, rep):
    leaves = [t for group in groups for t in group[1:4]]
    grad_out = [group[4] for group in groups]

    def forward():
        return [one(group[0], *group[1:4]) for group in groups]

    def total():
        torch.autograd.grad(forward(), leaves, grad_out)
    return kernel_ms(forward, device, rep_ms=rep), kernel_ms(total, device, rep_ms=rep)


def flex_tree(q, k, v, subtree_end, offset, scale, device):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + offset) & (q_idx + offset < subtree_end[kv_idx])
    block_mask = create_block_mask(mask_mod, None, None, q.shape[0], k.shape[0], device=device)
    compiled = torch.compile(flex_attention)
    leaves = [x.transpose(0, 1)[None].contiguous().requires_grad_() for x in (q, k, v)]
    return leaves, lambda: compiled(*leaves, block_mask=block_mask, scale=scale, enable_gqa=True)


# ---------------------------------------------------------------- launch-shape sweep
def sweep(case: Case, shape: Shape, name: str, device, dtype, rows: list):
    """Time every candidate launch shape per kernel; the fastest correct one (error within 1.25x of the
    shipped shape's) per kernel makes the returned config."""
    subtree_end = case.layout.subtree_end_tensor(device)
    q, k, v, do = random_qkv(case.layout.num_tokens, shape, 1, device, dtype)
    scale, shipped = shape.d ** -0.5, config_for(shape.d, shape.dv)
    candidates = CANDIDATES[name]
    jobs = [(kind, launch) for kind in ("fwd", "dq", "dkdv") for launch in candidates[kind]]
    tiles = [(launch["block_m"], launch["block_n"]) for launch in [shipped.fwd] + [launch for _, launch in jobs]]
    index = device_block_index(subtree_end, tiles, case.num_queries)
    ref = tree_attention_fp32_oracle(q, k, v, do, subtree_end, scale=scale, query_chunk=512)
    o, lse = tree_attention_forward(q, k, v, subtree_end, index, scale, shipped.fwd)
    delta = bwd_delta(o, do)
    best = {}
    for kind, launch in jobs:
        run = {"fwd": lambda: tree_attention_forward(q, k, v, subtree_end, index, scale, launch)[:1],
               "dq": lambda: [bwd_dq(q, k, v, do, lse, delta, subtree_end, index, scale, launch)],
               "dkdv": lambda: bwd_dkdv(q, k, v, do, lse, delta, subtree_end, index, scale, launch)}[kind]
        refs = {"fwd": ref[:1], "dq": ref[1:2], "dkdv": ref[2:]}[kind]
        try:
            errs = [rel_error(a, b) for a, b in zip(run(), refs)]
            ms = kernel_ms(run, device, rep_ms=200)
        except Exception as exc:
            errs, ms = [float("nan")], float("nan")
            log(f"{kind} {launch} failed: {exc!r}"[:300])
        rows.append(dict(shape=name, kind=kind, launch=launch, ms=ms, errors=errs))
        log(f"{name} {kind:5s} {launch} {ms:8.3f} ms err {' '.join(f'{e:.2e}' for e in errs)}")
        first = next(r["errors"] for r in rows if r["kind"] == kind and r["shape"] == name)
        if all(np.isfinite(e) and e <= 1.25 * f for e, f in zip(errs, first)) and ms < best.get(kind, (np.inf,))[0]:
            best[kind] = (ms, launch)
    chosen = dataclasses.replace(shipped, **{kind: best[kind][1] for kind in best})
    log(f"{name} chosen config: {chosen}")
    return chosen


# ---------------------------------------------------------------- one case
def run_case(case: Case, shape: Shape, config, args, device, dtype) -> dict:
    subtree_end = case.layout.subtree_end_tensor(device)
    q, k, v, do = random_qkv(case.layout.num_tokens, shape, 3, device, dtype)
    do[:case.offset] = 0  # the context rows do not query: no output, no gradient
    scale, offset, rep = shape.d ** -0.5, case.offset, args.rep
    traj_pairs, tree_pairs = pair_counts(case)
    start = time.time()
    index = device_block_index(subtree_end, config.tiles, case.num_queries) if device.type == "cuda" else None
    row = dict(case=case.name, compact=case.layout.num_tokens, queries=case.num_queries,
               traj=case.layout.trajectory_tokens, ideal=traj_pairs / tree_pairs, index_ms=(time.time() - start) * 1e3)
    leaves = [x.clone().requires_grad_() for x in (q[offset:], k, v)]
    row["ours_fwd"], total = fwd_and_total(
        lambda: tree_attention(*leaves, subtree_end, scale=scale, block_index=index, config=config),
        leaves, do[offset:], device, rep)
    row["ours_bwd"] = total - row["ours_fwd"]
    fwd_flop, bwd_flop = flops(tree_pairs, shape)
    row["ours_fwd_tflops"], row["ours_bwd_tflops"] = fwd_flop / row["ours_fwd"] / 1e9, bwd_flop / row["ours_bwd"] / 1e9
    groups = trajectory_groups(case, q, k, v, do)
    from torch.nn.attention import SDPBackend
    anchors = {"cudnn": lambda: sdpa_anchor(groups, SDPBackend.CUDNN_ATTENTION, scale),
               "flash": lambda: sdpa_anchor(groups, SDPBackend.FLASH_ATTENTION, scale)}
    if not args.no_flex:
        anchors["flex"] = lambda: flex_anchor(scale, device)
    for name, make in anchors.items():
        try:
            fwd, total = time_anchor(make(), groups, device, rep)
            row[f"{name}_fwd"], row[f"{name}_bwd"] = fwd, total - fwd
            for part in ("fwd", "bwd"):
                row[f"{name}_{part}_of_ideal"] = row[f"{name}_{part}"] / row[f"ours_{part}"] / row["ideal"]
        except Exception as exc:
            log(f"{name} failed on {case.name}: {exc!r}"[:300])
    if not args.no_flex:
        try:
            flex_leaves, flex_fwd = flex_tree(q[offset:], k, v, subtree_end, offset, scale, device)
            fwd, total = fwd_and_total(flex_fwd, flex_leaves, do[offset:].transpose(0, 1)[None].contiguous(),
                                       device, rep)
            row["flex_tree_fwd"], row["flex_tree_bwd"] = fwd, total - fwd
        except Exception as exc:
            log(f"flex tree failed on {case.name}: {exc!r}"[:300])
    return row


def check_errors(case: Case, shape: Shape, config, device, dtype) -> dict:
    """Ours and the SDPA anchors (cuDNN, flash) vs the fp32 reference on `case`, over the same compact rows (the
    output gradient of context rows zero; bench/attention_errors.py)."""
    from torch.nn.attention import SDPBackend
    subtree_end = case.layout.subtree_end_tensor(device)
    q, k, v, do = random_qkv(case.layout.num_tokens, shape, 2, device, dtype)
    scale, offset = shape.d ** -0.5, case.offset
    leaves = [x.clone().requires_grad_() for x in (q[offset:], k, v)]
    out = tree_attention(*leaves, subtree_end, scale=scale, config=config)
    ours = [out, *torch.autograd.grad(out, leaves, do[offset:])]
    ref = tree_attention_fp32_oracle(q[offset:], k, v, do[offset:], subtree_end, scale=scale, query_chunk=512)
    row = dict(case=case.name, ours=[rel_error(a, b) for a, b in zip(ours, ref)])
    groups = trajectory_groups(case, q, k, v, do, owned_only=True)
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            row[name] = anchor_errors(sdpa_anchor(groups, backend, scale), groups, ref, offset)
        except RuntimeError as exc:  # a backend this device or shape lacks
            log(f"{name} errors unavailable on {case.name}: {exc!r}"[:200])
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy shapes and cases (CPU check of the script)")
    parser.add_argument("--shapes", default="gqa,mla")
    parser.add_argument("--cases", help="comma-separated name prefixes of the cases to run (default all)")
    parser.add_argument("--no-sweep", action="store_true", help="use the shipped configs")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compiles take minutes)")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.rep = 300 if device.type == "cuda" else 1
    args.no_flex = args.no_flex or device.type != "cuda"
    args.no_sweep = args.no_sweep or device.type != "cuda"
    torch.manual_seed(0)
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    all_cases = cases(args.tiny)
    if args.cases:
        all_cases = [c for c in all_cases if any(c.name.startswith(p) for p in args.cases.split(","))]
    results = dict(sweep=[], errors={}, table={})
    for name in args.shapes.split(","):
        shape = (TINY_SHAPES if args.tiny else SHAPES)[name]
        config = config_for(shape.d, shape.dv)
        probe = torch.empty(0, 1, shape.d, device=device, dtype=dtype)
        gluon = hopper_launches(probe, probe.new_empty(0, 1, shape.dv), config)
        log(f"{name}: {'Gluon kernels (Hopper) ' + str(gluon) if gluon else 'Triton kernels'}")
        if not args.no_sweep and not gluon:  # the sweep tunes the Triton launches: here the Gluon kernels run
            config = sweep(all_cases[0], shape, name, device, dtype, results["sweep"])
        results["errors"][name] = [check_errors(c, shape, config, device, dtype) for c in all_cases[:1] + [
            c for c in all_cases if c.num_queries < c.layout.num_tokens][:1]]
        log(f"{name} errors vs fp32, same compact rows:\n{error_table(results['errors'][name])}")
        table = results["table"][name] = []
        for case in all_cases:
            table.append(run_case(case, shape, config, args, device, dtype))
            log(table[-1])
            if device.type == "cuda":
                torch.cuda.empty_cache()
        log(f"\n{name} {shape} config {config}")
        log(format_table(table, [("case", "case"), ("compact", "compact"), ("queries", "queries"),
                                 ("ideal", "ideal (pairs)"), ("ours_fwd", "ours fwd ms"), ("ours_bwd", "ours bwd ms"),
                                 ("ours_fwd_tflops", "fwd TFLOP/s"), ("ours_bwd_tflops", "bwd TFLOP/s"),
                                 ("cudnn_fwd", "cuDNN fwd ms"), ("cudnn_bwd", "cuDNN bwd ms"),
                                 ("cudnn_fwd_of_ideal", "fwd of ideal (cuDNN)"),
                                 ("cudnn_bwd_of_ideal", "bwd of ideal (cuDNN)"),
                                 ("flash_fwd_of_ideal", "fwd of ideal (flash)"),
                                 ("flash_bwd_of_ideal", "bwd of ideal (flash)"),
                                 ("flex_fwd_of_ideal", "fwd of ideal (Flex)"),
                                 ("flex_bwd_of_ideal", "bwd of ideal (Flex)"),
                                 ("flex_tree_fwd", "Flex tree fwd ms"), ("flex_tree_bwd", "Flex tree bwd ms")]))
    write_json("attention.json", results)


if __name__ == "__main__":
    sys.exit(main())
