"""Cost model of one microbatch's forward + backward on the GPU (docs/design.md section 9).

A small linear model over what the plan already knows about a microbatch, so the planner can
balance microbatches and ranks without running anything:

    time_ms = sum_term coefficient[term] * column[term](features, layer counts)

Microbatch features (`MicrobatchFeatures`, from a Program + trees, a Plan's microbatch, or a
`MicrobatchIndex`; `tree_features` gives them per tree, vectorised, for planner items):

* `compact_tokens`: every compact token once. These are also the *non-replay* rows of the
  linear-attention calls: each compact token is an own row exactly once (INTERFACES.md 2);
* `replay_tokens`: extra packed rows (ancestor tokens re-read after a mid-chunk branch);
* `sequences`, `rounds`: varlen sequences and packed linear-attention calls per GDN layer;
* `chunk_depth`: sum over rounds of the longest sequence's chunks, the serial length of the state
  scan (with few long sequences the scan, not the FLOPs, sets a round's time);
* `attention_pairs`: (query, key) pairs the tree mask allows = sum over tokens of position + 1;
* `trajectories`, `trajectory_tokens`: the log-prob output rows (informational, not a term).

Terms (columns; `L_lin`, `L_full` = linear- and full-attention layer counts of the model; each
layer's MLP/MoE is part of its kind's per-token term because every layer has one):

    linear_token       L_lin  * compact_tokens    GDN projections, conv, kernel, layer MLP/MoE
    linear_replay      L_lin  * replay_tokens     gathers and kernel rows of replayed tokens
    linear_sequence    L_lin  * sequences         per-sequence kernel work (states in/out)
    linear_round       L_lin  * rounds            per-call launches and gathers
    linear_chunk_depth L_lin  * chunk_depth       the state scan's serial chunk steps
    full_token         L_full * compact_tokens    attention projections, layer MLP/MoE
    full_pair          L_full * attention_pairs   tree attention
    head_token         compact_tokens             embedding, final norm, lm_head + log-softmax
    microbatch         1                          per-microbatch fixed cost (host, index)

Fitted coefficients (ms per unit) live in a JSON data file with the device and date they were
fitted on (`bench/calibrate.py` writes it; the repository holds one per GPU beside this file,
`cost_model_h200.json` and `cost_model_h100.json`, and reads the one of the GPU the process runs on, H200's in a
process that has not started CUDA). Without a fit, `default_cost_model()` gives rough guesses for the ~2B
Qwen3-Next-like benchmark model on an H200, derived from FLOP counts at an assumed efficiency (`source` says
"default"): good for relative planning, not for absolute times.

Note for planners: a microbatch's rounds and chunk depth are maxima over its trees, not sums, so
per-tree costs (`predict(tree_features(...))`) overestimate those two terms for a packed
microbatch; they are small next to the token terms at realistic sizes.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harts_compiler.ir import derive

# The repository's fits, by a marker of the GPU's name (torch.cuda.get_device_name()); DEFAULT_PATH serves a
# GPU without its own fit and a process that runs on none (`harts compile` plans for H200-class nodes by default).
COMMITTED_FITS = {"H100": "cost_model_h100.json", "H200": "cost_model_h200.json"}
DEFAULT_PATH = Path(__file__).with_name(COMMITTED_FITS["H200"])

FEATURE_NAMES = ("compact_tokens", "replay_tokens", "sequences", "rounds", "chunk_depth",
                 "attention_pairs", "trajectories", "trajectory_tokens", "microbatches")

# term -> (layer multiplier: "linear" | "full" | None, feature or None for the constant 1)
TERMS: dict[str, tuple[str | None, str | None]] = {
    "linear_token": ("linear", "compact_tokens"),
    "linear_replay": ("linear", "replay_tokens"),
    "linear_sequence": ("linear", "sequences"),
    "linear_round": ("linear", "rounds"),
    "linear_chunk_depth": ("linear", "chunk_depth"),
    "full_token": ("full", "compact_tokens"),
    "full_pair": ("full", "attention_pairs"),
    "head_token": (None, "compact_tokens"),
    "microbatch": (None, "microbatches"),
}

# Rough ms-per-unit guesses for the benchmark model (hidden 2048, 32 experts top-4 + shared
# expert, GDN 16x128 keys / 32x128 values, attention 16 heads of 256, vocab 151936) on an H200,
# with activation recomputation (forward twice + backward). Token terms: 4x the forward FLOPs of
# the layer's active parameters at ~300 TFLOP/s; pairs: 16 heads x 256 x 4 FLOPs x 4.5 at the
# same rate; the head: 4 lm_head matmuls; overhead terms: a few kernel launches each.
DEFAULT_COEFFICIENTS = {
    "linear_token": 1.5e-3, "linear_replay": 2e-4, "linear_sequence": 1e-4, "linear_round": 0.3,
    "linear_chunk_depth": 5e-3, "full_token": 1.2e-3, "full_pair": 2.5e-7, "head_token": 6e-3,
    "microbatch": 20.0,
}


class CostModelError(ValueError):
    """A cost-model file or argument that cannot be used (the message names the field)."""


@dataclass(frozen=True)
class MicrobatchFeatures:
    """Features of one microbatch (ints), or of many (equal-length int arrays, e.g. per tree)."""

    compact_tokens: Any
    replay_tokens: Any
    sequences: Any
    rounds: Any
    chunk_depth: Any
    attention_pairs: Any
    trajectories: Any
    trajectory_tokens: Any
    microbatches: Any = 1  # forwards run: a tree in pieces pays the per-microbatch constant once per piece

    @property
    def non_replay_tokens(self):
        return self.compact_tokens

    def as_dict(self) -> dict:
        return {name: (getattr(self, name).tolist() if isinstance(getattr(self, name), np.ndarray)
                       else getattr(self, name)) for name in FEATURE_NAMES}


@dataclass(frozen=True)
class LayerCounts:
    linear: int
    full: int

    @classmethod
    def stated(cls, linear: int | None, full: int | None) -> "LayerCounts":
        """The counts of CompileOptions (None: those of the reference model, Qwen3-Next-80B: 36 / 12)."""
        return cls(36 if linear is None else linear, 12 if full is None else full)

    @classmethod
    def of(cls, model_or_config) -> "LayerCounts":
        """From a ModelConfig, a TreeModel (its `.config`) or a sequence of layer types."""
        config = getattr(model_or_config, "config", model_or_config)
        types = list(getattr(config, "layer_types", config))
        unknown = sorted({t for t in types if t not in ("linear_attention", "full_attention")})
        if unknown:
            raise CostModelError(f"layer_types: unknown layer type(s) {unknown}")
        return cls(linear=types.count("linear_attention"), full=types.count("full_attention"))


# -- features ---------------------------------------------------------------------------------

def _chunks(lengths: np.ndarray, chunk_size: int) -> np.ndarray:
    return -(-np.asarray(lengths, np.int64) // chunk_size)


def program_features(program, trees) -> MicrobatchFeatures:
    """Features of the microbatch made of `trees` (tree indices) of a sequenced Program."""
    forest, seqs = program.forest, program.sequences
    if forest is None or not forest.laid_out or seqs is None:
        raise CostModelError("program: needs a laid-out forest and sequences (run replay-min)")
    trees = np.unique(np.asarray(trees, np.int64))
    if trees.size and (trees[0] < 0 or trees[-1] >= forest.num_trees):
        raise CostModelError(f"trees: index out of range [0, {forest.num_trees})")
    starts, ends = forest.tree_start[trees], forest.tree_end[trees]
    # Only the microbatch's tokens (a batch-wide prefix sum would cost O(T) per microbatch).
    positions = forest.token_position[derive.concat_ranges(starts, ends - starts)]
    chosen = np.isin(seqs.seq_tree, trees)
    seq_round = seqs.seq_round[chosen]
    depth = np.zeros(int(seqs.tree_rounds[trees].max(initial=0)), np.int64)
    np.maximum.at(depth, seq_round, _chunks(seqs.seq_length[chosen], seqs.chunk_size))
    traj = np.isin(forest.node_tree[forest.traj_end_node], trees)
    return MicrobatchFeatures(
        compact_tokens=int((ends - starts).sum()),
        replay_tokens=int(np.diff(seqs.replay_ptr)[chosen].sum()),
        sequences=int(chosen.sum()), rounds=int(depth.size), chunk_depth=int(depth.sum()),
        attention_pairs=int((positions + 1).sum()),
        trajectories=int(traj.sum()), trajectory_tokens=int(forest.traj_length[traj].sum()))


def tree_features(program) -> MicrobatchFeatures:
    """Per-tree features of a sequenced Program, as arrays of length n_trees (vectorised)."""
    forest, seqs = program.forest, program.sequences
    if forest is None or not forest.laid_out or seqs is None:
        raise CostModelError("program: needs a laid-out forest and sequences (run replay-min)")
    n = forest.num_trees
    cum_pairs = np.concatenate([[0], np.cumsum(forest.token_position + 1)])
    depth = np.zeros((n, int(seqs.tree_rounds.max(initial=0))), np.int64)
    np.maximum.at(depth, (seqs.seq_tree, seqs.seq_round), _chunks(seqs.seq_length, seqs.chunk_size))
    traj_tree = forest.node_tree[forest.traj_end_node]
    return MicrobatchFeatures(
        compact_tokens=(forest.tree_end - forest.tree_start).astype(np.int64),
        replay_tokens=np.bincount(seqs.seq_tree, weights=np.diff(seqs.replay_ptr),
                                  minlength=n).astype(np.int64),
        sequences=np.bincount(seqs.seq_tree, minlength=n).astype(np.int64),
        rounds=seqs.tree_rounds.astype(np.int64), chunk_depth=depth.sum(axis=1),
        attention_pairs=(cum_pairs[forest.tree_end] - cum_pairs[forest.tree_start]).astype(np.int64),
        trajectories=np.bincount(traj_tree, minlength=n).astype(np.int64),
        trajectory_tokens=np.bincount(traj_tree, weights=forest.traj_length,
                                      minlength=n).astype(np.int64),
        microbatches=np.ones(n, np.int64))


def index_features(index) -> MicrobatchFeatures:
    """Features of a built `MicrobatchIndex` (host tables; tree mode or `trajectory_index`)."""
    rows = own = depth = sequences = 0
    for rnd in index.rounds:
        lengths = np.diff(np.asarray(rnd.cu_seqlens, dtype=np.int64))
        rows += int(lengths.sum())
        own += int(np.asarray(rnd.own_rows).size)
        sequences += int(lengths.size)
        depth += int(_chunks(lengths, index.chunk_size).max(initial=0))
    positions = np.asarray(index.positions, dtype=np.int64)
    return MicrobatchFeatures(
        compact_tokens=int(index.num_tokens), replay_tokens=rows - own, sequences=sequences,
        rounds=len(index.rounds), chunk_depth=depth, attention_pairs=int((positions + 1).sum()),
        trajectories=len(index.trajectory_ids),
        trajectory_tokens=int(np.asarray(index.lengths).sum()))


def chain_features(chain) -> MicrobatchFeatures:
    """Features of a tree run as pieces (a `PieceChain`): its pieces' features summed, one microbatch each, with
    the tree's trajectories. A fit reads the chain's measured time against them: its pieces cannot be timed
    apart (a piece's backward waits for the gradients of the pieces after it)."""
    parts = [index_features(index) for index in chain.indices]
    summed = {name: sum(getattr(f, name) for f in parts) for name in FEATURE_NAMES}
    summed.update(trajectories=len(chain.trajectory_ids), trajectory_tokens=int(np.asarray(chain.lengths).sum()))
    return MicrobatchFeatures(**summed)


def features(source, microbatch=None) -> MicrobatchFeatures:
    """Features of one microbatch. `source`: a MicrobatchIndex; a PieceChain (the sum over its pieces); a
    PlannedMicrobatch; or a Plan / Program with `microbatch` = its scheduled microbatch number, or a sequence of
    tree indices."""
    if hasattr(source, "rounds") and hasattr(source, "positions"):  # MicrobatchIndex
        return index_features(source)
    if hasattr(source, "indices") and hasattr(source, "links"):  # PieceChain
        return chain_features(source)
    if hasattr(source, "trees") and hasattr(source, "program") and microbatch is None:
        return program_features(source.program, source.trees)  # PlannedMicrobatch
    program = getattr(source, "program", source)
    if microbatch is None:
        raise CostModelError("microbatch: give a microbatch number or tree indices for a Program")
    if isinstance(microbatch, (int, np.integer)):
        if program.microbatches is None:
            raise CostModelError("microbatch: the program is not scheduled; pass tree indices")
        if not 0 <= microbatch < program.microbatches.num_microbatches:
            raise CostModelError(f"microbatch: {microbatch} out of range "
                                 f"[0, {program.microbatches.num_microbatches})")
        return program_features(program, program.microbatches.trees_of(int(microbatch)))
    return program_features(program, microbatch)


# -- the model --------------------------------------------------------------------------------

def design_matrix(feature_rows, layer_rows) -> np.ndarray:
    """[n, len(TERMS)] float64 columns for n (features, layer counts) pairs."""
    if len(feature_rows) != len(layer_rows):
        raise CostModelError(f"layer_rows: {len(layer_rows)} entries for {len(feature_rows)} "
                             "feature rows")
    return np.array([[_column(f, layers, term) for term in TERMS]
                     for f, layers in zip(feature_rows, layer_rows)], np.float64).reshape(-1, len(TERMS))


def _column(f: MicrobatchFeatures, layers: LayerCounts, term: str):
    multiplier, feature = TERMS[term]
    value = 1.0 if feature is None else np.asarray(getattr(f, feature), np.float64)
    if multiplier is not None:
        value = value * getattr(layers, multiplier)
    return value


@dataclass(frozen=True)
class CostModel:
    coefficients: dict  # term -> ms per unit
    device: str = "unknown"
    date: str = ""
    source: str = "default"
    model: dict = dataclasses.field(default_factory=dict)  # what it was fitted on
    fit: dict = dataclasses.field(default_factory=dict)  # error statistics of the fit

    def __post_init__(self):
        unknown = sorted(set(self.coefficients) - set(TERMS))
        if unknown:
            raise CostModelError(f"coefficients: unknown term(s) {unknown} (known: {list(TERMS)})")
        for term, value in self.coefficients.items():  # a time per unit: finite and >= 0 (a fit is never below 0)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= sys.float_info.max:
                raise CostModelError(f"coefficients.{term}: must be a finite number >= 0, got {value!r}")

    def predict(self, feats: MicrobatchFeatures, layers: LayerCounts):
        """Predicted fwd+bwd time in ms: a float, or an array for array-valued features."""
        total = 0.0
        for term, coefficient in self.coefficients.items():
            total = total + coefficient * _column(feats, layers, term)
        return float(total) if np.ndim(total) == 0 else np.asarray(total)

    def terms(self, feats: MicrobatchFeatures, layers: LayerCounts) -> dict:
        """Predicted ms per term (where the time is expected to go)."""
        return {term: float(self.coefficients.get(term, 0.0) * _column(feats, layers, term))
                for term in TERMS}

    def to_json(self) -> dict:
        return {"device": self.device, "date": self.date, "source": self.source,
                "units": "ms per unit of each term", "terms": {t: TERMS[t] for t in TERMS},
                "coefficients": dict(self.coefficients), "model": self.model, "fit": self.fit}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    @classmethod
    def from_json(cls, data: dict, source: str = "") -> "CostModel":
        if not isinstance(data, dict) or not isinstance(data.get("coefficients"), dict):
            raise CostModelError(f"{source or 'cost model'}: field coefficients: missing or not an object")
        for name in ("model", "fit"):
            if not isinstance(data.get(name) or {}, dict):
                raise CostModelError(f"{source or 'cost model'}: field {name}: not an object")
        return cls(coefficients=data["coefficients"], device=str(data.get("device", "unknown")),
                   date=str(data.get("date", "")), source=source or str(data.get("source", "")),
                   model=dict(data.get("model") or {}), fit=dict(data.get("fit") or {}))


def default_cost_model() -> CostModel:
    return CostModel(coefficients=dict(DEFAULT_COEFFICIENTS), device="none (uncalibrated guess)",
                     source="default")


def running_gpu_name() -> str | None:
    """The name of the GPU this process runs on, None unless it has started CUDA already. Asking never imports
    torch or starts CUDA: `harts compile` and other planning-only processes stay fast to start and plan with
    DEFAULT_PATH's fit, and a worker forked from a CUDA process does not try to start it again."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return torch.cuda.get_device_name()


def committed_fit_path(gpu_name: str | None = None) -> Path:
    """The repository's fit for the GPU named `gpu_name` (None: the GPU this process runs on), DEFAULT_PATH's for
    any other GPU and without one."""
    name = (gpu_name if gpu_name is not None else running_gpu_name() or "").upper()
    for marker, file in COMMITTED_FITS.items():
        if marker in name:
            return Path(__file__).with_name(file)
    return DEFAULT_PATH


def load_cost_model(path: str | Path | None = None) -> CostModel:
    """The fitted model at `path`; without a path, the repository's fit for the GPU this process runs on
    (`committed_fit_path()`) when it exists, else `default_cost_model()`."""
    if path is None:
        path = committed_fit_path()
        if not path.exists():
            return default_cost_model()
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CostModelError(f"{path}: no such cost-model file") from None
    except json.JSONDecodeError as exc:
        raise CostModelError(f"{path}: invalid JSON ({exc.msg}, line {exc.lineno})") from None
    except OSError as exc:  # a directory, no read permission
        raise CostModelError(f"{path}: cannot read a cost model ({exc.strerror or exc})") from None
    except ValueError as exc:  # not UTF-8, a number of thousands of digits
        raise CostModelError(f"{path}: not a JSON cost model ({exc})") from None
    return CostModel.from_json(data, source=str(path))


def fit_cost_model(feature_rows, layer_rows, times_ms, *, device: str, model: dict | None = None,
                   date: str | None = None) -> CostModel:
    """Least squares on *relative* error (each row divided by its measured time), with
    non-negative coefficients: terms that come out negative are dropped and the rest refitted
    (an active-set loop; a negative per-unit time is never physical, only collinearity).
    Columns that are all zero in the data (e.g. no replay) get coefficient 0."""
    times = np.asarray(times_ms, np.float64)
    X = design_matrix(feature_rows, layer_rows)
    if times.shape != (X.shape[0],) or X.shape[0] == 0:
        raise CostModelError(f"times_ms: need one positive time per feature row "
                             f"({X.shape[0]} rows, {times.shape} times)")
    if not np.all(times > 0):
        raise CostModelError("times_ms: every measured time must be positive")
    A, b = X / times[:, None], np.ones_like(times)
    scale = np.linalg.norm(A, axis=0)
    active = scale > 0
    coef = np.zeros(len(TERMS))
    while active.any():
        cols = np.flatnonzero(active)
        solution = np.linalg.lstsq(A[:, cols] / scale[cols], b, rcond=None)[0] / scale[cols]
        coef[:] = 0.0
        coef[cols] = solution
        if solution.min() >= 0:
            break
        active[cols[np.argmin(solution)]] = False  # drop the most negative term, refit
    return CostModel(coefficients={t: float(c) for t, c in zip(TERMS, coef)}, device=device,
                     date=date or datetime.date.today().isoformat(), source="fit",
                     model=dict(model or {}))


def tree_costs(program, layers: LayerCounts, model: CostModel | None = None) -> np.ndarray:
    """Predicted ms of every tree of a sequenced Program run alone (planner item costs);
    `model` defaults to `load_cost_model()`."""
    model = model or load_cost_model()
    return np.asarray(model.predict(tree_features(program), layers), np.float64).reshape(-1)


def relative_errors(model: CostModel, feature_rows, layer_rows, times_ms) -> np.ndarray:
    """|predicted - measured| / measured for each row."""
    times = np.asarray(times_ms, np.float64)
    predicted = np.array([model.predict(f, l) for f, l in zip(feature_rows, layer_rows)])
    return np.abs(predicted - times) / times
