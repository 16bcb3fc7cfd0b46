"""`harts verify`: run a compiled plan in tree mode and every trajectory on its own, and compare.

This is the project's correctness contract made executable (docs/design.md section 11): the same
per-trajectory log-probs, entropies, MoE statistics and parameter gradients, up to floating-point
reordering. The gradient check uses a fixed random weighting of log-probs and entropies (plus the
aux loss), i.e. an arbitrary token-level objective, so every parameter gets a non-trivial gradient.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

# Bars of docs/design.md section 11 per dtype: (log-prob/entropy max abs diff, gradient max rel diff).
# fp32 gradients carry ~1e-5 relative reordering noise on wide trees (measured up to 2.1e-5).
BARS = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 5e-5)}


@dataclasses.dataclass
class VerifyReport:
    trajectories: int
    trajectory_tokens: int
    compact_tokens: int
    microbatches: int
    rounds: int
    dtype: torch.dtype
    logprob_diff: float
    entropy_diff: float
    aux_diff: float | None  # None: no MoE, or not comparable (several microbatches, see below)
    expert_load_diff: float | None
    grad_rel_diff: float
    worst_param: str
    tree_seconds: float
    trajectory_seconds: float
    on_cpu: bool = True

    @property
    def bars(self) -> tuple[float, float]:
        return BARS.get(self.dtype, (1e-2, 5e-2))

    @property
    def passed(self) -> bool:
        value_bar, grad_bar = self.bars
        values = [self.logprob_diff, self.entropy_diff] + [d for d in (self.aux_diff, self.expert_load_diff)
                                                           if d is not None]
        return max(values) <= value_bar and self.grad_rel_diff <= grad_bar

    def format(self) -> str:
        value_bar, grad_bar = self.bars
        ok = lambda diff, bar: "ok" if diff <= bar else "MISSED"  # noqa: E731
        lines = [
            f"trajectories {self.trajectories}, trajectory tokens {self.trajectory_tokens}, "
            f"compact tokens {self.compact_tokens} (compression {self.trajectory_tokens / self.compact_tokens:.2f}x), "
            f"{self.microbatches} microbatch(es), up to {self.rounds} linear-attention round(s), {self.dtype}",
            f"  max |log-prob diff|       {self.logprob_diff:.3e}  (bar {value_bar:.0e}) "
            f"{ok(self.logprob_diff, value_bar)}",
            f"  max |entropy diff|        {self.entropy_diff:.3e}  (bar {value_bar:.0e}) "
            f"{ok(self.entropy_diff, value_bar)}",
        ]
        if self.aux_diff is not None:
            lines.append(f"  |aux-loss diff|           {self.aux_diff:.3e}  (bar {value_bar:.0e}) "
                         f"{ok(self.aux_diff, value_bar)}")
        if self.expert_load_diff is not None:
            lines.append(f"  max |expert-load diff|    {self.expert_load_diff:.3e}  (bar {value_bar:.0e}) "
                         f"{ok(self.expert_load_diff, value_bar)}")
        lines += [
            f"  max rel. gradient diff    {self.grad_rel_diff:.3e}  (bar {grad_bar:.0e}) "
            f"{ok(self.grad_rel_diff, grad_bar)}  worst: {self.worst_param}",
            f"  fwd+bwd wall time: tree {self.tree_seconds * 1e3:.0f} ms, trajectory-wise "
            f"{self.trajectory_seconds * 1e3:.0f} ms, ratio {self.trajectory_seconds / self.tree_seconds:.2f}x"
            + (" (CPU reference ops: per-call overhead, not token work, dominates a tiny model; speed is "
               "measured on the GPU, see BENCHMARKS.md)" if self.on_cpu else ""),
            "verified: tree mode equals trajectory-wise training" if self.passed else "VERIFY FAILED",
        ]
        return "\n".join(lines)


def _objective_weights(ids: list[str], max_len: int, seed: int, dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per trajectory, fixed random weights for its log-probs and entropies (independent of row order)."""
    out = {}
    for number, traj_id in enumerate(sorted(ids)):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + number)
        out[traj_id] = (torch.randn(max_len, generator=gen, dtype=torch.float64).to(dtype),
                        0.1 * torch.randn(max_len, generator=gen, dtype=torch.float64).to(dtype))
    return out


def _row_loss(out, weights, max_len: int):
    """Objective over one output: sum over rows of weighted log-probs and entropies."""
    loss = out.logprobs.new_zeros(())
    for row, traj_id in enumerate(out.trajectory_ids):
        w_lp, w_ent = weights[traj_id]
        width = out.logprobs.shape[1]
        loss = loss + (out.logprobs[row] * w_lp[:width].to(out.logprobs)).sum() \
            + (out.entropy[row] * w_ent[:width].to(out.entropy)).sum()
    return loss


def _gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def worst_gradient_difference(got: dict[str, torch.Tensor | None],
                              want: dict[str, torch.Tensor | None]) -> tuple[float, str]:
    """(largest relative L2 difference |got - want| / |want| over parameters, its name); a gradient
    present on one side only is infinitely different. Keys: parameter names; None = no gradient."""
    worst, diff = "-", 0.0
    for name in sorted(set(got) | set(want)):
        mine, ref = got.get(name), want.get(name)
        if mine is None or ref is None:
            if (mine is None) != (ref is None):
                return float("inf"), f"gradient present in one mode only: {name}"
            continue
        rel = float((mine - ref).norm() / ref.norm().clamp_min(1e-30))
        if rel > diff:
            worst, diff = name, rel
    return diff, worst


def verify_plan(model, batch, plan, *, seed: int = 0, activation_checkpointing: bool = False) -> VerifyReport:
    """Execute `plan` (compiled from `batch`) in tree mode and `batch` trajectory-wise; compare."""
    from harts_compiler.runtime import trajectory_wise
    from harts_compiler.runtime.distributed import assemble_rows
    from harts_compiler.runtime.trajectory import trajectory_token_lists

    dtype = model.lm_head.weight.dtype
    stats = plan.stats
    microbatches = plan.microbatches()
    token_lists, ids = trajectory_token_lists(batch)
    max_len = int(max(stats.get("max_trajectory_length", 0), max(len(t) for t in token_lists)))
    weights = _objective_weights(ids, max_len, seed, dtype)

    # warm-up (lazy imports, allocator, autograd machinery) so the timings below compare modes
    first = dict(zip(ids[:2], token_lists[:2]))
    trajectory_wise(model, first, chunk_size=plan.options.chunk_size).logprobs.sum().backward()

    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    outputs, expert_load, aux = [], None, None
    for mb in microbatches:  # backward per microbatch, as a trainer does
        out = model(mb, activation_checkpointing=activation_checkpointing)
        loss = _row_loss(out, weights, max_len)
        if out.aux_loss is not None and len(microbatches) == 1:
            aux = out.aux_loss.detach()
            loss = loss + out.aux_loss
        loss.backward()
        outputs.append(dataclasses.replace(out, logprobs=out.logprobs.detach(), entropy=out.entropy.detach()))
        if out.expert_load is not None:
            expert_load = out.expert_load if expert_load is None else expert_load + out.expert_load
    tree_seconds = time.perf_counter() - start
    tree_grads = _gradients(model)

    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    ref = trajectory_wise(model, batch, chunk_size=plan.options.chunk_size,
                          activation_checkpointing=activation_checkpointing)
    loss = _row_loss(ref, weights, max_len)
    if ref.aux_loss is not None and aux is not None:
        loss = loss + ref.aux_loss
    loss.backward()
    trajectory_seconds = time.perf_counter() - start
    ref_grads = _gradients(model)
    model.zero_grad(set_to_none=True)

    # the plan's rows (input order, split trees put together) against the reference's rows
    tree_lp, _ = assemble_rows(plan, outputs, "logprobs")
    tree_ent, _ = assemble_rows(plan, outputs, "entropy")
    order = {traj_id: row for row, traj_id in enumerate(plan.program.forest.traj_ids)}
    lp_diff = ent_diff = 0.0
    for row, traj_id in enumerate(ref.trajectory_ids):
        n, mine = int(ref.lengths[row]), order[traj_id]
        lp_diff = max(lp_diff, float((tree_lp[mine, :n] - ref.logprobs[row, :n].detach()).abs().max()))
        ent_diff = max(ent_diff, float((tree_ent[mine, :n] - ref.entropy[row, :n].detach()).abs().max()))

    grad_diff, worst = worst_gradient_difference(tree_grads, ref_grads)

    return VerifyReport(
        trajectories=len(ref.trajectory_ids), trajectory_tokens=int(stats["trajectory_tokens"]),
        compact_tokens=int(stats["compact_tokens"]), microbatches=len(microbatches),
        rounds=max((mb.summary()["rounds"] for mb in microbatches), default=0), dtype=dtype,
        logprob_diff=lp_diff, entropy_diff=ent_diff,
        aux_diff=None if aux is None else float((aux - ref.aux_loss.detach()).abs()),
        expert_load_diff=None if expert_load is None else float((expert_load - ref.expert_load).abs().max()),
        grad_rel_diff=grad_diff, worst_param=worst, tree_seconds=tree_seconds,
        trajectory_seconds=trajectory_seconds, on_cpu=model.lm_head.weight.device.type == "cpu")


DTYPES = {"float64": torch.float64, "float32": torch.float32}


def load_model(spec: str, dtype: torch.dtype, seed: int = 0):
    """A preset name (random weights) or a Hugging Face checkpoint directory."""
    from pathlib import Path

    from harts_compiler.runtime import PRESETS, TreeModel

    if spec in PRESETS:  # random weights under which every path (and every state hand-off) matters
        from harts_compiler.runtime.weights import randomise_for_verification_

        model = TreeModel.from_config(spec, seed=seed, dtype=torch.float64)
        return randomise_for_verification_(model, seed).to(dtype)
    if Path(spec).is_dir():
        return TreeModel.from_pretrained(spec).to(dtype)
    raise SystemExit(f"harts: --model {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) "
                     "nor a checkpoint directory")


def add_execution_arguments(parser: argparse.ArgumentParser, default_model: str = "tiny-qwen3-next") -> None:
    parser.add_argument("--model", default=default_model, help="preset name or HF checkpoint directory")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float64")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--microbatch-tokens", type=int, default=None)
    parser.add_argument("--checkpointing", action="store_true", help="activation recomputation per layer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def run_verification(batch, args) -> VerifyReport:
    from harts_compiler import CompileOptions, compile

    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, DTYPES[args.dtype], seed=args.seed)
    options = CompileOptions.for_model(model, chunk_size=args.chunk_size, microbatch_tokens=args.microbatch_tokens)
    plan = compile(batch, options)
    return verify_plan(model, batch, plan, seed=args.seed, activation_checkpointing=args.checkpointing)


def verify_main(argv: list[str]) -> int:
    from harts_compiler import TreeBatch

    parser = argparse.ArgumentParser(prog="harts verify", description=__doc__)
    parser.add_argument("input", help="JSONL batch (trajectories and/or trees)")
    add_execution_arguments(parser)
    args = parser.parse_args(argv)
    report = run_verification(TreeBatch.load(args.input), args)
    print(report.format())
    return 0 if report.passed else 1
