"""What `harts verify` found, and the bars it is judged by.

float64 / float32 runs compare tree mode with trajectory-wise training directly: the two compute the same
function and may only differ by floating-point reordering (docs/design.md section 11). bfloat16 / float16 runs
(the Triton and Gluon kernels on a GPU) cannot meet those bars: rounding to 16 bits happens at different points
when the same token is computed once for a whole tree or once per trajectory. There both modes are measured
against a float64 trajectory-wise run of the same weights on the plain-torch kernels, and tree mode passes when
its error is at most `error_factor` times trajectory-wise training's on every measure: the tree step is then as
close to the exact result as the training users would otherwise run.
"""
from __future__ import annotations

import dataclasses

import torch

# (log-prob / entropy max abs diff, gradient max rel diff) of the direct comparison, per dtype.
# fp32 gradients carry ~1e-5 relative reordering noise on wide trees (measured up to 2.1e-5).
BARS = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 5e-5)}
HALF_DTYPES = (torch.bfloat16, torch.float16)
DEFAULT_ERROR_FACTOR = 2.0
# below these, both modes are as exact as the float64 reference can tell (16-bit runs): no ratio is taken
HALF_FLOORS = {"log-prob": 1e-6, "entropy": 1e-6, "gradient": 1e-6}


@dataclasses.dataclass(frozen=True)
class ModeErrors:
    """One 16-bit mode's distance from the float64 reference."""

    logprob: float  # max |log-prob - reference|
    entropy: float  # max |entropy - reference|
    gradient: float  # relative L2 difference over all parameters together
    worst_param: str  # the parameter with the largest relative difference


@dataclasses.dataclass(frozen=True)
class ReferenceErrors:
    """16-bit runs: tree mode's and trajectory-wise training's errors against a float64 trajectory-wise run."""

    tree: ModeErrors
    trajectory: ModeErrors
    factor: float

    def checks(self) -> list[tuple[str, float, float, bool]]:
        """(measure, tree error, trajectory-wise error, passed) per measure."""
        rows = []
        for name, field in (("log-prob", "logprob"), ("entropy", "entropy"), ("gradient", "gradient")):
            tree, traj = getattr(self.tree, field), getattr(self.trajectory, field)
            rows.append((name, tree, traj, tree <= max(self.factor * traj, HALF_FLOORS[name])))
        return rows


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
    aux_diff: float | None  # None: no MoE, or not comparable (several microbatches, see verify.py)
    expert_load_diff: float | None
    grad_rel_diff: float
    worst_param: str
    tree_seconds: float
    trajectory_seconds: float
    on_cpu: bool = True
    trajectory_packs: int = 1  # trajectory-wise microbatches
    estimated_bytes: int = 0  # the memory estimate the run was admitted with
    # (tree mode, trajectory-wise) accumulated gradients by parameter name
    gradients: tuple[dict, dict] | None = dataclasses.field(default=None, repr=False)
    reference: ReferenceErrors | None = None  # both modes against float64 (see `against_reference`)
    # judged against the float64 reference rather than by the direct bars: 16-bit runs, and float32 on a GPU
    # (whose reductions are ordered by the packing: the two modes differ by ~5e-4 in a gradient there)
    against_reference: bool = False

    @property
    def bars(self) -> tuple[float, float]:
        return BARS.get(self.dtype, (1e-2, 5e-2))

    @property
    def passed(self) -> bool:
        if self.against_reference:
            return self.reference is not None and all(ok for *_, ok in self.reference.checks())
        value_bar, grad_bar = self.bars
        values = [self.logprob_diff, self.entropy_diff] + [d for d in (self.aux_diff, self.expert_load_diff)
                                                           if d is not None]
        return max(values) <= value_bar and self.grad_rel_diff <= grad_bar

    def format(self) -> str:
        lines = [
            f"trajectories {self.trajectories}, trajectory tokens {self.trajectory_tokens}, "
            f"compact tokens {self.compact_tokens} (compression {self.trajectory_tokens / self.compact_tokens:.2f}x), "
            f"{self.microbatches} tree microbatch(es), {self.trajectory_packs} trajectory-wise microbatch(es), "
            f"up to {self.rounds} linear-attention round(s), {self.dtype}, estimated peak memory "
            f"{self.estimated_bytes / 2**30:.1f} GiB"]
        direct = [("max |log-prob diff|", self.logprob_diff, 0), ("max |entropy diff|", self.entropy_diff, 0),
                  ("|aux-loss diff|", self.aux_diff, 0), ("max |expert-load diff|", self.expert_load_diff, 0),
                  ("max rel. gradient diff", self.grad_rel_diff, 1)]
        if self.against_reference:
            lines.append("  tree mode against trajectory-wise (rounding differs; not a bar):")
            lines += [f"    {name:24s} {value:.3e}" for name, value, _ in direct if value is not None]
            lines.append(f"  error against a float64 trajectory-wise run of the same weights (bar: tree mode at "
                         f"most {self.reference.factor:g}x trajectory-wise's):" if self.reference else
                         "  no float64 reference was run: nothing verified")
            for name, tree, traj, ok in self.reference.checks() if self.reference else []:
                lines.append(f"    {name:10s} tree {tree:.3e}  trajectory-wise {traj:.3e}  "
                             f"{'ok' if ok else 'MISSED'}" + (f"  (largest relative difference: "
                                                              f"{self.reference.tree.worst_param})"
                                                              if name == "gradient" else ""))
        else:
            for name, value, kind in direct:
                if value is not None:
                    bar = self.bars[kind]
                    lines.append(f"  {name:24s}  {value:.3e}  (bar {bar:.0e}) {'ok' if value <= bar else 'MISSED'}"
                                 + (f"  worst: {self.worst_param}" if kind else ""))
        lines += [
            f"  fwd+bwd wall time: tree {self.tree_seconds * 1e3:.0f} ms, trajectory-wise "
            f"{self.trajectory_seconds * 1e3:.0f} ms, ratio {self.trajectory_seconds / self.tree_seconds:.2f}x"
            + (" (CPU reference ops: per-call overhead, not token work, dominates a tiny model; speed is "
               "measured on the GPU, see BENCHMARKS.md)" if self.on_cpu else ""),
            ("VERIFY FAILED" if not self.passed else "verified: tree mode equals trajectory-wise training"
             if self.reference is None else f"verified: tree mode is as close to float64 as trajectory-wise "
             f"training (within {self.reference.factor:g}x on every measure)"),
        ]
        return "\n".join(lines)
