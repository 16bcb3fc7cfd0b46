"""`harts verify`: run a compiled plan in tree mode and every trajectory on its own, and compare.

This is the project's correctness contract made executable (docs/design.md section 11): the same
per-trajectory log-probs, entropies, MoE statistics and parameter gradients, up to floating-point
reordering (float64, float32 on the CPU), or, in bfloat16 / float16 (the GPU kernels) and float32 on a GPU,
as close to a float64 run as trajectory-wise training is (verify_report.py). The gradient check uses a
fixed random weighting of log-probs and entropies (plus the aux loss when neither mode splits the batch),
i.e. an arbitrary token-level objective, so every parameter gets a non-trivial gradient.

Both modes run one microbatch at a time (tree mode: the plan's microbatches; trajectory-wise: packs of
whole trajectories) with backward after each, so memory is bounded by --microbatch-tokens, not by the
batch. The peak is estimated before any compute and a run that would not fit is refused.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import time

from .errors import InputError

import numpy as np
import torch

from .verify_report import DEFAULT_ERROR_FACTOR, HALF_DTYPES, ModeErrors, ReferenceErrors, VerifyReport

# Tokens per microbatch in both modes when none is given: ~1-3 GB of activations for the tiny models in
# fp64 on the CPU path (see verify_memory.py), a few seconds per microbatch.
DEFAULT_MICROBATCH_TOKENS = 4096


def _trajectory_weights(number: int, length: int, seed: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed random weights for one trajectory's log-probs and entropies (`number`: its rank among the
    sorted ids, so the weights do not depend on row order or on which microbatch the row lands in)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + number)
    return (torch.randn(length, generator=gen, dtype=torch.float64).to(dtype),
            0.1 * torch.randn(length, generator=gen, dtype=torch.float64).to(dtype))


@dataclasses.dataclass
class _Objective:
    """The token-level objective both modes minimise, summed over microbatches: sum of weighted
    log-probs and entropies divided by the batch's token count (one normaliser for the whole batch, so
    the gradients summed over microbatches are the whole batch's gradient)."""

    numbers: dict[str, int]
    lengths: dict[str, int]
    seed: int
    normaliser: float

    def __call__(self, out) -> torch.Tensor:
        rows, width = out.logprobs.shape
        # at least fp32, so that 16-bit runs and their float64 reference weigh the same objective
        dtype = torch.promote_types(out.logprobs.dtype, torch.float32)
        w_lp = torch.zeros((rows, width), dtype=dtype, device=out.logprobs.device)
        w_ent = torch.zeros((rows, width), dtype=dtype, device=out.logprobs.device)
        for row, traj_id in enumerate(out.trajectory_ids):
            n = min(self.lengths[traj_id], width)
            lp, ent = _trajectory_weights(self.numbers[traj_id], self.lengths[traj_id], self.seed, w_lp.dtype)
            w_lp[row, :n], w_ent[row, :n] = lp[:n], ent[:n]
        return ((out.logprobs * w_lp).sum() + (out.entropy * w_ent).sum()) / self.normaliser


def _gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def gradient_distances(got: dict[str, torch.Tensor | None],
                       want: dict[str, torch.Tensor | None]) -> tuple[float, str, float]:
    """One pass over the parameters (float64 arithmetic): (largest relative L2 difference |got - want| / |want|,
    its parameter's name, the relative L2 difference of all parameters together). A gradient present on one
    side only is infinitely different. Keys: parameter names; None = no gradient."""
    worst, diff, diff_sq, norm_sq = "-", 0.0, 0.0, 0.0
    for name in sorted(set(got) | set(want)):
        mine, ref = got.get(name), want.get(name)
        if mine is None or ref is None:
            if (mine is None) != (ref is None):
                return float("inf"), f"gradient present in one mode only: {name}", float("inf")
            continue
        mine, ref = mine.double(), ref.double()
        d_sq, r_sq = float((mine - ref).pow(2).sum()), float(ref.pow(2).sum())
        diff_sq, norm_sq = diff_sq + d_sq, norm_sq + r_sq
        rel = d_sq ** 0.5 / max(r_sq ** 0.5, 1e-30)
        if rel > diff:
            worst, diff = name, rel
    return diff, worst, (diff_sq / norm_sq) ** 0.5 if norm_sq else 0.0


def worst_gradient_difference(got: dict[str, torch.Tensor | None],
                              want: dict[str, torch.Tensor | None]) -> tuple[float, str]:
    """(largest relative L2 difference over parameters, its name): `gradient_distances`' first two."""
    return gradient_distances(got, want)[:2]


@dataclasses.dataclass
class ModeResult:
    """One mode's per-trajectory rows, MoE statistics and accumulated parameter gradients."""

    logprobs: dict[str, torch.Tensor]  # trajectory id -> [length]
    entropy: dict[str, torch.Tensor]
    expert_load: torch.Tensor | None
    aux_loss: torch.Tensor | None  # only when the mode ran in one microbatch (the loss does not add up)
    gradients: dict[str, torch.Tensor]
    seconds: float


def _run_mode(model, microbatches, objective, *, with_aux: bool, desc: str, quiet: bool,
              activation_checkpointing: bool, keep_rows) -> ModeResult:
    """Forward + backward of every microbatch in turn (gradients accumulate in `.grad`); only the
    detached rows `keep_rows(out)` chooses and the summed expert load survive a microbatch."""
    from harts_compiler.progress import progress

    model.zero_grad(set_to_none=True)
    expert_load = aux = None
    logprobs: dict[str, torch.Tensor] = {}
    entropy: dict[str, torch.Tensor] = {}
    start = time.perf_counter()
    for mb in progress(microbatches, desc=desc, total=len(microbatches), unit="microbatch", quiet=quiet):
        out = model(mb() if callable(mb) else mb, activation_checkpointing=activation_checkpointing)
        loss = objective(out)
        if with_aux and out.aux_loss is not None:
            aux = out.aux_loss.detach()
            loss = loss + out.aux_loss
        loss.backward()
        keep_rows(out, logprobs, entropy)
        if out.expert_load is not None:
            expert_load = out.expert_load if expert_load is None else expert_load + out.expert_load
        del out, loss
    seconds = time.perf_counter() - start
    gradients = _gradients(model)
    model.zero_grad(set_to_none=True)
    return ModeResult(logprobs, entropy, expert_load, aux, gradients, seconds)


def _keep_trajectory_rows(out, logprobs, entropy) -> None:
    for row, traj_id in enumerate(out.trajectory_ids):
        n = int(out.lengths[row])
        logprobs[traj_id] = out.logprobs[row, :n].detach().clone()
        entropy[traj_id] = out.entropy[row, :n].detach().clone()


def verify_plan(model, batch, plan, *, seed: int = 0, activation_checkpointing: bool = False,
                microbatch_tokens: int | None = None, memory_limit: int | None = None,
                quiet: bool = True, error_factor: float = DEFAULT_ERROR_FACTOR) -> VerifyReport:
    """Execute `plan` (compiled from `batch`) in tree mode and `batch` trajectory-wise, one microbatch
    at a time in both (trajectory-wise: packs of at most `microbatch_tokens` tokens; None: the default
    budget or the longest trajectory); compare. A 16-bit model (or a float32 one on a GPU) also runs the packs
    on a float64 copy of itself (plain-torch kernels), which both modes are measured against (`error_factor`:
    the bar).
    Raises InputError, before any compute, when the memory estimate exceeds `memory_limit` (default:
    the memory available now on the model's device)."""
    from harts_compiler.runtime import trajectory_wise
    from harts_compiler.runtime.distributed import assemble_rows
    from harts_compiler.runtime.trajectory import pack_index, trajectory_packs, trajectory_token_lists
    from harts_compiler.verify_memory import available_memory, check_fits, estimate_memory, footprint

    stats = plan.stats
    weight = model.lm_head.weight
    # 16-bit runs, and float32 on a GPU, are judged against a float64 run (verify_report.py)
    against_reference = weight.dtype in HALF_DTYPES or (weight.dtype == torch.float32 and weight.device.type == "cuda")
    microbatches = plan.microbatches()
    token_lists, ids = trajectory_token_lists(batch)
    lengths = [len(t) for t in token_lists]
    chunk_size, conv_width = plan.options.chunk_size, model.conv_width
    microbatch_tokens = microbatch_tokens or max([DEFAULT_MICROBATCH_TOKENS, *lengths])
    packs = trajectory_packs(lengths, microbatch_tokens)
    index_of_pack = lambda pack: lambda: pack_index(token_lists, ids, pack, chunk_size=chunk_size,  # noqa: E731
                                                    conv_width=conv_width)

    # the estimate reads every microbatch's index on the host (cheap next to one forward)
    estimate = estimate_memory(
        model, chunk_size, [footprint(mb.build_chain() if mb.runs_as_pieces else mb.build_index())
                            for mb in microbatches],
        [footprint(index_of_pack(pack)()) for pack in packs], trajectories=len(ids), max_length=max(lengths),
        checkpointing=activation_checkpointing, reference_dtype=torch.float64 if against_reference else None)
    limit = available_memory(weight.device) if memory_limit is None else memory_limit
    check_fits(estimate, limit, microbatch_tokens=microbatch_tokens,
               limit_source="the memory available" if memory_limit is None else "--memory-limit",
               float64=weight.dtype == torch.float64)

    # warm-up (lazy imports, allocator, autograd machinery) so the timings below compare modes
    first = dict(zip(ids[:2], token_lists[:2]))
    trajectory_wise(model, first, chunk_size=chunk_size).logprobs.sum().backward()

    objective = _Objective(numbers={traj_id: n for n, traj_id in enumerate(sorted(ids))},
                           lengths=dict(zip(ids, lengths)), seed=seed, normaliser=float(max(sum(lengths), 1)))
    # the MoE aux loss is a product of batch-wide averages: it enters the objective only when neither
    # mode splits the batch
    with_aux = len(microbatches) == 1 and len(packs) == 1
    tree_outputs = []

    def keep_tree_rows(out, logprobs, entropy):  # rows of split trees are put together after the pass
        tree_outputs.append(dataclasses.replace(out, logprobs=out.logprobs.detach(), entropy=out.entropy.detach()))

    tree = _run_mode(model, microbatches, objective, with_aux=with_aux, desc="verify: tree mode", quiet=quiet,
                     activation_checkpointing=activation_checkpointing, keep_rows=keep_tree_rows)
    ref = _run_mode(model, [index_of_pack(pack) for pack in packs], objective, with_aux=with_aux,
                    desc="verify: trajectory-wise", quiet=quiet, activation_checkpointing=activation_checkpointing,
                    keep_rows=_keep_trajectory_rows)

    # the plan's rows (input order, split trees put together), by trajectory id
    tree_lp, _ = assemble_rows(plan, tree_outputs, "logprobs")
    tree_ent, _ = assemble_rows(plan, tree_outputs, "entropy")
    del tree_outputs[:]
    rows = list(enumerate(plan.program.forest.traj_ids))
    tree.logprobs = {traj_id: tree_lp[row, :len(ref.logprobs[traj_id])] for row, traj_id in rows}
    tree.entropy = {traj_id: tree_ent[row, :len(ref.logprobs[traj_id])] for row, traj_id in rows}
    lp_diff, ent_diff = row_differences(tree, ref)
    grad_diff, worst = worst_gradient_difference(tree.gradients, ref.gradients)
    reference = None
    if against_reference:  # float64 (plain-torch kernels), the same (exactly representable) weights
        exact = copy.deepcopy(model).to(torch.float64)
        exact_run = _run_mode(exact, [index_of_pack(pack) for pack in packs], objective, with_aux=with_aux,
                              desc="verify: float64 reference", quiet=quiet,
                              activation_checkpointing=activation_checkpointing, keep_rows=_keep_trajectory_rows)
        del exact
        reference = ReferenceErrors(tree=mode_errors(tree, exact_run), trajectory=mode_errors(ref, exact_run),
                                    factor=error_factor)
    comparable_aux = tree.aux_loss is not None and ref.aux_loss is not None
    return VerifyReport(
        trajectories=len(ids), trajectory_tokens=int(stats["trajectory_tokens"]),
        compact_tokens=int(stats["compact_tokens"]), microbatches=len(microbatches),
        rounds=max((mb.summary()["rounds"] for mb in microbatches), default=0), dtype=weight.dtype,
        logprob_diff=lp_diff, entropy_diff=ent_diff,
        aux_diff=float((tree.aux_loss - ref.aux_loss).abs()) if comparable_aux else None,
        expert_load_diff=None if tree.expert_load is None else float((tree.expert_load - ref.expert_load).abs().max()),
        grad_rel_diff=grad_diff, worst_param=worst, tree_seconds=tree.seconds, trajectory_seconds=ref.seconds,
        on_cpu=weight.device.type == "cpu", trajectory_packs=len(packs),
        estimated_bytes=estimate.total, gradients=(tree.gradients, ref.gradients), reference=reference,
        against_reference=against_reference)


def row_differences(mode: ModeResult, reference: ModeResult) -> tuple[float, float]:
    """(max |log-prob diff|, max |entropy diff|) over the reference's trajectories (float64 arithmetic)."""
    lp_diff = ent_diff = 0.0
    for traj_id, ref_lp in reference.logprobs.items():
        if len(ref_lp):
            lp_diff = max(lp_diff, float((mode.logprobs[traj_id].double() - ref_lp.double()).abs().max()))
            ent_diff = max(ent_diff, float((mode.entropy[traj_id].double()
                                            - reference.entropy[traj_id].double()).abs().max()))
    return lp_diff, ent_diff


def mode_errors(mode: ModeResult, reference: ModeResult) -> ModeErrors:
    """Rows as in `row_differences`; the gradient as one relative L2 distance over all parameters (a parameter
    with a tiny gradient has a large relative error in any 16-bit run, so per-parameter ratios are noise), with
    the parameter of the largest relative difference named."""
    lp, ent = row_differences(mode, reference)
    _, worst, gradient = gradient_distances(mode.gradients, reference.gradients)
    return ModeErrors(logprob=lp, entropy=ent, gradient=gradient, worst_param=worst)


DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


def load_model(spec: str, dtype: torch.dtype, seed: int = 0, device: str = "cpu"):
    """A preset name (random weights) or a Hugging Face checkpoint directory on `device`; InputError otherwise."""
    from pathlib import Path

    from harts_compiler.runtime import PRESETS, TreeModel, UnsupportedModelError

    if spec in PRESETS:
        from harts_compiler.runtime.weights import randomise_for_verification_

        model = TreeModel.from_config(spec, seed=seed, dtype=torch.float64)
        if dtype not in HALF_DTYPES:  # random weights under which every path (and every state hand-off) matters
            randomise_for_verification_(model, seed)
        # 16-bit: transformers' initialisation, as a checkpoint has; the verification draw's large products
        # leave bfloat16 log-probs about 1 off float64 in both modes, which would make the comparison empty
        return model.to(device=device, dtype=dtype)
    if not (Path(spec) / "config.json").is_file():
        from .commands import unknown_model

        raise unknown_model(spec)
    try:
        return TreeModel.from_pretrained(spec).to(device=device, dtype=dtype)
    except (OSError, ValueError, KeyError, UnsupportedModelError) as error:  # the message names file or field
        raise InputError(f"--model {spec}: {' '.join(str(error).split())}") from None


def add_execution_arguments(parser: argparse.ArgumentParser, default_model: str = "tiny-qwen3-next") -> None:
    from harts_compiler.progress import add_quiet_argument

    parser.add_argument("--model", default=default_model,
                        help="preset name (random weights) or HF checkpoint directory (default: %(default)s)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float64",
                        help="float64, and float32 on the CPU: tree mode must equal trajectory-wise up to reordering; "
                        "bfloat16 / float16 (the kernels a GPU trains with), and float32 on a GPU: both modes run "
                        "against a float64 copy and tree mode may be at most --error-factor times as far from it "
                        "(default: %(default)s)")
    parser.add_argument("--device", default="cpu",
                        help="where the model runs: cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--error-factor", type=float, default=DEFAULT_ERROR_FACTOR,
                        help="the bar of runs judged against float64: tree mode's error over trajectory-wise "
                        "training's, per measure (default: %(default)s)")
    parser.add_argument("--chunk-size", type=int, default=64,
                        help="linear-attention chunk, tokens (default: %(default)s)")
    parser.add_argument("--microbatch-tokens", type=int,
                        default=None,
                        help="tokens per microbatch in both modes: compact tokens in tree mode, trajectory "
                        "tokens trajectory-wise; memory grows with it (default: "
                        f"{DEFAULT_MICROBATCH_TOKENS}, or the longest trajectory when that is longer)")
    parser.add_argument("--memory-limit", metavar="SIZE", default=None,
                        help="refuse to start when the memory estimate is above SIZE, e.g. 8G or 512M "
                        "(default: the memory available now)")
    parser.add_argument("--checkpointing", action="store_true", help="activation recomputation per layer")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice)")
    add_quiet_argument(parser)


def setup_execution(args):
    """The model of `args` (threads set first), and the memory limit in bytes (None: what is available)."""
    from harts_compiler.verify_memory import parse_memory_size

    for flag in ("chunk_size", "microbatch_tokens", "threads"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise InputError(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    if args.threads is not None and args.threads > (os.cpu_count() or 1):  # torch crashed on 100,000 threads
        raise InputError(f"--threads {args.threads}: this machine has {os.cpu_count() or 1} CPUs")
    if not 0 <= args.seed < 2**32:  # torch's generators take 64-bit seeds, and verification derives some from it
        raise InputError(f"--seed must be an integer in [0, 2**32), got {args.seed}")
    if not args.error_factor >= 1:  # also nan
        raise InputError(f"--error-factor must be a number >= 1, got {args.error_factor}")
    device = check_device(args.device)
    limit = None if args.memory_limit is None else parse_memory_size(args.memory_limit)
    if args.threads:
        torch.set_num_threads(args.threads)
    return load_model(args.model, DTYPES[args.dtype], seed=args.seed, device=device), limit


def check_device(spec: str) -> torch.device:
    """`cpu`, `cuda` or `cuda:N` that this machine has; InputError otherwise."""
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise InputError(f"--device {spec!r}: expected cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"--device {spec!r}: expected cpu, cuda or cuda:N")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise InputError(f"--device {spec}: this machine has {count} CUDA device(s)")
    return device


def run_verification(batch, args, model=None, memory_limit: int | None = None) -> VerifyReport:
    from harts_compiler import CompileOptions, compile

    if model is None:
        model, memory_limit = setup_execution(args)
    budget = args.microbatch_tokens or max([DEFAULT_MICROBATCH_TOKENS, *np.diff(np.asarray(batch.offsets))])
    options = CompileOptions.for_model(model, chunk_size=args.chunk_size, microbatch_tokens=int(budget))
    plan = compile(batch, options)
    return verify_plan(model, batch, plan, seed=args.seed, activation_checkpointing=args.checkpointing,
                       microbatch_tokens=int(budget), memory_limit=memory_limit, quiet=args.quiet,
                       error_factor=args.error_factor)


def verify_main(argv: list[str]) -> int:
    from harts_compiler import TreeBatch

    parser = argparse.ArgumentParser(prog="harts verify", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", help="JSONL batch (trajectories and/or trees)")
    add_execution_arguments(parser)
    args = parser.parse_args(argv)
    model, memory_limit = setup_execution(args)  # bad flags and models are refused before reading the batch
    report = run_verification(TreeBatch.load(args.input), args, model, memory_limit)
    print(report.format())
    return 0 if report.passed else 1
