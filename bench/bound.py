"""What tree mode can reach on a preset's batch, by the fitted cost model, without running the model (CPU, seconds).

"Ideal" in `bench/e2e.py` is the token ratio (trajectory tokens / distinct tokens). Attention's work is not in
that ratio: a token at depth d attends to d + 1 keys in both modes, so tree attention saves the pairs of the
shared prefixes only, and long branches keep most of their pairs. Two numbers per preset:
- ceiling: the speedup if every token-proportional cost of the trajectory-wise step shrank by the token ratio
  and its attention-pair cost by the pair ratio, 1 / ((1 - a) / token ratio + a / pair ratio), with a the pairs'
  share of the trajectory-wise step's predicted time. No exact tree mode beats it with kernels as fast per token
  and per pair as the baseline's;
- predicted: the cost model's tree and trajectory-wise step times (per-microbatch, per-round and replay costs
  included), whose held-out error is a few percent per step (more on the ratio of two steps);
- pair speed for 90%: how many times faster per pair than the baseline's the tree's attention would have to run
  for the ceiling to reach 90% of the token ratio (1.00x or less: the ceiling is there already).

    python bench/bound.py --presets swe tau2 --length-scale 1.0 --target-tokens 1000000 --microbatch-tokens 65536
    python bench/bound.py                                   # the default presets and sizes of bench/e2e.py
    python bench/bound.py --pair-cost-scale 0.78 ...        # what if attention's cost per pair were 0.78x
    python bench/bound.py --gpu H100 ...                    # the committed fit of another GPU than this one's

Takes bench/e2e.py's batch options (the others are ignored) and ``--pair-cost-scale F``: multiply the fitted
attention cost per pair by F in both modes (attention kernels faster or slower than those the model was fitted
on, before a refit).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import model_config  # noqa: E402
from e2e import parse_args, plan_preset, predicted_terms  # noqa: E402
from harts_compiler import predict  # noqa: E402
from harts_compiler.passes import cost_model  # noqa: E402


def bound_row(preset, config, predictor, args) -> dict:
    _, row, tree_indices, traj_indices, layers = plan_preset(preset, config, args)
    tree = predicted_terms(predictor, tree_indices, layers)
    traj = predicted_terms(predictor, traj_indices, layers)
    tree_ms, traj_ms = sum(tree.values()), sum(traj.values())
    pair_ratio, share = row["pair_compression"], traj["full_pair"] / traj_ms
    ceiling = predict.ceiling(row["ideal"], pair_ratio, share)
    return dict(preset=preset, ideal=row["ideal"], pair_ratio=pair_ratio, traj_pair_share=share, ceiling=ceiling,
                tree_ms=tree_ms, traj_ms=traj_ms, predicted=traj_ms / tree_ms,
                pair_speed_90=predict.pair_speed_needed(0.9, row["ideal"], pair_ratio, share))


def with_pair_cost_scaled(predictor: cost_model.CostModel, scale: float) -> cost_model.CostModel:
    """The cost model with its attention cost per pair multiplied by `scale` (both modes)."""
    coefficients = dict(predictor.coefficients, full_pair=predictor.coefficients["full_pair"] * scale)
    return dataclasses.replace(predictor, coefficients=coefficients)


def positive_float(text: str) -> float:
    value = float(text)  # argparse reports a ValueError as an invalid value
    if not value > 0:  # also nan
        raise argparse.ArgumentTypeError(f"needs a positive number, got {text}")
    return value


def bound_arguments(p) -> None:
    p.add_argument("--pair-cost-scale", type=positive_float, default=1.0, metavar="F",
                   help="multiply the fitted attention cost per pair by F in both modes (default 1)")
    p.add_argument("--gpu", choices=sorted(cost_model.COMMITTED_FITS),
                   help="read that GPU's committed fit (default: H200's; bound.py runs on the CPU)")


def main(argv=None) -> None:
    argv = list(argv if argv is not None else sys.argv[1:])
    args = parse_args(argv + ["--device", "cpu"], __doc__.split("\n")[0], bound_arguments)
    pair_scale = args.pair_cost_scale
    config = model_config(args.tiny, model=args.model)
    fit = cost_model.committed_fit_path(args.gpu) if args.gpu else None
    predictor = with_pair_cost_scaled(cost_model.load_cost_model(fit), pair_scale)
    print(f"cost model {predictor.source} ({predictor.device}); model {args.model}; attention cost per pair "
          f"x {pair_scale:g}")
    rows = [bound_row(preset, config, predictor, args) for preset in args.presets]
    print(f"\n{'preset':8s} {'tokens':>7s} {'pairs':>7s} {'pair share':>10s} {'ceiling':>17s} "
          f"{'predicted ms tree / traj':>25s} {'predicted':>17s} {'pair speed for 90%':>18s}")
    for r in rows:
        print(f"{r['preset']:8s} {r['ideal']:6.2f}x {r['pair_ratio']:6.2f}x {r['traj_pair_share']:10.0%} "
              f"{r['ceiling']:6.2f}x ({r['ceiling'] / r['ideal']:5.1%}) {r['tree_ms']:12.0f} / {r['traj_ms']:<10.0f} "
              f"{r['predicted']:6.2f}x ({r['predicted'] / r['ideal']:5.1%}) {r['pair_speed_90']:17.2f}x")


if __name__ == "__main__":
    main()
