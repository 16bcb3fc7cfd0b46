"""End-to-end benchmark: one training step's forward + backward + gradients (no optimizer step)
in tree mode vs trajectory-wise mode, on generated agentic rollout batches.

    PYTHONUNBUFFERED=1 python bench/e2e.py                      # H200: presets swe, tau2, grpo
    python bench/e2e.py --device cpu --tiny                       # toy size (CI smoke test)
    python bench/e2e.py --presets swe --scale 2 --microbatch-tokens 32768
    PYTHONUNBUFFERED=1 python bench/e2e.py --model kimi-linear --presets swe   # KDA + MLA model

Model (`--model`): qwen3-next = `common.BENCH_MODEL` (Qwen3-Next-like, ~2.25B parameters, 3 GDN
layers per gated-attention layer, 32 experts top-4 + shared expert) or kimi-linear =
`common.KIMI_BENCH_MODEL` (Kimi-Linear-like, ~2.55B parameters, 3 KDA layers per MLA layer, 32 experts
top-4 + shared expert); random weights, bf16, activation recomputation on every decoder layer.
`--tiny`: the runtime's tiny-qwen3-next / tiny-kimi-linear preset.

Batches: per preset, the smallest number of generated tasks whose trajectory tokens reach
`--target-tokens` x `--scale` (default 96k), with lengths multiplied by the preset's length scale
(swe 0.1, tau2 0.25, grpo 1: full-length swe rollouts are ~1M tokens per task). The compression
ratio of the batch actually used is the ideal speedup printed.

Modes, same model, same loss (-sum of token log-probs / trajectory tokens + aux coefficient x
MoE aux loss per microbatch), gradients accumulated over microbatches:
* tree: `compile(batch, CompileOptions(microbatch_tokens=B))`, one MicrobatchIndex per planned
  microbatch (planning and index building are timed separately: "planner");
* trajectory-wise: the runtime's trajectory mode (same kernels, every trajectory its own packed
  sequence), trajectories packed first-fit decreasing into microbatches of at most B tokens
  (a longer trajectory runs alone): the same memory budget per forward as tree mode.
In both modes every microbatch is lowered to its launch plan and uploaded once before the timed steps
(`common.Step`; "lower ms"), as a trainer does while the previous step runs.
Time per step = median wall time of `--repeat` steps after `--warmup`, device synchronised.

Numerics (forward only, on the first trajectories up to `--numerics-tokens`): max |log-prob|
difference of tree bf16 and of trajectory-wise bf16 to a float64 trajectory-wise reference of
the same weights (plain-torch GDN or KDA and attention references; stricter than fp32, whose Triton
matmuls may round through TF32). Tree mode passes when its error <= `--error-factor` x the
trajectory-wise error. The gradient agreement of the two bf16 modes is printed too.

Breakdown (tree mode): one profiled step split by torch.profiler into linear attention (GDN rule
+ short conv), attention, log-probs, MoE/MLP and the rest (projections, norms, gathers); backward
work follows its forward op through the autograd sequence numbers; plus planner time.

Baseline: the fastest of the runtime's trajectory mode (our kernels) and the same trajectory-wise step
with an external kernel of the model's rule in every linear-attention layer: fla's
chunk_gated_delta_rule / chunk_kda ("traj fla ms") and, for GDN, FlashQLA's chunk_gated_delta_rule
("traj fq ms"), each when importable on CUDA; then, for gated-attention (GQA) models on CUDA, the fastest of
those with torch's SDPA (its default backend, cuDNN on the H200) per trajectory in every full-attention layer
("traj sdpa ms", `anchors.TrajectorySDPA`). `--baselines` picks which of them run (`--baselines sdpa`: SDPA
with our GDN; `--baselines flashqla` alone when TileLang's first compilation of FlashQLA's kernels, minutes,
must fit in a run), `--no-fla` skips all of them; fla's column is fla's own kernels,
not its dispatch to FlashQLA. "speedup" divides that baseline by tree mode, and the JSON names the
baseline. On CUDA (GDN models), the GDN kernel of the
largest trajectory microbatch is also timed alone against fla's, and SDPA's attention per
trajectory against our attention kernel.
`--offload-piece-inputs`: tree mode moves the checkpointed layer inputs of a tree's earlier pieces to host memory
until their backward (the step's peak then holds one piece's).
`--memory-sites` (CUDA): what one forward of the largest tree / trajectory-wise microbatch leaves alive before
its backward, summed by allocation site (`memory_sites.py`).
JSON results go to $OUT/e2e.json when OUT is set (and to --json).
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
import traceback
from pathlib import Path

import torch

from harts_compiler.progress import progress

sys.path.insert(0, str(Path(__file__).resolve().parent))
from breakdown import component_breakdown  # noqa: E402
from e2e_numerics import numerics  # noqa: E402
from memory_sites import forward_memory_sites, print_sites  # noqa: E402
from baselines import baseline_timing, fla_comparison, time_mode  # noqa: E402
from common import (BENCH_MODELS, LENGTH_SCALE, TINY_GENERATOR, build_model, describe_device,  # noqa: E402
                    finish_args, format_table, forward_units, model_config, parameter_count, plan_microbatches,
                    prefix_forest, sized_batch, trajectory_microbatches, write_json)
from harts_compiler.passes import cost_model  # noqa: E402
from harts_compiler.predict import mode_terms  # noqa: E402



def parse_args(argv, description: str | None = None, add_arguments=None):
    """e2e's options (the batch, model and step); the benches that reuse them pass their own description and
    `add_arguments(parser)` for their own options, so that --help lists everything a script takes."""
    p = argparse.ArgumentParser(description=description or __doc__.split("\n")[0])
    if add_arguments is not None:
        add_arguments(p)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="qwen3-next", choices=sorted(BENCH_MODELS),
                   help="benchmark model: qwen3-next (GDN + gated attention, common.BENCH_MODEL) or kimi-linear "
                        "(KDA + MLA, common.KIMI_BENCH_MODEL)")
    p.add_argument("--tiny", action="store_true", help="toy model and batches (CPU smoke test)")
    p.add_argument("--presets", nargs="+", default=["swe", "tau2", "grpo"], choices=sorted(LENGTH_SCALE))
    p.add_argument("--scale", type=float, default=1.0, help="multiply the target trajectory tokens")
    p.add_argument("--target-tokens", type=int, help="trajectory tokens per step (default 96k; tiny 300)")
    p.add_argument("--length-scale", type=float, help="override every preset's length scale")
    p.add_argument("--microbatch-tokens", type=int, help="token budget per forward (default 16384; tiny 256)")
    p.add_argument("--chunk-size", type=int, help="linear-attention chunk (default 64; tiny 16, "
                   "which keeps the CPU reference fast)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 1)")
    p.add_argument("--repeat", type=int, help="timed steps, median reported (default 3; tiny 1)")
    p.add_argument("--numerics-tokens", type=int, help="trajectory tokens of the numerics subset "
                   "(default 8192; tiny 150)")
    p.add_argument("--error-factor", type=float, default=2.0)
    p.add_argument("--no-breakdown", action="store_true")
    p.add_argument("--offload-piece-inputs", action="store_true",
                   help="trees in pieces keep their earlier pieces' layer inputs in host memory "
                        "(TreeModel(offload_piece_inputs=True))")
    p.add_argument("--memory-sites", action="store_true",
                   help="CUDA: what one forward of the largest tree / trajectory-wise microbatch leaves alive, by "
                        "allocation site (bench/memory_sites.py)")
    p.add_argument("--no-fla", action="store_true",
                   help="do not time the trajectory-wise step with external kernels (fla's, FlashQLA's, SDPA)")
    p.add_argument("--baselines", nargs="+", choices=("fla", "flashqla", "sdpa"), default=["fla", "flashqla", "sdpa"],
                   help="the external trajectory-wise steps to time (each costs a full step plus its autotuning or "
                        "compilation; default all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the JSON results here")
    args = p.parse_args(argv)
    finish_args(p, args, dict(target_tokens=(300, 96_000), microbatch_tokens=(256, 16384), chunk_size=(16, 64),
                              numerics_tokens=(150, 8192), warmup=(1, 1), repeat=(1, 3)))
    return args


def plan_rows(plan) -> int:
    """Token rows of a launch plan, or of all pieces of a lowered chain."""
    return sum(index.positions.numel() for index in getattr(plan, "indices", [plan]))


def gib_text(gib: float | None) -> str:
    return "-" if gib is None else f"{gib:.1f}"  # None: no CUDA memory statistics (CPU)


def gradient_difference(grads_a, grads_b) -> float:
    """||a - b|| / ||b|| over all parameters (fp32 accumulation)."""
    num = den = 0.0
    for a, b in zip(grads_a, grads_b):
        if a is None or b is None:
            continue
        num += float((a.float() - b.float()).pow(2).sum())
        den += float(b.float().pow(2).sum())
    return (num / den) ** 0.5 if den else float("nan")


def plan_preset(preset, config, args):
    """(batch, row of the plan's facts, tree indices, trajectory-wise indices, layer counts) of one preset's
    generated batch as the options ask (sizes, budget, chunk); prints the plan's line."""
    overrides = dict(TINY_GENERATOR[preset]) if args.tiny else {"scale": LENGTH_SCALE[preset]}
    scale = args.length_scale or overrides.pop("scale")
    overrides.pop("scale", None)
    batch, tasks = sized_batch(preset, int(args.target_tokens * args.scale), length_scale=scale,
                               vocab_size=config.vocab_size, seed=args.seed, **overrides)
    shape = dict(chunk_size=args.chunk_size, conv_width=config.linear_conv_kernel_dim)
    layers = cost_model.LayerCounts.of(config)
    plan, tree_indices, compile_ms, index_ms, budget = plan_microbatches(
        batch, args.microbatch_tokens, args.device, vocab_size=config.vocab_size,
        layer_counts=layers, **shape)
    stats = plan.stats
    traj_indices = trajectory_microbatches(batch, budget, **shape)
    # ideal = trajectory tokens / distinct tokens (trees over the budget run as pieces: every token once)
    distinct = prefix_forest(batch).num_tokens
    row = {"preset": preset, "tasks": tasks, "length_scale": scale, "trajectories": len(batch),
           "trajectory_tokens": stats["trajectory_tokens"], "compact_tokens": distinct,
           "planned_tokens": stats["planned_tokens"], "pieces": stats.get("pieces", {}).get("pieces", 0),
           "ideal": round(stats["trajectory_tokens"] / distinct, 4), "pair_compression": stats["pair_compression"],
           "replay_tokens": stats["replay_tokens"],
           "rounds": stats["rounds"], "microbatch_tokens": budget,
           "tree_microbatches": len(tree_indices), "traj_microbatches": len(traj_indices),
           "planner_ms": compile_ms, "index_ms": index_ms}
    print(f"\n[{preset}] {tasks} tasks, {len(batch)} trajectories, {row['trajectory_tokens']} trajectory "
          f"tokens, {row['compact_tokens']} distinct (ideal {row['ideal']:.2f}x), {row['planned_tokens']} "
          f"planned rows with replay, {row['pieces']} pieces, budget {budget}: "
          f"{len(tree_indices)} tree / {len(traj_indices)} trajectory microbatches; planner "
          f"{compile_ms:.0f} ms + index {index_ms:.0f} ms", flush=True)
    return batch, row, tree_indices, traj_indices, layers


def predicted_terms(predictor, indices, layers) -> dict:
    """The fitted cost model's ms per term, summed over the forward units of one mode's microbatches."""
    return mode_terms(predictor, forward_units(indices), layers)


def run_preset(preset, model, args) -> dict:
    batch, row, tree_indices, traj_indices, layers = plan_preset(preset, model.config, args)
    tree, tree_step, tree_grads = time_mode(model, tree_indices, row["trajectory_tokens"], args)
    print(f"  tree: {tree['ms']:.1f} ms/step (host issues it in {tree['host_ms']:.0f}), peak "
          f"{gib_text(tree['peak_gib'])} GiB (lowering {tree['lower_ms']:.0f} ms, before the timed steps)", flush=True)
    traj, traj_step, traj_grads = time_mode(model, traj_indices, row["trajectory_tokens"], args)
    print(f"  trajectory-wise: {traj['ms']:.1f} ms/step (host issues it in {traj['host_ms']:.0f}), peak "
          f"{gib_text(traj['peak_gib'])} GiB (lowering {traj['lower_ms']:.0f} ms)", flush=True)
    row.update(tree_ms=tree["ms"], traj_ms=traj["ms"], tree_all_ms=tree["all_ms"], traj_all_ms=traj["all_ms"],
               tree_lower_ms=tree["lower_ms"], traj_lower_ms=traj["lower_ms"],
               tree_host_ms=tree["host_ms"], traj_host_ms=traj["host_ms"],
               tree_peak_gib=tree["peak_gib"], traj_peak_gib=traj["peak_gib"],
               grad_rel_diff=gradient_difference(tree_grads, traj_grads))
    row.update(baseline_timing(model, traj_indices, row, args, traj["ms"]))
    row["speedup"] = row["baseline_ms"] / tree["ms"]
    row["speedup_vs_ours_traj"] = traj["ms"] / tree["ms"]
    row["of_ideal"] = row["speedup"] / row["ideal"]
    predictor = cost_model.load_cost_model()
    row["cost_model"] = predictor.source
    row["tree_predicted_ms"] = sum(predicted_terms(predictor, tree_indices, layers).values())
    row["traj_predicted_ms"] = sum(predicted_terms(predictor, traj_indices, layers).values())
    print(f"  cost model ({predictor.source}, {predictor.device}): tree {row['tree_predicted_ms']:.1f} ms, "
          f"trajectory-wise {row['traj_predicted_ms']:.1f} ms predicted", flush=True)
    del tree_grads, traj_grads
    model.zero_grad(set_to_none=True)
    if not args.no_breakdown:
        row["breakdown_ms"] = component_breakdown(tree_step, args.device)
        row["breakdown_ms"]["planner (compile + index)"] = row["planner_ms"] + row["index_ms"]
    if args.memory_sites and args.device.type == "cuda":
        for label, step in (("tree", tree_step), ("trajectory-wise", traj_step)):
            largest = max(step.plans, key=plan_rows)
            print_sites(label, forward_memory_sites(model, largest, step.kernels))
    if args.device.type == "cuda":
        row["baseline_kernels"] = fla_comparison(model, traj_indices, args.device)
    row["_batch"] = batch
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device
    info = describe_device(device)
    config = model_config(args.tiny, model=args.model)
    start = time.perf_counter()
    model = build_model(config, device, torch.bfloat16, seed=args.seed, checkpointing=True)
    model.offload_piece_inputs = args.offload_piece_inputs
    tiny = BENCH_MODELS[args.model][1]
    print(f"device {info}\nmodel {tiny if args.tiny else args.model}: "
          f"{parameter_count(model) / 1e9:.3f}B parameters, {config.num_hidden_layers} layers "
          f"({config.layer_types.count('linear_attention')} {config.linear_rule.upper()}, "
          f"{config.layer_types.count('full_attention')} {'MLA' if config.is_kimi else 'attention'}), "
          f"{config.num_experts} experts top-{config.num_experts_per_tok}, bf16, "
          f"activation recomputation on (built in {time.perf_counter() - start:.1f} s)", flush=True)
    rows, failures = [], []
    for preset in progress(args.presets, desc="presets", unit="preset"):
        try:
            rows.append(run_preset(preset, model, args))
        except Exception:  # keep the other presets' results; exit non-zero at the end
            failures.append(preset)
            traceback.print_exc()
        save_json(rows, args, info, config, failures + ["(partial: numerics not run yet)"])
    reference = copy.deepcopy(model).to(torch.float64)  # same (bf16-exact) weights, float64 math
    for row in rows:
        try:
            numerics(row, model, reference, args)
        except Exception:
            failures.append(f"{row['preset']} numerics")
            row.pop("_batch", None)
            traceback.print_exc()
    del reference
    report(rows, args, info, config, failures)
    print(f"total wall time {time.perf_counter() - start:.0f} s")
    return 1 if failures else 0


def report(rows, args, info, config, failures) -> None:
    for row in rows:
        parts = row.get("breakdown_ms")
        if parts:
            total = parts["total"]
            print(f"\n[{row['preset']}] tree-mode breakdown (one profiled step; % of "
                  f"{'GPU kernel' if args.device.type == 'cuda' else 'CPU op'} time {total:.1f} ms):")
            for name, ms in sorted(parts.items(), key=lambda kv: -kv[1]):
                if name not in ("total", "step wall", "planner (compile + index)"):
                    print(f"  {name:28s} {ms:9.1f} ms  {100 * ms / total:5.1f}%")
            print(f"  {'planner (compile + index)':28s} {parts['planner (compile + index)']:9.1f} ms  (host, "
                  f"not in the step time)\n  profiled step wall {parts['step wall']:.1f} ms"
                  + (f" (GPU idle, host-bound: {parts['step wall'] - total:.1f} ms)"
                     if args.device.type == "cuda" else ""))
        base = row.get("baseline_kernels")
        if base:
            print(f"  baseline kernels: {base}")
    print("\nBaseline (speedup = baseline / tree): the fastest trajectory-wise step, one packed sequence per "
          "trajectory: " + "; ".join(f"{r['preset']} {r['baseline']}" for r in rows))
    print(f"Numerics: max |log-prob - float64 reference| on the first trajectories; tree ok when "
          f"<= {args.error_factor} x trajectory-wise error.\n")
    columns = [("preset", "preset"), ("trajectory_tokens", "traj tok"), ("compact_tokens", "distinct"),
               ("planned_tokens", "planned"),
               ("ideal", "ideal"), ("traj_ms", "traj ms"), ("traj_fla_ms", "traj fla ms"),
               ("traj_flashqla_ms", "traj fq ms"), ("traj_sdpa_ms", "traj sdpa ms"), ("tree_ms", "tree ms"),
               ("speedup", "speedup"),
               ("of_ideal", "of ideal"), ("traj_peak_gib", "traj GiB"), ("tree_peak_gib", "tree GiB"),
               ("err_traj", "err traj"), ("err_tree", "err tree"), ("mean_err_traj", "mean traj"),
               ("mean_err_tree", "mean tree"), ("numerics_ok", "ok"),
               ("grad_rel_diff", "grad diff"), ("planner_ms", "plan ms")]
    print(format_table(rows, columns))
    if failures:
        print(f"\nFAILED: {', '.join(failures)} (tracebacks above)")
    for path in save_json(rows, args, info, config, failures):
        print(f"wrote {path}")


def save_json(rows, args, info, config, failures):
    """e2e.json (also after every preset, so a run stopped early leaves results)."""
    public = [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows]
    payload = {"device": info, "args": {k: str(v) for k, v in vars(args).items()},
               "model": config.to_dict(), "rows": public, "failures": failures}
    return write_json("e2e.json", payload, args.json)


if __name__ == "__main__":
    sys.exit(main())
