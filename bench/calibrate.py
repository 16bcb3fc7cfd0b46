"""Fit the planner's microbatch cost model (passes/cost_model.py) from measured fwd+bwd times.

    PYTHONUNBUFFERED=1 python bench/calibrate.py                  # H200, ~1-2 minutes
    python bench/calibrate.py --write passes/cost_model_h200.json # also update the repo's fit for this GPU
                                                                  # (passes/cost_model_h100.json on an H100)
    python bench/calibrate.py --device cpu --tiny                 # toy size (CI smoke test)

Microbatches of varied shapes come from generated batches (presets swe/tau2/grpo at several
length scales and token budgets): the planner's tree-mode microbatches and trajectory-wise packs
of the same batches, so the fit covers both modes (1 to many rounds, few long or many short
sequences, 2k-32k tokens). `--shapes` of them, spread evenly over their token counts, are timed
(median of `--repeat` fwd+bwd after `--warmup`, activation recomputation on, bf16) on three
models with the benchmark model's layer shapes (common.BENCH_MODEL) but few layers -- [GDN, attn],
[GDN x3, attn], [GDN, attn x2] -- so the per-layer-kind terms and the head term are separately
identifiable and the fit extrapolates to any layer counts of those shapes.

The shapes are split at random (`--holdout` of them, all three models' measurements of a held-out
shape together) into a training set, fitted by non-negative least squares on relative error,
and a held-out set; the median and max relative error of predicted vs measured time are printed
for both. The JSON written (to $OUT/cost_model_<device>.json when OUT is set, and to --write)
holds the coefficients of that training fit, the device, the date, the errors and every
measurement (features and times) so it can be refitted.
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (Step, build_model, describe_device, format_table, median,  # noqa: E402
                    finish_args, model_config, plan_microbatches, sized_batch, time_calls,
                    trajectory_microbatches, write_json)

from harts_compiler.passes import cost_model as cm  # noqa: E402
from harts_compiler.codegen.pieces import PieceChain  # noqa: E402

LIN, FULL = "linear_attention", "full_attention"
VARIANTS = [[LIN, FULL], [LIN, LIN, LIN, FULL], [LIN, FULL, FULL]]
# (preset, trajectory tokens, length scale, token budget, generator overrides)
# The full-length batches give 65k-token microbatches and trees in pieces, whose attention runs over long carried
# contexts: the end-to-end benchmark's full-length steps are made of those.
GPU_BATCHES = [("swe", 60_000, 0.05, 4096, {}), ("swe", 100_000, 0.1, 16384, {}),
               ("tau2", 50_000, 0.25, 16384, {}), ("tau2", 130_000, 0.5, 32768, {}),
               ("grpo", 40_000, 1.0, 8192, {}), ("grpo", 100_000, 1.0, 32768, {}),
               ("swe", 1_000_000, 1.0, 65536, {}), ("tau2", 1_000_000, 1.0, 65536, {})]
TINY_BATCHES = [("swe", 300, 0.005, 64, dict(turns=(2, 5), rollouts=4)),
                ("tau2", 400, 0.01, 256, dict(turns=(2, 3), rollouts=4)),
                ("grpo", 300, 0.02, 128, dict(rollouts=4))]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="toy model and batches (CPU smoke test)")
    p.add_argument("--shapes", type=int, help="microbatch shapes to time (default 28; tiny 8)")
    p.add_argument("--holdout", type=float, default=0.25, help="fraction of shapes held out")
    p.add_argument("--warmup", type=int, help="untimed runs per shape (default 1; tiny 0)")
    p.add_argument("--repeat", type=int, help="timed runs per shape (default 3; tiny 1)")
    p.add_argument("--chunk-size", type=int, help="linear-attention chunk (default 64; tiny 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write", help="also write the fitted model JSON here (passes/cost_model_h200.json on an H200)")
    args = p.parse_args(argv)
    if not 0 < args.holdout < 1:
        p.error("--holdout: must lie in (0, 1)")
    finish_args(p, args, dict(shapes=(8, 28), warmup=(0, 1), repeat=(1, 3), chunk_size=(16, 64)))
    return args


def collect_shapes(args, vocab_size: int, conv_width: int):
    """[(label, MicrobatchIndex or PieceChain)]: every tree in pieces (timed whole, its pieces' features summed)
    and whole microbatches spread evenly over compact tokens, `--shapes` in all (host tables; `Step` lowers and
    uploads each once, before it is timed)."""
    shape = dict(chunk_size=args.chunk_size, conv_width=conv_width)
    shapes, chains = [], []
    for preset, tokens, scale, budget, overrides in (TINY_BATCHES if args.tiny else GPU_BATCHES):
        batch, _ = sized_batch(preset, tokens, length_scale=scale, vocab_size=vocab_size,
                               seed=args.seed, **overrides)
        _, tree, *_ = plan_microbatches(batch, budget, args.device, vocab_size=vocab_size, **shape)
        traj = trajectory_microbatches(batch, budget, **shape)
        chains += [(f"{preset}/pieces/{budget}", i) for i in tree if isinstance(i, PieceChain)]
        shapes += [(f"{preset}/tree/{budget}", i) for i in tree if not isinstance(i, PieceChain)]
        shapes += [(f"{preset}/traj/{budget}", i) for i in traj]
    shapes.sort(key=lambda s: s[1].num_tokens)
    wanted = max(args.shapes - len(chains), 1)
    pick = np.unique(np.linspace(0, len(shapes) - 1, min(wanted, len(shapes))).round().astype(int))
    return sorted([shapes[k] for k in pick] + chains, key=lambda s: cm.features(s[1]).compact_tokens)


def measure(args, shapes) -> list[dict]:
    rows = []
    for layer_types in VARIANTS:
        config = model_config(args.tiny, layer_types)
        model = build_model(config, args.device, torch.bfloat16, seed=args.seed, checkpointing=True)
        layers = cm.LayerCounts.of(config)
        for shape_id, (label, index) in enumerate(shapes):
            feats = cm.features(index)
            step = Step(model, [index], feats.trajectory_tokens)
            ms = median(time_calls(step, args.device, warmup=args.warmup, repeat=args.repeat))
            rows.append({"shape": shape_id, "label": label, "layers": f"{layers.linear}L+{layers.full}F",
                         "linear_layers": layers.linear, "full_layers": layers.full, "ms": ms,
                         **feats.as_dict()})
        print(f"  model {layers.linear} GDN + {layers.full} attention layers: {len(shapes)} shapes "
              f"timed", flush=True)
        del model
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def split_rows(rows):
    feats = [cm.MicrobatchFeatures(**{n: r[n] for n in cm.FEATURE_NAMES}) for r in rows]
    layers = [cm.LayerCounts(r["linear_layers"], r["full_layers"]) for r in rows]
    return feats, layers, [r["ms"] for r in rows]


def error_summary(model, rows) -> dict:
    if not rows:
        return {"count": 0, "median_rel_err": None, "max_rel_err": None}
    feats, layers, times = split_rows(rows)
    errors = cm.relative_errors(model, feats, layers, times)
    for row, f, l, err in zip(rows, feats, layers, errors):
        row["predicted_ms"], row["rel_err"] = model.predict(f, l), float(err)
    return {"count": len(rows), "median_rel_err": float(np.median(errors)), "max_rel_err": float(errors.max())}


def main(argv=None) -> int:
    start = time.perf_counter()
    args = parse_args(argv)
    info = describe_device(args.device)
    base = model_config(args.tiny)
    shapes = collect_shapes(args, base.vocab_size, base.linear_conv_kernel_dim)
    tokens = [cm.features(index).compact_tokens for _, index in shapes]
    chains = sum(isinstance(index, PieceChain) for _, index in shapes)
    print(f"device {info}\n{len(shapes)} microbatch shapes ({chains} trees in pieces), {tokens[0]}-{tokens[-1]} "
          f"compact tokens; models {VARIANTS}", flush=True)
    rows = measure(args, shapes)
    rng = np.random.default_rng(args.seed)
    held = set(rng.permutation(len(shapes))[:max(1, round(args.holdout * len(shapes)))].tolist())
    train = [r for r in rows if r["shape"] not in held]
    test = [r for r in rows if r["shape"] in held]
    described = {"layer_shapes": "common.TINY_MODEL" if args.tiny else "common.BENCH_MODEL",
                 "variants": [" ".join(v) for v in VARIANTS], "dtype": "bfloat16",
                 "activation_checkpointing": True, "chunk_size": args.chunk_size,
                 "hidden_size": base.hidden_size, "vocab_size": base.vocab_size}
    fitted = cm.fit_cost_model(*split_rows(train), device=info.get("name", str(args.device)),
                               model=described, date=info["date"][:10])
    fit = {"train": error_summary(fitted, train), "held_out": error_summary(fitted, test)}
    fitted = cm.CostModel(coefficients=fitted.coefficients, device=fitted.device, date=fitted.date,
                          source="bench/calibrate.py", model=described,
                          fit={"median_rel_err": fit["held_out"]["median_rel_err"],
                               "max_rel_err": fit["held_out"]["max_rel_err"], **fit,
                               "measurements": rows})
    print("\nheld-out microbatches (predicted vs measured):")
    print(format_table(test, [("label", "shape"), ("layers", "layers"), ("compact_tokens", "tokens"),
                              ("rounds", "rounds"), ("sequences", "seqs"), ("ms", "measured ms"),
                              ("predicted_ms", "predicted ms"), ("rel_err", "rel err")]))
    print("\ncoefficients (ms per unit):")
    for term, value in fitted.coefficients.items():
        print(f"  {term:20s} {value:.4g}")
    for name in ("train", "held_out"):
        s = fit[name]
        print(f"{name:9s}: {s['count']} measurements, median relative error "
              f"{s['median_rel_err']:.1%}, max {s['max_rel_err']:.1%}")
    tag = re.sub(r"[^a-z0-9]+", "_", str(info.get("name", args.device)).lower())
    tag = "h200" if "h200" in tag else tag.strip("_") or "cpu"
    for path in write_json(f"cost_model_{tag}.json", fitted.to_json(), args.write):
        print(f"wrote {path}")
    print(f"total wall time {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
