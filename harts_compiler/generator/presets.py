"""Seeded generator of agentic RL rollout batches (`harts gen`): the rollout model and presets.

A batch is grown as one global *segment trie*: every segment (system prompt, task statement, model
response, tool output) is a trie node, and a trajectory is the token concatenation of the nodes
on its root-to-node path. Siblings always differ at their first token (drawn excluding the first
tokens already used under that parent), so the trie the compiler's prefix compression rebuilds
from the flat trajectories is exactly the generated one, after merging single-child chains.

One rollout of a task::

    [system prompt] [task statement] (response_k [tool output_k])*  final response

* a response is `thinking + action` (both lognormal lengths); tool outputs are Pareto
  (heavy-tailed) and capped; the final turn has no tool output;
* a rollout ends after a random number of turns or once its context passes `max_context`;
* *tree rollouts*: with probability `fork_prob` a rollout forks from an earlier rollout of the
  same task at one of its turn boundaries (uniform over the fraction range `fork_range` of the
  parent's turns): it shares that prefix and then samples a different response;
* *context edits* (dropped thinking): with probability `edit_prob` per non-final turn, the
  response is emitted as a training trajectory that ends with its thinking, and the rollout goes
  on with the thinking dropped from the context; the later turns then branch off just before that
  response instead of extending the trajectory;
* the rollout's final state is always emitted as one more trajectory.

Trajectory ids: `t{task}-r{rollout}` (the rollout's final trajectory) and
`t{task}-r{rollout}-e{turn}` (a context-edit trajectory ending at that turn's response).

Presets (lengths in tokens, before `scale`; "~LN(m, s)" = lognormal with median m, log-sigma s;
"Pareto(a, x)" = Pareto with shape a and minimum x):

====================  =============  ==============  ===============
parameter             swe            tau2            grpo
====================  =============  ==============  ===============
tasks (default)       16             64              64
rollouts per task     8              8               8
system prompt         ~LN(3000,0.1)  4800 (shared    none
                      per task       by all tasks)
task statement        ~LN(600, 0.5)  ~LN(250, 0.4)   ~LN(600, 0.6)
turns                 10-50          4-12            1
thinking              ~LN(250, 0.8)  ~LN(120, 0.6)   ~LN(1200, 0.7)
action                ~LN(120, 0.6)  ~LN(60, 0.5)    ~LN(300, 0.5)
tool/user output      Pareto(1.3,    Pareto(1.6,     none
                      80) <= 8000    60) <= 1500
max context           65536          32768           32768
fork_prob, range      0.85, .15-.85  0 (independent) 0 (independent)
edit_prob             0.18           0.45            0
compression (target)  5.0-6.2 (5.6)  8-10 (9)        ~1.3 (computed)
====================  =============  ==============  ===============

`swe` is calibrated to the prefix-compression ratio HARTS reports for SWE-bench (about 5.6x),
`tau2` to the ~9x AReaL-DTA reports for tau2-bench. Measured over seeds 0-19 at the default
sizes: swe 5.12-5.97 (mean 5.60), tau2 8.94-9.52 (mean 9.15), grpo 1.30-1.36; at `scale=0.03`
(the tests' size) swe stays within 5.2-6.0 and tau2 (16 tasks) within 8.7-9.5. Compression is
computed over the whole batch (trajectory tokens / distinct prefixes), so the tau2 prompt shared
by all tasks counts once.

`scale` multiplies every length (and `max_context`), so tests and CPU demos make tiny batches
with the same shape; `vocab_size` (default 151936, Qwen's) bounds the token ids.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

QWEN_VOCAB_SIZE = 151936


@dataclass(frozen=True)
class LogNormal:
    median: float
    sigma: float

    def draw(self, rng: np.random.Generator, scale: float) -> int:
        return max(1, int(round(self.median * scale * np.exp(self.sigma * rng.standard_normal()))))


@dataclass(frozen=True)
class Pareto:
    shape: float
    minimum: float
    cap: float

    def draw(self, rng: np.random.Generator, scale: float) -> int:
        value = min(self.minimum * (1.0 + rng.pareto(self.shape)), self.cap)
        return max(1, int(round(value * scale)))


@dataclass(frozen=True)
class Preset:
    """All generator parameters (see the module docstring for the meaning of each)."""

    name: str
    tasks: int
    rollouts: int
    system: LogNormal | None
    shared_system: bool
    task: LogNormal
    turns: tuple[int, int]
    thinking: LogNormal
    action: LogNormal
    tool: Pareto | None
    max_context: int
    fork_prob: float
    fork_range: tuple[float, float]
    edit_prob: float
    scale: float = 1.0
    vocab_size: int = QWEN_VOCAB_SIZE


PRESETS: dict[str, Preset] = {
    "swe": Preset(
        name="swe", tasks=16, rollouts=8, system=LogNormal(3000, 0.1), shared_system=False,
        task=LogNormal(600, 0.5), turns=(10, 50), thinking=LogNormal(250, 0.8),
        action=LogNormal(120, 0.6), tool=Pareto(1.3, 80, 8000), max_context=65536,
        fork_prob=0.85, fork_range=(0.15, 0.85), edit_prob=0.18),
    "tau2": Preset(
        name="tau2", tasks=64, rollouts=8, system=LogNormal(4800, 0.0), shared_system=True,
        task=LogNormal(250, 0.4), turns=(4, 12), thinking=LogNormal(120, 0.6),
        action=LogNormal(60, 0.5), tool=Pareto(1.6, 60, 1500), max_context=32768,
        fork_prob=0.0, fork_range=(0.0, 0.0), edit_prob=0.45),
    "grpo": Preset(
        name="grpo", tasks=64, rollouts=8, system=None, shared_system=False,
        task=LogNormal(600, 0.6), turns=(1, 1), thinking=LogNormal(1200, 0.7),
        action=LogNormal(300, 0.5), tool=None, max_context=32768,
        fork_prob=0.0, fork_range=(0.0, 0.0), edit_prob=0.0),
}


def resolve_preset(preset: str | Preset, **overrides) -> Preset:
    """A preset by name (or as given) with some fields replaced; unknown names raise ValueError."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"preset: unknown preset {preset!r} (choose from {sorted(PRESETS)})")
        preset = PRESETS[preset]
    names = {f.name for f in dataclasses.fields(Preset)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"overrides: unknown parameter(s) {unknown} (known: {sorted(names)})")
    preset = dataclasses.replace(preset, **overrides)
    if preset.tasks < 1 or preset.rollouts < 1:
        raise ValueError(f"tasks/rollouts: need at least 1 (got {preset.tasks}, {preset.rollouts})")
    if not 1 <= preset.turns[0] <= preset.turns[1]:
        raise ValueError(f"turns: need 1 <= min <= max (got {preset.turns})")
    if not 0 <= preset.fork_prob <= 1 or not 0 <= preset.edit_prob <= 1:
        raise ValueError("fork_prob/edit_prob: probabilities must lie in [0, 1]")
    if not math.isfinite(preset.scale) or preset.scale <= 0 or preset.vocab_size < 2:
        raise ValueError(f"scale/vocab_size: need scale > 0 and vocab_size >= 2 (got scale "
                         f"{preset.scale}, vocab_size {preset.vocab_size})")
    if preset.vocab_size > 2**31:  # token ids are drawn into int32 arrays: larger ones would wrap to negative ids
        raise ValueError(f"vocab_size: at most {2**31:,} (token ids are stored as int32), got {preset.vocab_size:,}")
    if preset.max_context < 1:
        raise ValueError(f"max_context: need at least 1 token, got {preset.max_context}")
    return preset
