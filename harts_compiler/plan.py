"""`Plan`: a compiled batch — the final Program plus statistics and per-microbatch access."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from harts_compiler.ir import ArtifactError, IRError, Program, format_program, load_hir, write_hir

from .errors import InputError
from .options import CompileOptions

# a saved plan's text starts with this line (then its options as JSON): `Plan.save` writes it, `Plan.load` reads the
# options from it, and `is_saved_plan` tells a plan from a JSONL batch by it
OPTIONS_LINE = "# options "


@dataclass(frozen=True)
class PlannedMicrobatch:
    """One scheduled microbatch: `build_index()` gives its host MicrobatchIndex tables (a TreeModel lowers and
    uploads them); `check_model(model)` refuses a model the plan was not compiled for."""

    program: Program = field(repr=False)
    options: CompileOptions = field(repr=False)
    index: int
    rank: int
    slot: int
    trees: tuple[int, ...]
    compact_tokens: int
    trajectories: int
    rounds: int

    def build_index(self):
        from harts_compiler.codegen.microbatch import build_microbatch_index
        return build_microbatch_index(self.program, self.index)

    @property
    def runs_as_pieces(self) -> bool:
        """Whether this microbatch's tree is larger than the budget and runs as pieces (`cut-pieces`)."""
        return bool(self.piece_tokens)

    def build_chain(self):
        """The `codegen.pieces.PieceChain` of a microbatch that runs as pieces: its tree's pieces in order, the
        microbatch's other trees riding with the smallest piece."""
        from harts_compiler.codegen.pieces import build_piece_chain
        if not self.runs_as_pieces:
            raise ValueError(f"microbatch {self.index} does not run as pieces: use build_index()")
        tree = self.program.pieces.pieced_tree_among(self.trees)
        return build_piece_chain(self.program, tree, riders=[t for t in self.trees if t != tree])

    def check_model(self, model) -> None:
        self.options.check_model(model)

    def summary(self) -> dict:
        return {"rank": self.rank, "slot": self.slot, "compact_tokens": self.compact_tokens,
                "trajectories": self.trajectories, "rounds": self.rounds, "pieces": self.piece_tokens}

    @property
    def piece_tokens(self) -> list[int]:
        """Tokens of each piece when this microbatch's tree runs as pieces (riders counted in the piece they
        run with), else []."""
        pieces = self.program.pieces
        tree = None if pieces is None else pieces.pieced_tree_among(self.trees)
        if tree is None:
            return []
        mine = pieces.of_tree(tree)
        tokens = pieces.piece_tokens[mine]
        forest = self.program.forest
        riders = [t for t in self.trees if t != tree]
        tokens[mine == pieces.rider_piece(tree)] += int((forest.tree_end[riders] - forest.tree_start[riders]).sum())
        return tokens.tolist()


@dataclass(frozen=True)
class Plan:
    program: Program
    options: CompileOptions
    timings: list = field(default_factory=list)
    trajectory_tokens: int = 0
    # trajectory id -> its metadata fields (reward, advantage, old_logprobs, ...; `harts_compiler.metadata`)
    metadata: dict | None = field(default=None, repr=False)

    def microbatches(self, rank: int | None = None) -> list[PlannedMicrobatch]:
        """Scheduled microbatches (ordered by rank, slot), all or those of one rank."""
        program = self.program
        mbs, forest, seqs = program.microbatches, program.forest, program.sequences
        if mbs is None:
            raise ValueError("plan has no microbatches (compiled without the schedule pass)")
        tree_tokens = forest.tree_end - forest.tree_start
        traj_tree = forest.node_tree[forest.traj_end_node]
        out = []
        for m in range(mbs.num_microbatches):
            if rank is not None and int(mbs.mb_rank[m]) != rank:
                continue
            trees = mbs.trees_of(m)
            out.append(PlannedMicrobatch(
                program=program, options=self.options, index=m, rank=int(mbs.mb_rank[m]), slot=int(mbs.mb_slot[m]),
                trees=tuple(trees.tolist()), compact_tokens=int(tree_tokens[trees].sum()),
                trajectories=int(np.isin(traj_tree, trees).sum()),
                rounds=int(seqs.tree_rounds[trees].max()) if seqs is not None else 0))
        return out

    @cached_property  # a plan does not change: its statistics are computed once, however often they are read
    def stats(self) -> dict:
        forest, seqs = self.program.forest, self.program.sequences
        compact = forest.num_tokens
        traj_tokens = int(forest.traj_length.sum())
        stats = {
            "trajectories": forest.num_trajectories,
            "trees": forest.num_trees,
            "nodes": forest.num_nodes,
            "trajectory_tokens": traj_tokens,
            "compact_tokens": compact,
            "compression": round(traj_tokens / compact, 4) if compact else 0.0,
            "replay_tokens": seqs.replay_tokens if seqs is not None else 0,
            "cut_replay_rows": 0,
            "sequences": seqs.num_sequences if seqs is not None else 0,
            "rounds": int(seqs.tree_rounds.max(initial=0)) if seqs is not None else 0,
            "passes": [{"name": name, "ms": round(ms, 3)} for name, ms in self.program.provenance],
            "identity": self.identity,
        }
        # What cut-pieces and schedule reported (pieces, context tokens and replay rows at cuts; the solver's
        # status, objective, lower bound and time); absent when the pass did not run / cut nothing.
        for key, pass_name in (("pieces", "cut-pieces"), ("schedule", "schedule")):
            note = self.program.note(pass_name)
            if note is not None:
                stats[key] = note
        stats["cut_replay_rows"] = stats.get("pieces", {}).get("cut_replay_rows", 0)
        # full attention: a token at depth d attends to d + 1 keys in both modes, so its work shrinks by the
        # ratio of (query, key) pairs, which long branches keep below the token compression
        lengths = forest.traj_length.astype(np.int64)
        traj_pairs = int((lengths * (lengths + 1) // 2).sum())
        tree_pairs = int((forest.token_position.astype(np.int64) + 1).sum())
        stats.update(attention_pairs=tree_pairs, trajectory_attention_pairs=traj_pairs,
                     pair_compression=round(traj_pairs / tree_pairs, 4) if tree_pairs else 0.0)
        # every row the step computes: each distinct token once, plus the linear-attention replay rows
        stats["planned_tokens"] = compact + stats["replay_tokens"] + stats["cut_replay_rows"]
        stats["microbatches"] = ([mb.summary() for mb in self.microbatches()]
                                 if self.program.microbatches is not None else [])
        return stats

    def dump_ir(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        return write_hir(self.program, directory / "plan.hir")

    @cached_property
    def identity(self) -> str:
        """sha256 of what the plan is (options, every record, the token arrays), without the wall-clock fields
        (pass times, solver times) that a saved plan also keeps: the same batch and options give the same
        identity on every run."""
        text, _ = format_program(self.program, "arrays", timings=False)
        metadata = json.dumps(self.metadata, sort_keys=True) if self.metadata else ""
        return hashlib.sha256(f"{self.options.model_dump_json()}\n{metadata}\n{text}".encode()).hexdigest()

    def save(self, path: str | Path) -> Path:
        """Writes the final Program as `.hir` text (its long token arrays in `<path>.npz`, bound to the text by
        their sha256; see `ir.artifact`), the options and the identity in comment header lines."""
        header = f"{OPTIONS_LINE}{self.options.model_dump_json()}\n# identity {self.identity}\n"
        if self.metadata:
            header += f"# metadata {json.dumps(self.metadata, separators=(',', ':'))}\n"
        return write_hir(self.program, path, header=header)

    @classmethod
    def load_input(cls, path: str | Path) -> "Plan":
        """`load` for a command's input: a broken plan text is one InputError line naming the file."""
        try:
            return cls.load(path)  # an ArtifactError names the files itself and reaches the CLI as it is
        except IRError as error:
            raise InputError(f"{path}: {error}") from None

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """A saved plan; `ir.ArtifactError` (naming the files) when its text and arrays do not belong together."""
        program, text = load_hir(path)
        options = _header(text, OPTIONS_LINE, CompileOptions.model_validate)
        metadata = _header(text, "# metadata ", _metadata)
        if program.forest is None:
            raise ArtifactError(f"{path}: an input-stage dump (no forest), not a compiled plan")
        program.verify()
        if options is not None:
            _check_options(options, program)
        known = set(program.forest.traj_ids)
        stray = next((i for i in metadata or () if i not in known), None)
        if stray is not None:
            raise IRError(f"header '# metadata': trajectory {stray!r} is not one of the plan's")
        return cls(program=program, options=options or CompileOptions(),
                   trajectory_tokens=int(program.forest.traj_length.sum()), metadata=metadata)


def _header(text: str, prefix: str, parse):
    """`parse(JSON value)` of the header line starting with `prefix` (None without one); IRError naming the line
    when it is not JSON or `parse` refuses it (ValueError)."""
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith(prefix):
            try:
                return parse(json.loads(line[len(prefix):]))
            except ValueError as error:  # json's errors, pydantic's ValidationError and our own are ValueErrors
                detail = error.errors()[0] if isinstance(error, ValidationError) else None
                reason = (f"field {'.'.join(map(str, detail['loc'])) or '<options>'}: {detail['msg']}" if detail
                          else " ".join(str(error).split()))
                raise IRError(f".hir line {number}: header '{prefix.strip()}': {reason}") from None
        if line.strip() and not line.startswith("#"):
            return None  # the headers come before the first record
    return None


def _metadata(value) -> dict:
    """trajectory id -> its metadata fields, as `Plan.save` writes them."""
    if not isinstance(value, dict) or not all(isinstance(fields, dict) for fields in value.values()):
        raise ValueError("must map each trajectory id to an object of its fields")
    return value


def _check_options(options: CompileOptions, program: Program) -> None:
    """IRError unless the saved options are those the program was compiled with (a hand-edited header)."""
    recorded = {}
    if program.sequences is not None:
        recorded["chunk_size"] = program.sequences.chunk_size
    if program.forest.laid_out:
        recorded["conv_width"] = program.forest.conv_width
    if program.microbatches is not None:
        recorded.update(dp_size=program.microbatches.dp_size,
                        microbatch_tokens=program.microbatches.microbatch_tokens or None)  # 0: no budget
    for name, value in recorded.items():
        if getattr(options, name) != value:
            raise IRError(f"header '{OPTIONS_LINE.strip()}': {name}={getattr(options, name)} but the plan's records "
                          f"were compiled with {name}={value}")


def is_saved_plan(path: str | Path) -> bool:
    """Whether `path` names a saved plan rather than a JSONL batch: a `.hir` file, or any file whose text starts as
    `Plan.save` writes it (`harts compile -o PLAN` takes any name)."""
    path = Path(path)
    if path.suffix == ".hir":
        return True
    if str(path) == "-" or not path.is_file():
        return False
    with open(path, "rb") as handle:
        return handle.read(len(OPTIONS_LINE)) == OPTIONS_LINE.encode()
