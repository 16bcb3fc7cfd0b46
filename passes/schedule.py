"""`schedule` (first version): greedy microbatches and (rank, slot) assignment."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts_compiler.errors import InputError
from harts_compiler.ir import Microbatches, Program

from .base import Pass


@dataclass(frozen=True)
class Schedule(Pass):
    """Sequenced program -> + microbatches.

    Work of a tree = its compact tokens. With a token budget (`microbatch_tokens` > 0) trees are
    packed first-fit decreasing into microbatches of at most that many compact tokens, and the
    microbatches go largest first to the least-loaded of the `dp_size` ranks (ties: lowest rank),
    each taking the rank's next slot. Without a budget every rank gets one microbatch: trees go
    largest first to the least-loaded rank. A tree larger than the budget is an InputError for now
    (tree splitting comes with the CP-SAT planner). Trees keep input order inside a microbatch.

    Output invariants (`Microbatches.verify`): every tree in exactly one non-empty microbatch,
    ranks in range, each rank's slots are 0..k-1, budgets respected.
    Complexity: O(n_trees * microbatches) first fit, O(n log n) sorting.
    """

    name = "schedule"
    microbatch_tokens: int | None = None  # None or 0 = no limit
    dp_size: int = 1

    def run(self, program: Program) -> Program:
        budget = self.microbatch_tokens or 0
        forest = program.forest
        self.require(forest is not None and forest.laid_out, "a laid-out forest")
        self.require(self.dp_size >= 1, "dp_size >= 1")
        sizes = (forest.tree_end - forest.tree_start).tolist()
        if budget:
            too_big = [t for t, size in enumerate(sizes) if size > budget]
            if too_big:
                raise InputError([f"tree {forest.tree_ids[t]!r}: {sizes[t]} compact tokens exceed "
                                  f"--microbatch-tokens {budget} (tree splitting "
                                  f"is not implemented yet)" for t in too_big])
            bins = first_fit_decreasing(sizes, budget)
        else:
            bins = [[t] for t in range(len(sizes))]
        ranks, slots, groups = assign_largest_first(bins, sizes, self.dp_size,
                                                    merge_per_rank=not budget)
        ptr = np.zeros(len(groups) + 1, np.int64)
        np.cumsum([len(g) for g in groups], out=ptr[1:])
        microbatches = Microbatches(
            dp_size=self.dp_size, microbatch_tokens=budget,
            mb_rank=np.asarray(ranks, np.int64), mb_slot=np.asarray(slots, np.int64),
            mb_tree_ptr=ptr,
            mb_trees=np.asarray([t for g in groups for t in g], np.int64))
        return program.replace(microbatches=microbatches)


def first_fit_decreasing(sizes: list[int], budget: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for t in sorted(range(len(sizes)), key=lambda t: (-sizes[t], t)):
        for b, load in enumerate(loads):
            if load + sizes[t] <= budget:
                bins[b].append(t)
                loads[b] += sizes[t]
                break
        else:
            bins.append([t])
            loads.append(sizes[t])
    return bins


def assign_largest_first(bins, sizes, dp_size: int, merge_per_rank: bool):
    """(rank, slot, trees) per microbatch, ordered by (rank, slot). With merge_per_rank every
    rank's bins become its single microbatch."""
    load = [0] * dp_size
    per_rank: list[list[list[int]]] = [[] for _ in range(dp_size)]
    bin_size = [sum(sizes[t] for t in b) for b in bins]
    for b in sorted(range(len(bins)), key=lambda b: (-bin_size[b], min(bins[b]))):
        rank = min(range(dp_size), key=lambda r: (load[r], r))
        load[rank] += bin_size[b]
        per_rank[rank].append(sorted(bins[b]))
    ranks, slots, groups = [], [], []
    for rank, rank_bins in enumerate(per_rank):
        if merge_per_rank and rank_bins:
            rank_bins = [sorted(t for b in rank_bins for t in b)]
        for slot, trees in enumerate(rank_bins):
            ranks.append(rank)
            slots.append(slot)
            groups.append(trees)
    return ranks, slots, groups
