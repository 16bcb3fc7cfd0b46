"""Data-parallel execution of a compiled plan: one training step's forward, backward and
gradient reduction over the (rank, slot) schedule of `harts_compiler.compile(..., dp_size=N)`.

Every rank runs the same number of slots, in slot order (ranks proceed in lockstep, as the
planner's cost model assumes); a (rank, slot) without a microbatch is an *empty slot*: the rank
computes nothing there but still takes part in that slot's collectives (with `sync="slot"`), so
no rank ever waits for a collective the others skip.

Per non-empty slot: build the microbatch's index, forward, gather the per-trajectory loss inputs
into the output's row order, loss with batch-global normalisers (known from the plan before any
compute, so no collective is needed for them), backward; local gradients accumulate. Gradients
are then summed over ranks (`dp_reduce.GradientReducer`): once per step (`sync="step"`, default:
fewest collectives) or after every slot (`sync="slot"`: FSDP-like lockstep; each slot's reduction
is launched asynchronously and runs beside the next slot's compute). Both give the same sums up to
rounding order.

Result: with the same weights, the reduced gradients and the global loss equal those of one
process running the whole batch trajectory-wise (tests/test_distributed.py checks it over gloo).

Use (every rank, after `dist.init_process_group`; same plan and inputs everywhere):

    plan = harts_compiler.compile(batch, CompileOptions(dp_size=world, microbatch_tokens=B))
    advantages = group_advantages(rewards, plan.program.forest.traj_ids, groups)   # dp_inputs
    inputs = TrajectoryInputs.for_plan(plan, advantages=advantages, old_logprobs=old)
    result = data_parallel_step(model, plan, inputs, PPOObjective(kl_coef=0.0))
    optimizer.step()          # .grad is the whole batch's gradient on every rank

Split trees (`split-oversize`): every trajectory lies whole in one part, as one row of one
microbatch (shared root paths are recomputed in each part that needs them), so the coverage check
(each trajectory's row once over all ranks and slots), the global normalisers (token-mean over
all target positions, seq-mean over trajectories) and the aux-loss weights (a microbatch's
trajectory tokens = its tokens weighted by multiplicity) need nothing special. `run_plan` and
`assemble_rows` put a plan's microbatch outputs back into `[n_traj, max_len]` rows (verification).

Not here: DDP/FSDP wrappers (a plain all-reduce gives the same sums without DDP's rule that
every rank runs a synchronised backward, which an empty last slot cannot), sharded parameters.
"""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from harts_compiler.objectives import LossOutput, loss_mask

from .dp_inputs import GlobalNormalisers, TrajectoryInputs
from .dp_objective import LossContext, LossFn, PPOObjective
from .dp_reduce import GradientReducer

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
    reduce_s: float = 0.0  # sync="slot": launching this slot's all-reduce + waiting for the previous one

    @property
    def compute_s(self) -> float:
        return self.index_s + self.forward_s + self.backward_s


@dataclasses.dataclass
class RankMetrics:
    rank: int
    slots: list[SlotMetrics]
    reduce_s: float = 0.0  # after the last slot: gradient all-reduce (or the last slot's wait) + loss sums
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
                       world_size: int | None = None, sync: str = "step",
                       bucket_bytes: int = 64 << 20, zero_grad: bool = True,
                       gather_metrics: bool = False, time_device: bool = True,
                       **forward_kwargs) -> StepResult:
    """Forward + backward of this rank's slots and the gradient sum over ranks.

    model: a TreeModel (every rank the same weights); plan: compiled with dp_size = world size;
    inputs: `TrajectoryInputs` of all the plan's trajectories (every rank holds all of them; they
    are small); loss_fn: `PPOObjective()` by default. After the call every rank's `.grad` holds
    the gradient of the whole batch's loss (summed over ranks, not averaged), added to the
    gradients from before the call when `zero_grad=False` (those are taken as already global).
    `forward_kwargs` go to the model (e.g. activation_checkpointing=True). `time_device`
    synchronises the device after each phase so that per-slot times are real; it serialises the
    per-slot reductions of `sync="slot"` with compute, so turn it off where speed matters.
    """
    if sync not in SYNC_MODES:
        raise ValueError(f"sync must be one of {SYNC_MODES}, got {sync!r}")
    rank, world_size = _topology(plan, process_group, rank, world_size)
    loss_fn = PPOObjective() if loss_fn is None else loss_fn
    forest = plan.program.forest
    if list(inputs.trajectory_ids) != list(forest.traj_ids):
        raise ValueError("inputs: trajectory ids differ from the plan's (build them with "
                         "TrajectoryInputs.for_plan(plan, ...))")
    normalisers = inputs.normalisers()
    schedule = slot_schedule(plan, rank)
    device = next(model.parameters()).device
    sync_device = (lambda: torch.cuda.synchronize(device)) if (
        time_device and device.type == "cuda") else (lambda: None)

    params = [p for p in model.parameters() if p.requires_grad]
    # gradients from before the step are already global: set aside so they are not reduced again
    carried = [None if zero_grad else p.grad for p in params]
    for p in params:
        p.grad = None
    reducer = GradientReducer(params, process_group, bucket_bytes) if world_size > 1 else None
    step_start = time.perf_counter()
    local_loss = torch.zeros((), dtype=torch.float64, device=device)
    counts = torch.zeros(2, dtype=torch.float64, device=device)  # trajectories, loss tokens
    slots, loss_metrics = [], []
    for slot, microbatch in enumerate(schedule):
        metrics = SlotMetrics(slot=slot, microbatch=-1 if microbatch is None else microbatch.index)
        if microbatch is not None:
            value, stats = _run_microbatch(model, microbatch, inputs, normalisers, loss_fn,
                                           metrics, device, sync_device, forward_kwargs)
            local_loss += value
            counts += torch.tensor([metrics.trajectories, metrics.loss_tokens],
                                   dtype=torch.float64, device=device)
            loss_metrics.append(stats)
        if reducer is not None and sync == "slot":
            start = time.perf_counter()
            reducer.reduce_slot()  # asynchronous: no device sync, so it overlaps the next slot
            metrics.reduce_s = time.perf_counter() - start
        slots.append(metrics)

    start = time.perf_counter()
    totals = torch.cat([local_loss.reshape(1), counts])
    if reducer is not None:
        reducer.finish() if sync == "slot" else reducer.reduce_in_place()
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=process_group)
    sync_device()
    for p, before in zip(params, carried):
        if before is not None:
            p.grad = before if p.grad is None else p.grad.add_(before)
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


def _run_microbatch(model, microbatch, inputs, normalisers, loss_fn, metrics, device,
                    sync_device, forward_kwargs) -> tuple[torch.Tensor, dict]:
    start = time.perf_counter()
    plan = model.launch_plan(microbatch)  # lowered on the host, uploaded in one copy
    metrics.index_s = time.perf_counter() - start

    start = time.perf_counter()
    output = model(plan, **forward_kwargs)
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
    loss.backward()
    sync_device()
    metrics.backward_s = time.perf_counter() - start

    metrics.trees = len(microbatch.trees)
    metrics.compact_tokens = plan.num_tokens
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
    (after `split-oversize` each trajectory is one row of one microbatch; a trajectory must be
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
