"""Shared helpers of the benchmark scripts: timing, peak memory, device description, tables,
JSON output, the benchmark model and sized generated batches (the per-component time breakdown is
in breakdown.py, the external kernels the benchmarks compare against in anchors.py).

Import from a script in bench/ as `from common import ...` (scripts run as `python bench/x.py`,
which puts bench/ on sys.path).
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

import harts_compiler as hc
from harts_compiler.codegen.pieces import PieceChain
from harts_compiler.predict import forward_units, plan_indices, trajectory_microbatches  # noqa: F401 (re-exported)
from harts_compiler.runtime.pieces import lower_chain

# -- the benchmark model ----------------------------------------------------------------------

# A Qwen3-Next-like model of about 2.25B parameters (bf16: 4.5 GB): Qwen3-Next-80B-A3B's layer
# shapes (hidden 2048, GDN with 16 key heads / 32 value heads of 128, gated attention with 16
# query heads / 2 KV heads of 256 and partial RoPE 0.25, 3 linear-attention layers per full one,
# Qwen's 151936 vocabulary), with 12 layers and 32 experts (top-4 of moe_intermediate 512, plus a
# shared expert of 512) instead of 48 layers and 512 experts. Parameters: embeddings 0.31B,
# lm_head 0.31B, 9 GDN mixers 0.30B, 3 attention mixers 0.08B, 12 MoE blocks 1.25B; about 0.9B
# active per token (lm_head included).
BENCH_MODEL = dict(
    model_type="qwen3_next", vocab_size=151936, hidden_size=2048, num_hidden_layers=12,
    full_attention_interval=4, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=32, num_experts_per_tok=4,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, intermediate_size=5120,
    decoder_sparse_step=1, norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False,
    router_aux_loss_coef=0.001,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
)
TINY_MODEL = "tiny-qwen3-next"  # runtime preset: vocab 128, hidden 64, 4 layers, 4 experts

# A Kimi-Linear-like model of about 2.5B parameters: Kimi-Linear-48B-A3B's layer shapes (hidden 2304; KDA
# with 32 heads of 128 and a short conv of 4; MLA with 32 heads, q/k 192 = 128 without RoPE + 64 RoPE part,
# v 128, a 512-wide kv latent, no q latent, no RoPE applied (mla_use_nope); a dense first MLP of 9216; one
# shared expert; sigmoid routing with the score-correction bias; vocabulary 163,840), with 12 layers (MLA
# on every 4th) and 32 experts top-4 of moe_intermediate 512 instead of 27 layers and 256 experts top-8.
KIMI_BENCH_MODEL = dict(
    model_type="kimi_linear", vocab_size=163840, hidden_size=2304, num_hidden_layers=12,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(12)],
    mlp_layer_types=["dense"] + ["sparse"] * 11, intermediate_size=9216,
    num_attention_heads=32, num_key_value_heads=32, q_lora_rank=None, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mla_use_nope=True,
    linear_num_heads=32, linear_head_dim=128, linear_conv_kernel_dim=4,
    num_experts=32, num_experts_per_tok=4, num_expert_group=1, topk_group=1, routed_scaling_factor=2.446,
    num_shared_experts=1, moe_intermediate_size=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
    router_aux_loss_coef=0.001,
)
# --model of the scripts that take one: the benchmark config and the runtime preset --tiny uses instead
BENCH_MODELS = {"qwen3-next": (BENCH_MODEL, TINY_MODEL), "kimi-linear": (KIMI_BENCH_MODEL, "tiny-kimi-linear")}


def model_config(tiny: bool, layer_types: list[str] | None = None, model: str = "qwen3-next"):
    """A benchmark ModelConfig (`BENCH_MODELS[model]`, or its tiny CPU preset), optionally with other layer
    types."""
    from harts_compiler.runtime.config import PRESETS, ModelConfig
    full, tiny_preset = BENCH_MODELS[model]
    raw = dict(PRESETS[tiny_preset] if tiny else full)
    if layer_types is not None:
        raw.update(layer_types=list(layer_types), num_hidden_layers=len(layer_types))
    return ModelConfig.from_dict(raw)


def build_model(config, device: torch.device, dtype: torch.dtype, seed: int = 0,
                checkpointing: bool = True, draw_on_device: bool | None = None,
                triton_linear_attention: bool = True, gdn_config=None):
    """Random TreeModel, initialised like transformers (`TreeModel.from_config`); on a GPU (or with
    `draw_on_device`) drawn on the device, because CPU float64 draws took minutes for a billion parameters."""
    from harts_compiler.runtime import TreeModel
    on_device = device.type != "cpu" if draw_on_device is None else draw_on_device
    return TreeModel.from_config(config, seed=seed, dtype=dtype, device=device, draw_on_device=on_device,
                                 activation_checkpointing=checkpointing,
                                 triton_linear_attention=triton_linear_attention, gdn_config=gdn_config)


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


# -- generated batches ------------------------------------------------------------------------

# per preset, the generator's length scale of the benchmark batches (full-length swe rollouts are ~1M
# tokens per task); --tiny: a few hundred tokens per preset, same shapes with fewer turns and rollouts
LENGTH_SCALE = {"swe": 0.1, "tau2": 0.25, "grpo": 1.0}
TINY_GENERATOR = {"swe": dict(scale=0.005, turns=(2, 5), rollouts=4),
                  "tau2": dict(scale=0.01, turns=(2, 3), rollouts=4),
                  "grpo": dict(scale=0.02, rollouts=4)}


def sized_batch(preset: str, target_tokens: int, *, length_scale: float, vocab_size: int,
                seed: int = 0, max_tasks: int = 4096, **overrides):
    """(TreeBatch, tasks): the smallest number of tasks of a generated preset batch whose
    trajectory tokens reach `target_tokens` (tasks grow in generation order, so a batch of k
    tasks is a prefix of one of k+1). `overrides`: other generator parameters."""
    from harts_compiler import TreeBatch
    from harts_compiler.generator import generate
    tasks = 1
    while True:
        rollouts = generate(preset, seed, tasks=tasks, scale=length_scale, vocab_size=vocab_size,
                            **overrides)
        total = int(rollouts.tree_summary()["trajectory_tokens"].sum())
        if total >= target_tokens or tasks >= max_tasks:
            break
        tasks += 1
    ids, lists = zip(*rollouts.trajectories)
    return TreeBatch.from_trajectories([np.asarray(t, np.int64) for t in lists], list(ids)), tasks


# -- linear-attention kernels of a step -----------------------------------------------------

def linear_kernel_arguments(config, kernel) -> dict:
    """The TreeModel keyword that puts `kernel` in every linear-attention layer of `config`'s rule
    (`gdn_kernel=` / `kda_kernel=`); {} for None (the runtime's own kernels)."""
    return {} if kernel is None else {f"{config.linear_rule}_kernel": kernel}


# -- one training step -------------------------------------------------------------------------

class Step:
    """One training step: zero grads, then per microbatch forward, loss, backward (gradients accumulate).

    `indices` (host MicrobatchIndexes) are lowered for the model and uploaded once, here, as a trainer
    does while the previous step runs: the timed step reads device launch plans only (`lower_ms`: the
    lowering and upload time of all of them)."""

    def __init__(self, model, indices, trajectory_tokens: int, linear_kernel=None, attention_kernel=None):
        self.model = model
        self.trajectory_tokens = trajectory_tokens
        self.aux_coef = model.config.router_aux_loss_coef
        self.kernels = linear_kernel_arguments(model.config, linear_kernel)  # None: the runtime's own
        if attention_kernel is not None:  # e.g. anchors.TrajectorySDPA (trajectory-wise microbatches)
            self.kernels["attention_kernel"] = attention_kernel
        device = model.lm_head.weight.device
        start = time.perf_counter()
        self.plans = [lower_chain(model, index) if isinstance(index, PieceChain) else
                      model.launch_plan(index, reference_gdn=linear_kernel is not None) for index in indices]
        if attention_kernel is not None:
            for plan, index in zip(self.plans, indices):
                attention_kernel.add(plan, index)
        synchronize(device)
        self.lower_ms = (time.perf_counter() - start) * 1e3

    def __call__(self):
        self.model.zero_grad(set_to_none=True)
        for plan in self.plans:
            out = self.model(plan, **self.kernels)
            p = torch.arange(out.logprobs.shape[1], device=out.logprobs.device)
            valid = (p[None, :] >= 1) & (p[None, :] < out.lengths[:, None])
            loss = -(out.logprobs.float() * valid).sum() / self.trajectory_tokens
            if out.aux_loss is not None:
                loss = loss + self.aux_coef * out.aux_loss.float()
            loss.backward()


def plan_microbatches(batch, budget: int, device, *, chunk_size: int, conv_width: int,
                      vocab_size: int | None = None, layer_counts=None):
    """(plan, host indices, compile ms, index-building ms, budget used). `layer_counts` (a
    cost_model.LayerCounts) is handed to the planner's cost model when CompileOptions takes it.
    If the compiler rejects a tree above the budget (a compiler without tree splitting), the
    budget is raised to the largest tree."""
    options = dict(microbatch_tokens=budget, vocab_size=vocab_size, conv_width=conv_width,
                   chunk_size=chunk_size)
    if layer_counts is not None and "linear_layers" in hc.CompileOptions.model_fields:
        options.update(linear_layers=layer_counts.linear, full_layers=layer_counts.full)
    try:
        start = time.perf_counter()
        plan = hc.compile(batch, hc.CompileOptions(**options))
    except hc.InputError as error:
        if "exceed" not in str(error):
            raise
        budget = max(budget, max_tree_tokens(batch))
        print(f"  note: a tree exceeds the budget and the compiler cannot split it; budget raised "
              f"to the largest tree, {budget} tokens", flush=True)
        options["microbatch_tokens"] = budget
        start = time.perf_counter()
        plan = hc.compile(batch, hc.CompileOptions(**options))
    compile_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    indices = plan_indices(plan)
    return plan, indices, compile_ms, (time.perf_counter() - start) * 1e3, budget


def prefix_forest(batch):
    """The batch's prefix forest (prefix-compress + layout only): distinct tokens, tree sizes."""
    return hc.compile(batch, hc.CompileOptions(), passes=["prefix-compress", "layout"]).program.forest


def max_tree_tokens(batch) -> int:
    forest = prefix_forest(batch)
    return int((forest.tree_end - forest.tree_start).max())


# -- timing and memory ------------------------------------------------------------------------

def finish_args(parser, args, defaults: dict[str, tuple]) -> None:
    """The command-line steps every model bench shares: `args.device` becomes a torch.device (a parser
    error when CUDA is asked for and missing), --tiny runs get one CPU thread, and each option in
    `defaults` that was left unset gets its (tiny, full) value."""
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available (use --device cpu --tiny)")
    if args.tiny:
        quiet_cpu_threads(args.device)
    for name, (tiny, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)


def quiet_cpu_threads(device: torch.device) -> None:
    """Toy CPU runs use one thread: on small shared machines OpenMP threads spin against other
    processes and made the smoke runs 4-5x slower (measured here, 2 cores)."""
    if device.type == "cpu":
        torch.set_num_threads(1)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], object], device: torch.device, *, warmup: int, repeat: int,
               host: list | None = None) -> list[float]:
    """Wall milliseconds of `repeat` calls after `warmup` calls, the device synchronised around
    each call (so a call's time is all its host and device work). `host`, when given, receives each call's
    host time: until `fn` returned, before the synchronisation (a call whose host time reaches its wall time
    is host-bound: the device waits for launches)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        issued = time.perf_counter()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
        if host is not None:
            host.append((issued - start) * 1e3)
    return times


def median(values) -> float:
    return float(statistics.median(values)) if len(values) else float("nan")


def rel_error(a, b) -> float:
    """Relative Frobenius error of `a` against the reference `b`, in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def kernel_ms(fn: Callable[[], object], device: torch.device, *, rep_ms: int = 100,
              warmup_ms: int = 25) -> float:
    """Median ms of a short GPU call (triton's do_bench: L2 flushed, CUDA events); CPU: wall."""
    if device.type == "cuda":
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    return median(time_calls(fn, device, warmup=1, repeat=3))


@contextlib.contextmanager
def peak_memory(device: torch.device):
    """Yields a dict; after the block 'gib' = peak allocated GiB *above what was allocated at
    entry* (what the block itself needed: activations, gradients, workspaces), 'entry_gib' = what
    was allocated at entry. Both None on CPU."""
    result = {"gib": None, "entry_gib": None}
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        entry = torch.cuda.memory_allocated(device)
        result["entry_gib"] = entry / 2**30
    yield result
    if device.type == "cuda":
        synchronize(device)
        result["gib"] = (torch.cuda.max_memory_allocated(device) - entry) / 2**30


def describe_device(device: torch.device) -> dict:
    info = {"device": str(device), "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, sms=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1))
    else:
        info.update(name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return info


# -- output -----------------------------------------------------------------------------------

def format_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """rows of dicts -> aligned text; columns = (key, header); floats to 3 significant digits."""
    def cell(value):
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1e5 else f"{value:.0f}"
        return str(value)
    body = [[cell(row.get(key)) for key, _ in columns] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h)
              for i, (_, h) in enumerate(columns)]
    lines = ["  ".join(h.rjust(w) for (_, h), w in zip(columns, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


def write_json(name: str, payload: dict, path: str | None = None) -> list[Path]:
    """Write `payload` to `path` when given and to $OUT/name when the OUT variable is set."""
    written = []
    targets = [Path(path)] if path else []
    if os.environ.get("OUT"):
        targets.append(Path(os.environ["OUT"]) / name)
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")
        written.append(target)
    return written


def _jsonable(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)
