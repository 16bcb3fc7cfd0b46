"""Data-parallel execution of a compiled plan: one training step's forward and backward over the
(rank, slot) schedule of `harts_compiler.compile(..., dp_size=N)`, on a model sharded with FSDP2.

The plan's ranks are the data-parallel ranks of the mesh the model is sharded on
(`runtime.fsdp.shard_model`). Gradients are reduced by FSDP2 itself (reduce-scatter into each
rank's shard, summed, not averaged); the only collectives written here carry plan metadata and
loss totals (a few numbers per step).

Lockstep contract. FSDP2 all-gathers a layer's parameters in its forward and reduce-scatters its
gradients in its backward, so every rank must run the same number of forwards and backwards in
the same order. The planner gives every rank the same number of slots (`slot_schedule`); a
(rank, slot) without a microbatch is an *empty slot*, where the rank runs a *padding* forward and
backward (the plan's smallest microbatch, loss multiplied by zero): it takes part in every
collective and adds exact zeros to the gradients.

Per non-empty slot: build the microbatch's index, forward, gather the per-trajectory loss inputs
into the output's row order, loss with batch-global normalisers (known from the plan before any
compute: no collective), backward. Gradient accumulation over slots is FSDP2's: `sync="step"`
(default) turns gradient sync off (`set_requires_gradient_sync(False)`) for all slots but the last,
so unsharded gradients accumulate locally and are reduce-scattered once; `sync="slot"` reduce-
scatters after every slot and accumulates the sharded gradients (less memory, more traffic).

Result: with the same weights, the gathered gradients (`full_tensor()`) and the global loss equal
those of one process running the whole batch (tests/test_fsdp.py checks it over gloo).

Use (every rank, after `dist.init_process_group`; same plan and inputs everywhere):

    mesh = fsdp.data_parallel_mesh(world, "cuda"); fsdp.shard_model(model, mesh)
    plan = harts_compiler.compile(batch, CompileOptions(dp_size=world, microbatch_tokens=B))
    advantages = group_advantages(rewards, plan.program.forest.traj_ids, groups)   # dp_inputs
    inputs = TrajectoryInputs.for_plan(plan, advantages=advantages, old_logprobs=old)
    result = data_parallel_step(model, plan, inputs, PPOObjective(kl_coef=0.0))
    optimizer.step()          # each rank's sharded .grad is its shard of the batch's gradient

Trees in pieces (`cut-pieces`): a tree over the budget is one microbatch whose pieces run k forwards
then k backwards on every rank (`runtime.pieces.run_piece_chain_detached`), and its output holds the
tree's whole rows, so every trajectory is still one row of one microbatch: the coverage check (each
trajectory's row once over all ranks and slots), the global normalisers (token-mean over all target
positions, seq-mean over trajectories) and the aux-loss weights (a microbatch's trajectory tokens = its
tokens weighted by multiplicity) need nothing special. `run_plan` and
`assemble_rows` put a plan's microbatch outputs back into `[n_traj, max_len]` rows (verification).
"""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from harts_compiler.objectives import LossOutput, loss_mask

from harts_compiler.codegen import trajectory_index

from .dp_inputs import GlobalNormalisers, TrajectoryInputs
from .dp_objective import LossContext, LossFn, PPOObjective
from .pieces import run_piece_chain_detached

SYNC_MODES = ("step", "slot")


@dataclasses.dataclass
class SlotMetrics:
    """One (rank, slot): what it held and where its time went (seconds, wall clock)."""

    slot: int
    microbatch: int  # plan microbatch index; -1 = empty slot
    trees: int = 0
    compact_tokens: int = 0
    trajectories: int = 0
    trajectory_tokens: int = 0
    loss_tokens: int = 0
    index_s: float = 0.0  # building the MicrobatchIndex (host)
    forward_s: float = 0.0  # forward + loss
    backward_s: float = 0.0
    padding: bool = False  # an empty slot that ran the padding microbatch for the collectives

    @property
    def compute_s(self) -> float:
        return self.index_s + self.forward_s + self.backward_s


@dataclasses.dataclass
class RankMetrics:
    rank: int
    slots: list[SlotMetrics]
    reduce_s: float = 0.0  # after the last slot: the loss and count sums over ranks
    total_s: float = 0.0

    @property
    def compute_s(self) -> float:
        return sum(s.compute_s for s in self.slots)

    @property
    def compact_tokens(self) -> int:
        return sum(s.compact_tokens for s in self.slots)


@dataclasses.dataclass
class StepResult:
    loss: float  # the batch's loss: sum over all ranks and slots
    local_loss: float  # this rank's share
    normalisers: GlobalNormalisers
    metrics: RankMetrics
    all_ranks: list[RankMetrics] | None = None  # every rank's metrics (gather_metrics=True)
    loss_metrics: list[dict] = dataclasses.field(default_factory=list)  # per non-empty slot


def slot_schedule(plan, rank: int) -> list:
    """This rank's microbatch of every slot (None = empty), over the plan's global slot count."""
    mbs = plan.program.microbatches
    if mbs is None:
        raise ValueError("plan has no microbatches: compile it with the schedule pass")
    num_slots = int(mbs.mb_slot.max()) + 1 if mbs.num_microbatches else 0
    schedule = [None] * num_slots
    for mb in plan.microbatches(rank):
        if schedule[mb.slot] is not None:
            raise ValueError(f"plan: rank {rank} has two microbatches in slot {mb.slot}")
        schedule[mb.slot] = mb
    return schedule


def _topology(plan, process_group, rank, world_size) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        actual = (dist.get_rank(process_group), dist.get_world_size(process_group))
        for name, given, real in (("rank", rank, actual[0]), ("world_size", world_size, actual[1])):
            if given is not None and given != real:
                raise ValueError(f"{name}={given} but the process group says {real}")
        rank, world_size = actual
    else:
        rank, world_size = (0 if rank is None else rank), (1 if world_size is None else world_size)
        if world_size != 1:
            raise ValueError(f"world_size={world_size} needs an initialised torch.distributed "
                             "process group")
    dp_size = plan.program.microbatches.dp_size if plan.program.microbatches is not None else None
    if dp_size != world_size:
        raise ValueError(f"plan was compiled with dp_size={dp_size} but the step runs on "
                         f"{world_size} rank(s): compile with dp_size={world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside [0, {world_size})")
    return rank, world_size


def data_parallel_step(model, plan, inputs: TrajectoryInputs, loss_fn: LossFn | None = None, *,
                       process_group=None, rank: int | None = None,
                       world_size: int | None = None, sync: str = "step", zero_grad: bool = True,
                       gather_metrics: bool = False, time_device: bool = True,
                       **forward_kwargs) -> StepResult:
    """Forward + backward of this rank's slots; FSDP2 sums the gradients over ranks.

    model: a TreeModel, sharded with `fsdp.shard_model` when the world has more than one rank
    (every rank the same weights); plan: compiled with dp_size = world size; inputs:
    `TrajectoryInputs` of all the plan's trajectories (every rank holds all of them; they are
    small); loss_fn: `PPOObjective()` by default. After the call each rank's `.grad` (a shard, for
    a sharded model) holds the gradient of the whole batch's loss (summed over ranks, not
    averaged), added to the gradients from before the call when `zero_grad=False`.
    `forward_kwargs` go to the model (e.g. activation_checkpointing=True). `time_device`
    synchronises the device after each phase so that per-slot times are real (it serialises
    FSDP2's prefetch with compute, so turn it off where speed matters).
    """
    if sync not in SYNC_MODES:
        raise ValueError(f"sync must be one of {SYNC_MODES}, got {sync!r}")
    rank, world_size = _topology(plan, process_group, rank, world_size)
    sharded = isinstance(model, FSDPModule)
    if world_size > 1 and not sharded:
        raise ValueError(f"data_parallel_step on {world_size} ranks needs a model sharded with "
                         "harts_compiler.runtime.fsdp.shard_model (FSDP2 reduces the gradients)")
    loss_fn = PPOObjective() if loss_fn is None else loss_fn
    forest = plan.program.forest
    if list(inputs.trajectory_ids) != list(forest.traj_ids):
        raise ValueError("inputs: trajectory ids differ from the plan's (build them with "
                         "TrajectoryInputs.for_plan(plan, ...))")
    normalisers = inputs.normalisers()
    schedule = slot_schedule(plan, rank)
    forwards = slot_forwards(plan)
    lockstep = world_size > 1
    padding = padding_index(plan) if lockstep else None
    device = _parameter_device(model)
    sync_device = (lambda: torch.cuda.synchronize(device)) if (
        time_device and device.type == "cuda") else (lambda: None)

    if zero_grad:
        model.zero_grad(set_to_none=True)
    step_start = time.perf_counter()
    local_loss = torch.zeros((), dtype=torch.float64, device=device)
    counts = torch.zeros(2, dtype=torch.float64, device=device)  # trajectories, loss tokens
    slots, loss_metrics = [], []
    try:
        for slot, microbatch in enumerate(schedule):
            if sharded:  # "step": one reduce-scatter, in the last slot's backward
                model.set_requires_gradient_sync(sync == "slot" or slot == len(schedule) - 1)
            metrics = SlotMetrics(slot=slot, microbatch=-1 if microbatch is None else microbatch.index)
            pads = forwards[slot] - (0 if microbatch is None else microbatch_forwards(microbatch))
            if microbatch is not None:
                value, stats = _run_microbatch(model, microbatch, inputs, normalisers, loss_fn,
                                               metrics, device, sync_device, forward_kwargs,
                                               pads=pads if lockstep else 0, padding=padding)
                local_loss += value
                counts += torch.tensor([metrics.trajectories, metrics.loss_tokens],
                                       dtype=torch.float64, device=device)
                loss_metrics.append(stats)
            elif lockstep:
                _run_padding(model, padding, pads, forward_kwargs)
                metrics.padding = True
            slots.append(metrics)
    finally:
        if sharded:
            model.set_requires_gradient_sync(True)

    start = time.perf_counter()
    totals = torch.cat([local_loss.reshape(1), counts])
    if world_size > 1:  # loss and coverage sums: three numbers, not gradients
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=process_group)
    sync_device()
    rank_metrics = RankMetrics(rank=rank, slots=slots, reduce_s=time.perf_counter() - start,
                               total_s=time.perf_counter() - step_start)
    _check_coverage(totals, forest.num_trajectories, inputs)
    all_ranks = None
    if gather_metrics:
        all_ranks = [rank_metrics]
        if world_size > 1:
            all_ranks = [None] * world_size
            dist.all_gather_object(all_ranks, rank_metrics, group=process_group)
    return StepResult(loss=float(totals[0]), local_loss=float(local_loss),
                      normalisers=normalisers, metrics=rank_metrics, all_ranks=all_ranks,
                      loss_metrics=loss_metrics)


def microbatch_forwards(microbatch) -> int:
    """Forwards (and backwards) a microbatch runs: one per piece when its tree runs as pieces, else one."""
    return max(len(microbatch.piece_tokens), 1)


def slot_forwards(plan) -> list[int]:
    """Per slot, the most forwards any rank's microbatch runs there: every rank runs that many (padding
    forwards fill the difference), then as many backwards, so FSDP2's collectives line up."""
    schedules = [slot_schedule(plan, r) for r in range(plan.program.microbatches.dp_size)]
    return [max((microbatch_forwards(mb) for mb in column if mb is not None), default=1)
            for column in zip(*schedules)]


def padding_index(plan):
    """What a rank runs to join a slot's collectives without work of its own (FSDP2's, expert
    parallelism's): the index of the plan's smallest microbatch that runs whole (the same on every rank:
    the plan is), or a two-token trajectory when every microbatch runs as pieces."""
    whole = [mb for mb in plan.microbatches() if not mb.runs_as_pieces]
    if whole:
        return min(whole, key=lambda mb: (mb.compact_tokens, mb.index)).build_index()
    return trajectory_index([[0, 0]], chunk_size=plan.options.chunk_size, conv_width=plan.options.conv_width)


def _padding_forwards(model, index, count: int, forward_kwargs) -> list[torch.Tensor]:
    """`count` forwards through every parameter, each with a zero loss to backward later (exact zeros)."""
    return [model(index, **forward_kwargs).logprobs.sum() * 0.0 for _ in range(count)]


def _run_padding(model, index, count: int, forward_kwargs) -> None:
    for loss in reversed(_padding_forwards(model, index, count, forward_kwargs)):
        loss.backward()


def _parameter_device(model) -> torch.device:
    """Where the model computes: its parameters' device, or the mesh's device for sharded
    parameters kept in host memory (CPU offload)."""
    param = next(model.parameters())
    mesh = getattr(param, "device_mesh", None)
    if mesh is not None and mesh.device_type != "cpu":
        return torch.device(mesh.device_type, torch.accelerator.current_device_index())
    return param.device


def _run_microbatch(model, microbatch, inputs, normalisers, loss_fn, metrics, device,
                    sync_device, forward_kwargs, *, pads: int = 0, padding=None) -> tuple[torch.Tensor, dict]:
    """Forward, loss, backward of one microbatch, then `pads` padding forwards; the backwards run in reverse
    (padding, then the microbatch's; a tree in pieces backwards piece by piece, last first)."""
    start = time.perf_counter()
    microbatch.check_model(model)
    pieced = microbatch.runs_as_pieces
    # host tables; the model lowers and uploads them in its forward
    index = microbatch.build_chain() if pieced else microbatch.build_index()
    metrics.index_s = time.perf_counter() - start

    start = time.perf_counter()
    if pieced:  # whole rows for the loss; each piece's backward runs on its own below
        output, piece_backward = run_piece_chain_detached(model, index, **forward_kwargs)
    else:
        output, piece_backward = model(index, **forward_kwargs), None
    padding_losses = _padding_forwards(model, padding, pads, forward_kwargs)
    rows = inputs.rows_for(output.trajectory_ids, output.logprobs.shape[1],
                           dtype=output.logprobs.dtype, device=device)
    # both token counts in one host transfer per microbatch
    trajectory_tokens, loss_tokens = torch.stack([
        output.lengths.sum(), loss_mask(output.lengths, output.logprobs.shape[1], rows.response_mask).sum()]).tolist()
    aux_weight = trajectory_tokens / max(normalisers.trajectory_tokens, 1)
    result = loss_fn(output, LossContext(rows=rows, normalisers=normalisers, aux_weight=aux_weight))
    loss, stats = ((result.loss, result.metrics) if isinstance(result, LossOutput) else (result, {}))
    if loss.dim() != 0:
        raise ValueError(f"loss_fn must return a scalar loss, got shape {tuple(loss.shape)}")
    sync_device()
    metrics.forward_s = time.perf_counter() - start

    start = time.perf_counter()
    for padding_loss in reversed(padding_losses):
        padding_loss.backward()
    loss.backward()
    if piece_backward is not None:
        piece_backward.run()
    sync_device()
    metrics.backward_s = time.perf_counter() - start

    metrics.trees = len(microbatch.trees)
    metrics.compact_tokens = microbatch.compact_tokens
    metrics.trajectories = len(output.trajectory_ids)
    metrics.trajectory_tokens = int(trajectory_tokens)
    metrics.loss_tokens = int(loss_tokens)
    return loss.detach().to(torch.float64), {k: float(v) for k, v in stats.items() if v.dim() == 0}


def run_plan(model, plan, *, rank: int | None = None, **forward_kwargs) -> list:
    """Forward every microbatch of `plan` (or of one rank) in (rank, slot) order, in this
    process: the outputs `assemble_rows` puts together (for `harts verify`, tests, debugging)."""
    return [model(mb, **forward_kwargs) for mb in plan.microbatches(rank)]


def assemble_rows(plan, outputs, field: str = "logprobs") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-trajectory `[n_traj, max_len]` rows of `field` ("logprobs" or "entropy") and
    `[n_traj]` lengths, in the plan's trajectory order (input order), from the outputs of its
    microbatches (`run_plan`, or a step's outputs gathered from all ranks).

    Rows of one trajectory are summed over the outputs: a row holds 0 wherever its microbatch
    does not compute the target, so this is right for every row layout the planner produces
    (each trajectory is one row of one microbatch, trees in pieces included; a trajectory must be
    covered exactly once per position, which the lengths check can only partly see).
    Differentiable (a sum of the rows)."""
    forest = plan.program.forest
    position = {tid: j for j, tid in enumerate(forest.traj_ids)}
    lengths = torch.as_tensor(forest.traj_length)
    max_len = int(lengths.max()) if lengths.numel() else 0
    rows = None
    seen = torch.zeros(len(position), dtype=torch.long)
    for out in outputs:
        values = getattr(out, field)
        if rows is None:
            rows = values.new_zeros((len(position), max_len))
        missing = [tid for tid in out.trajectory_ids if tid not in position]
        if missing:
            raise KeyError(f"assemble_rows: trajectory id(s) {missing[:5]} are not in the plan")
        target = torch.as_tensor([position[tid] for tid in out.trajectory_ids], dtype=torch.long)
        padded = torch.nn.functional.pad(values, (0, max_len - values.shape[1]))  # row widths differ
        rows = rows.index_add(0, target.to(values.device), padded)
        if not torch.equal(out.lengths.cpu().long(), lengths[target]):
            raise ValueError("assemble_rows: a row's length differs from its trajectory's")
        seen.index_add_(0, target, torch.ones_like(target))
    if rows is None or bool((seen == 0).any()):
        absent = [forest.traj_ids[j] for j in torch.flatnonzero(seen == 0).tolist()[:5]]
        raise ValueError(f"assemble_rows: no output row for trajectory id(s) {absent}")
    return rows, lengths.to(rows.device)


def _check_coverage(totals: torch.Tensor, num_trajectories: int, inputs: TrajectoryInputs) -> None:
    """Every trajectory must have been a row of exactly one microbatch of one rank, else the
    global normalisers do not match what was computed (all ranks see the same sums and raise
    together, so none hangs)."""
    trajectories, tokens = int(totals[1]), int(totals[2])
    if trajectories != num_trajectories:
        raise RuntimeError(f"data-parallel step: the ranks computed {trajectories} trajectory "
                           f"rows, the plan has {num_trajectories}")
    expected = int(inputs.counted_tokens().sum())
    if tokens != expected:
        raise RuntimeError(f"data-parallel step: the ranks counted {tokens} loss tokens, the "
                           f"plan's normaliser counts {expected}")
