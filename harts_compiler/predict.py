"""What the fitted cost model predicts for one training step of a compiled plan: tree mode against trajectory-wise.

Tree mode runs the plan's microbatches (a tree in pieces runs each piece); trajectory-wise packs the same
trajectories first-fit decreasing into microbatches of the plan's budget, each trajectory its own sequence (what
`bench/e2e.py` times). Both are summed from the cost model's per-microbatch features, with the model's layer
counts. The ceiling is the speedup with every kernel as fast per token and per attention pair in tree mode as in
the baseline: token-proportional work shrinks by the token ratio, attention's by the pair ratio,
1 / ((1 - a) / token ratio + a / pair ratio) with a the attention pairs' share of the trajectory-wise step.
"""
from __future__ import annotations

from pathlib import Path

from harts_compiler.codegen.index import trajectory_index
from harts_compiler.codegen.pieces import PieceChain
from harts_compiler.passes import cost_model
from harts_compiler.passes.schedule import first_fit_decreasing


def plan_indices(plan) -> list:
    """The host index of each of the plan's microbatches (a PieceChain for a tree in pieces)."""
    return [mb.build_chain() if mb.runs_as_pieces else mb.build_index() for mb in plan.microbatches()]


def trajectory_microbatches(batch, budget: int, *, chunk_size: int, conv_width: int) -> list:
    """Trajectory-wise indices (host tables) of the batch: trajectories packed first-fit decreasing into <= budget
    tokens (a longer trajectory runs alone), each its own sequence from the zero state."""
    bins = first_fit_decreasing(batch.lengths.tolist(), budget)
    return [trajectory_index([batch.trajectory(j) for j in sorted(b)], [batch.ids[j] for j in sorted(b)],
                             chunk_size=chunk_size, conv_width=conv_width)
            for b in bins]


def forward_units(indices) -> list:
    """The microbatch indices one step runs a forward and backward for: a tree in pieces runs each piece."""
    return [p for i in indices for p in (i.indices if isinstance(i, PieceChain) else [i])]


def mode_terms(predictor, units, layers) -> dict:
    """The cost model's ms per term, summed over one mode's forward units (microbatch indices; pieces each)."""
    totals = dict.fromkeys(cost_model.TERMS, 0.0)
    for unit in units:
        for term, ms in predictor.terms(cost_model.features(unit), layers).items():
            totals[term] += ms
    return totals


def ceiling(token_ratio: float, pair_ratio: float, pair_share: float) -> float:
    """The speedup with tree-mode kernels exactly as fast per token and per attention pair as the baseline's."""
    return 1 / ((1 - pair_share) / token_ratio + pair_share / pair_ratio)


def pair_speed_needed(fraction: float, token_ratio: float, pair_ratio: float, pair_share: float) -> float:
    """How many times faster per pair than the baseline's attention tree mode's attention must run (everything
    else as fast per token as the baseline's) for the exact-tree ceiling to reach `fraction` of the token ratio;
    inf when no attention speed can (fraction >= 1 / (1 - pair_share)). Solves 1 / ((1 - a) / T + a / (P s)) =
    fraction * T for s."""
    room = 1 / fraction - (1 - pair_share)
    if room <= 0:
        return float("inf")
    return pair_share * token_ratio / (pair_ratio * room)


def predicted_step(plan, batch, config, predictor=None) -> dict:
    """{tree_ms, traj_ms, speedup, token_ratio, pair_ratio, pair_share, ceiling, cost_model, device} of one step
    of `plan` (compiled from `batch`) on a model of `config` (its layer types), by `predictor` (default: the
    fitted model shipped with the package)."""
    predictor = predictor or cost_model.load_cost_model()
    layers = cost_model.LayerCounts.of(config)
    lengths = batch.lengths.tolist()
    budget = max(plan.options.microbatch_tokens or sum(lengths), max(lengths, default=0))
    traj_indices = trajectory_microbatches(batch, budget, chunk_size=plan.options.chunk_size,
                                           conv_width=plan.options.conv_width)
    tree = mode_terms(predictor, forward_units(plan_indices(plan)), layers)
    traj = mode_terms(predictor, traj_indices, layers)
    tree_ms, traj_ms = sum(tree.values()), sum(traj.values())
    stats = plan.stats
    token_ratio = stats["trajectory_tokens"] / max(stats["compact_tokens"], 1)
    pair_ratio = stats["pair_compression"] or 1.0
    share = traj["full_pair"] / traj_ms if traj_ms > 0 else 0.0
    return dict(tree_ms=tree_ms, traj_ms=traj_ms, speedup=traj_ms / tree_ms if tree_ms > 0 else 0.0,
                token_ratio=token_ratio, pair_ratio=pair_ratio, pair_share=share,
                ceiling=ceiling(token_ratio, pair_ratio, share),
                cost_model=predictor.source, device=predictor.device)


def format_prediction(p: dict) -> str:
    """Two lines: the prediction, and what it holds for (the fitted model's layer widths; its ratio carries over
    better than its milliseconds)."""
    return (f"predicted step     tree {p['tree_ms']:,.0f} ms vs trajectory-wise {p['traj_ms']:,.0f} ms: "
            f"{p['speedup']:.2f}x (token ratio {p['token_ratio']:.2f}x; attention pairs, "
            f"{100 * p['pair_share']:.0f}% of the trajectory-wise step, shrink {p['pair_ratio']:.2f}x: ceiling "
            f"{p['ceiling']:.2f}x)\n"
            f"                   cost model fitted on {p['device']} with its benchmark model's layer widths "
            f"({Path(p['cost_model']).name}): the ratios carry over to other widths better than the milliseconds")
