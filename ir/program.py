"""`Program`: the forest plus what later passes add (sequences/rounds, microbatches, provenance).

Stages: input (`trajectories` only) -> prefix-compress (`forest`, trie) -> layout (laid-out
forest) -> replay-min (`sequences`) -> schedule (`microbatches`). Every structure is numpy
struct-of-arrays; `verify()` checks each present part; `structural_diff` compares two programs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .errors import IRError
from .forest import Forest


@dataclass(frozen=True, eq=False)
class Trajectories:
    """The input batch: trajectory j = tokens[offsets[j]:offsets[j+1]]; groups name input records."""

    tokens: np.ndarray
    offsets: np.ndarray
    ids: list[str]
    groups: list[str]

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)

    def verify(self) -> None:
        n = len(self.ids)
        if self.offsets.shape != (n + 1,) or len(self.groups) != n:
            raise IRError("Trajectories: offsets/groups do not match ids")
        if self.offsets[0] != 0 or self.offsets[-1] != self.tokens.size:
            raise IRError("Trajectories: offsets do not cover tokens")
        if n and np.diff(self.offsets).min() < 1:
            raise IRError("Trajectories: empty trajectory")
        if len(set(self.ids)) != n:
            raise IRError("Trajectories: duplicate ids")
        if self.tokens.size and self.tokens.min() < 0:
            raise IRError("Trajectories: negative token")


@dataclass(frozen=True, eq=False)
class Sequences:
    """replay-min output (docs/INTERFACES.md 2). Sequence ids are global, ordered by tree then by
    own_start; `round` is tree-local. Sequence s: rows = replay[replay_ptr[s]:replay_ptr[s+1]]
    (compact indices at positions [start_position, pos(own_start))) then compact range
    [own_start, own_end). Initial state: exported by `init_seq` at local row offset `init_offset`
    (-1 / 0 for the zero state). Exports: export_offset[export_ptr[s]:export_ptr[s+1]], sorted."""

    chunk_size: int
    seq_tree: np.ndarray
    seq_round: np.ndarray
    seq_start_position: np.ndarray
    seq_own_start: np.ndarray
    seq_own_end: np.ndarray
    seq_init_seq: np.ndarray
    seq_init_offset: np.ndarray
    replay_ptr: np.ndarray
    replay: np.ndarray
    export_ptr: np.ndarray
    export_offset: np.ndarray
    tree_rounds: np.ndarray

    @property
    def num_sequences(self) -> int:
        return int(self.seq_tree.size)

    def replay_of(self, s: int) -> np.ndarray:
        return self.replay[self.replay_ptr[s]:self.replay_ptr[s + 1]]

    def exports_of(self, s: int) -> np.ndarray:
        return self.export_offset[self.export_ptr[s]:self.export_ptr[s + 1]]

    def rows(self, s: int) -> np.ndarray:
        """All packed rows of sequence s as compact indices (replay, then own)."""
        return np.concatenate([self.replay_of(s),
                               np.arange(self.seq_own_start[s], self.seq_own_end[s])])

    @property
    def seq_length(self) -> np.ndarray:
        return np.diff(self.replay_ptr) + self.seq_own_end - self.seq_own_start

    @property
    def replay_tokens(self) -> int:
        return int(self.replay.size)

    def verify(self, forest: Forest) -> None:
        from .verify_sequences import verify_sequences
        verify_sequences(self, forest)


@dataclass(frozen=True, eq=False)
class Pieces:
    """cut-pieces output: trees larger than the budget run as *pieces*, contiguous ranges of their compact
    (preorder) tokens, piece p = [piece_start[p], piece_end[p]) of tree piece_tree[p]; a split tree's pieces
    are consecutive, in compact order, and cover it. Trees without pieces run whole. A piece reads what it
    needs of its path's earlier tokens (attention K/V, linear-attention states, conv inputs) from the
    pieces before it: every token is computed once."""

    budget: int
    piece_tree: np.ndarray
    piece_start: np.ndarray
    piece_end: np.ndarray
    # what a piece reads from the pieces before it (derived from the forest, recorded and verified so a `.hir`
    # shows it): the context keys (its first token's root path: that many tokens' attention K/V per layer) and
    # the linear-attention rows replayed before its first token at the cut (context % chunk size)
    piece_context: np.ndarray
    piece_replay: np.ndarray

    @property
    def num_pieces(self) -> int:
        return int(self.piece_tree.size)

    def of_tree(self, t: int) -> np.ndarray:
        """Piece ids of tree t (empty when it runs whole)."""
        return np.flatnonzero(self.piece_tree == t)

    @property
    def piece_tokens(self) -> np.ndarray:
        """Own compact tokens of each piece."""
        return self.piece_end - self.piece_start

    def rider_piece(self, t: int) -> int:
        """The piece of tree t that whole trees sharing its microbatch run with: its smallest (the first of
        equal ones), which leaves the most room under the budget."""
        mine = self.of_tree(t)
        return int(mine[np.argmin(self.piece_tokens[mine])])

    def pieced_tree_among(self, trees) -> int | None:
        """The tree of `trees` that runs as pieces (a microbatch holds at most one), None if none does."""
        found = [int(t) for t in trees if self.of_tree(int(t)).size]
        return found[0] if found else None

    def verify(self, forest: Forest, chunk_size: int) -> None:
        P = self.num_pieces
        if any(a.shape != (P,) for a in (self.piece_start, self.piece_end, self.piece_context, self.piece_replay)):
            raise IRError("Pieces: array shapes disagree")
        if P == 0:
            return
        if self.piece_tree.min() < 0 or self.piece_tree.max() >= forest.num_trees:
            raise IRError("Pieces: tree out of range")
        if np.any(np.diff(self.piece_tree) < 0):
            raise IRError("Pieces: pieces must be ordered by tree")
        if np.any(self.piece_end <= self.piece_start):
            raise IRError("Pieces: empty piece")
        if self.budget and np.any(self.piece_tokens > self.budget):
            p = int(np.argmax(self.piece_tokens > self.budget))
            raise IRError(f"Pieces: piece {p} holds {int(self.piece_tokens[p])} tokens "
                          f"> budget {self.budget}")
        if self.piece_start.min() < 0 or self.piece_end.max() > forest.num_tokens:
            raise IRError("Pieces: token range out of the forest")
        context = forest.token_position[self.piece_start]
        for name, want in (("context", context), ("replay", context % chunk_size)):
            got = getattr(self, f"piece_{name}")
            if not np.array_equal(got, want):
                p = int(np.flatnonzero(got != want)[0])
                raise IRError(f"Pieces: piece {p} records {name}={int(got[p])}, its first token implies {int(want[p])}")
        for t in np.unique(self.piece_tree).tolist():
            mine = self.of_tree(t)
            starts, ends = self.piece_start[mine], self.piece_end[mine]
            if (mine.size < 2 or starts[0] != forest.tree_start[t] or ends[-1] != forest.tree_end[t]
                    or not np.array_equal(starts[1:], ends[:-1])):
                raise IRError(f"Pieces: the pieces of tree {forest.tree_ids[t]!r} must be two or more "
                              "consecutive ranges covering it")


# Every count, id and token of the IR is an int64 in numpy arrays: input beyond this is refused at the edge (options,
# JSONL, .hir text, saved arrays), not overflowed inside.
INT64_MAX = int(np.iinfo(np.int64).max)

# The most data-parallel ranks a plan may name: far above any real job, low enough that the per-rank tables of the
# schedule and of `harts show` stay small (a mistyped --dp-size is refused, not planned for).
MAX_DP_SIZE = 2**20


@dataclass(frozen=True, eq=False)
class Microbatches:
    """schedule output: microbatch m holds trees mb_trees[mb_tree_ptr[m]:mb_tree_ptr[m+1]] (laid
    out in that order) and runs on data-parallel rank mb_rank[m] as its slot mb_slot[m]. Ranks
    run slots 0..S-1 in lockstep; a rank without a microbatch in a slot has an empty slot there
    (it still joins that slot's collectives), so each (rank, slot) holds at most one. A microbatch holds
    at most one tree that runs as pieces; its other trees (*riders*) run whole, together with that tree's
    `Pieces.rider_piece`, and with it fit the budget."""

    dp_size: int
    microbatch_tokens: int  # 0 = no limit
    mb_rank: np.ndarray
    mb_slot: np.ndarray
    mb_tree_ptr: np.ndarray
    mb_trees: np.ndarray

    @property
    def num_microbatches(self) -> int:
        return int(self.mb_rank.size)

    def trees_of(self, m: int) -> np.ndarray:
        return self.mb_trees[self.mb_tree_ptr[m]:self.mb_tree_ptr[m + 1]]

    def verify(self, forest: Forest, pieces: "Pieces | None" = None) -> None:
        M = self.num_microbatches
        if self.mb_slot.shape != (M,) or self.mb_tree_ptr.shape != (M + 1,):
            raise IRError("Microbatches: array shapes disagree")
        if not np.array_equal(np.sort(self.mb_trees), np.arange(forest.num_trees)):
            raise IRError("Microbatches: every tree must be in exactly one microbatch")
        if M and (self.mb_rank.min() < 0 or self.mb_rank.max() >= self.dp_size):
            raise IRError("Microbatches: rank out of range")
        if M and self.mb_slot.min() < 0:
            raise IRError("Microbatches: negative slot")
        cells = self.mb_rank * (int(self.mb_slot.max(initial=0)) + 1) + self.mb_slot
        if np.unique(cells).size != M:
            raise IRError("Microbatches: two microbatches on one (rank, slot)")
        slots = int(self.mb_slot.max(initial=-1)) + 1  # more slots than microbatches: one is unused
        if slots > M or not np.array_equal(np.unique(self.mb_slot), np.arange(slots)):
            raise IRError("Microbatches: a slot that no rank uses")
        if np.any(np.diff(self.mb_tree_ptr) < 1):
            raise IRError("Microbatches: empty microbatch")
        if self.microbatch_tokens:
            sizes = forest.tree_end - forest.tree_start
            pieced = np.zeros(forest.num_trees, bool) if pieces is None else np.isin(
                np.arange(forest.num_trees), pieces.piece_tree)
            for m in range(M):
                trees = self.trees_of(m)
                if pieced[trees].any():
                    if pieced[trees].sum() > 1:
                        raise IRError(f"Microbatches: microbatch {m} holds two trees that run as pieces")
                    t = int(trees[pieced[trees]][0])
                    p = pieces.rider_piece(t)
                    total = int(sizes[trees[~pieced[trees]]].sum() + pieces.piece_tokens[p])
                    if total > self.microbatch_tokens:
                        raise IRError(f"Microbatches: microbatch {m}: the trees riding with piece {p} of tree "
                                      f"{forest.tree_ids[t]!r} make {total} compact tokens > budget "
                                      f"{self.microbatch_tokens}")
                    continue  # the other pieces are checked against the budget by Pieces.verify
                total = int(sizes[self.trees_of(m)].sum())
                if total > self.microbatch_tokens:
                    raise IRError(f"Microbatches: microbatch {m} holds {total} compact tokens "
                                  f"> budget {self.microbatch_tokens}")


@dataclass(frozen=True, eq=False)
class Program:
    trajectories: Trajectories | None = None
    forest: Forest | None = None
    sequences: Sequences | None = None
    pieces: Pieces | None = None
    microbatches: Microbatches | None = None
    # (pass name, milliseconds) of every pass that produced this program, in order.
    provenance: tuple[tuple[str, float], ...] = ()
    # (pass name, JSON object text): what a pass reports about its own work (e.g. the split's
    # recomputed tokens, the schedule solver's status/objective/bound/time), in pass order.
    notes: tuple[tuple[str, str], ...] = ()

    def note(self, pass_name: str) -> dict | None:
        """The last note of `pass_name` as a dict, or None."""
        import json
        found = [text for name, text in self.notes if name == pass_name]
        return json.loads(found[-1]) if found else None

    def replace(self, **changes) -> "Program":
        return dataclasses.replace(self, **changes)

    @property
    def stage(self) -> str:
        if self.microbatches is not None:
            return "scheduled"
        if self.sequences is not None:
            return "sequenced"
        if self.forest is not None:
            return "laid-out" if self.forest.laid_out else "compressed"
        return "input"

    def verify(self, unchanged_from: "Program | None" = None) -> None:
        """Check every invariant of every present part. With `unchanged_from` (an already
        verified Program), parts that are the very same objects there — and whose inputs are
        too — are not checked again (the pass manager uses this between passes)."""
        same = (lambda name: unchanged_from is not None
                and getattr(unchanged_from, name) is getattr(self, name))
        if self.trajectories is not None and not same("trajectories"):
            self.trajectories.verify()
        if self.forest is not None and not same("forest"):
            self.forest.verify()
        if self.sequences is not None:
            if self.forest is None or not self.forest.laid_out:
                raise IRError("Program: sequences need a laid-out forest")
            if not (same("sequences") and same("forest")):
                self.sequences.verify(self.forest)
        if self.pieces is not None:
            if self.sequences is None:
                raise IRError("Program: pieces need sequences")
            if not (same("pieces") and same("forest")):
                self.pieces.verify(self.forest, self.sequences.chunk_size)
        if self.microbatches is not None:
            if self.forest is None or not self.forest.laid_out:
                raise IRError("Program: microbatches need a laid-out forest")
            if not (same("microbatches") and same("forest") and same("pieces")):
                self.microbatches.verify(self.forest, self.pieces)
            if self.pieces is not None and self.pieces.budget != self.microbatches.microbatch_tokens:
                raise IRError(f"Program: the pieces were cut for a budget of {self.pieces.budget} tokens, the "
                              f"microbatches have microbatch_tokens={self.microbatches.microbatch_tokens}")
        if self.forest is None and self.trajectories is None:
            raise IRError("Program: empty (neither trajectories nor forest)")


def structural_diff(a, b, path: str = "program") -> str | None:
    """None when a and b are structurally equal, else the path of the first difference."""
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
        if type(a) is not type(b):
            return f"{path}: {type(a).__name__} vs {type(b).__name__}"
        for field in dataclasses.fields(a):
            found = structural_diff(getattr(a, field.name), getattr(b, field.name),
                                    f"{path}.{field.name}")
            if found:
                return found
        return None
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return f"{path}: array vs {type(b).__name__}"
        if a.shape != b.shape or not np.array_equal(a, b):
            return f"{path}: arrays differ ({a.shape} vs {b.shape})"
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: lengths {len(a)} vs {len(b)}"
        for k, (x, y) in enumerate(zip(a, b)):
            found = structural_diff(x, y, f"{path}[{k}]")
            if found:
                return found
        return None
    return None if a == b else f"{path}: {a!r} vs {b!r}"
