"""`split-oversize`: cut trees whose compact tokens exceed the microbatch budget into parts."""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from harts_compiler.errors import InputError
from harts_compiler.ir import Forest, Program
from harts_compiler.ir import derive

from .base import Pass
from .layout import lay_out
from .split_exact import SplitBudget, SplitSolve, improve_split
from .split_plan import plan_tree_split


@dataclass(frozen=True)
class SplitOversize(Pass):
    """Laid-out forest -> laid-out forest whose every tree has at most `microbatch_tokens`
    compact tokens (no-op without a budget or when every tree fits).

    A tree that is too large is cut into *parts*: a part is a group of the tree's trajectories
    and holds the prefix tree of exactly those trajectories, i.e. the compact tokens of their
    paths. Nodes on the shared path above a part's subtrees are therefore *recomputed* in every
    part that needs them (the "context"): their logits, hidden states and linear-attention states
    are real tokens of that part's forward, computed exactly as in the unsplit tree. Every
    trajectory lies whole in one part, as one row, so its log-probs, its gradients and its MoE
    routing statistics (each token weighted by its multiplicity *within the part*, i.e. counted
    once per trajectory over the whole batch) are exactly trajectory-wise, and the runtime needs
    nothing new. Nodes that no trajectory of a part ends below are not in that part at all.

    Why not context-only tokens (no targets, multiplicity 0, a trajectory's row spread over the
    parts holding its tokens): that is exact too, but a
    trajectory's log-probs would be split across microbatches (per-sequence losses such as
    seq-mean or sequence-level ratios would see partial rows; the runtime's index check would
    have to accept gaps inside a row) and a cut's first target would live in another part than
    its token. Whole trajectories per part avoid all of that; the price is the lm-head work on
    the recomputed path tokens, which run through every layer of the part anyway.

    Cuts are chosen by `split_plan.plan_tree_split` (bottom-up greedy, documented there) to
    keep the recomputed tokens low: a path context is paid once per part, and a part holds
    several sibling subtrees of one node, or fills its spare room with subtrees of an ancestor.
    Then `split_exact.improve_split` re-solves each tree as a CP-SAT model hinted with the
    greedy (at most as many parts), under `time_limit_s` of deterministic work for all trees:
    a tree's split is then proven optimal, improved, or left greedy (counts in the note).

    Output invariants: `Forest.verify()` of a laid-out forest with `tree_source` (each part's
    source tree; parts of one tree are consecutive);
    trees that fit keep their nodes and names, parts are named "<tree>/<k>"; every tree has at
    most `microbatch_tokens` compact tokens; trajectories keep their ids and order, each ends in
    the part holding it; parts of a tree are numbered by their first trajectory (input order).
    A note records parts, recomputed tokens and what the solver proved.
    InputError when a trajectory alone is longer than the budget (no part can hold it).
    Complexity: O(N log N) Python over the nodes of oversize trees for the plan, O(sum of part
    nodes) to cut, O(T) vectorised for the tokens, plus one `lay_out` of the new forest, plus
    the solver's time limit.
    """

    name = "split-oversize"
    microbatch_tokens: int | None = None  # None or 0 = no limit
    time_limit_s: float = 0.5  # CP-SAT improvement of the greedy cuts, all trees together
    seed: int = 0

    def run(self, program: Program) -> Program:
        forest = program.forest
        self.require(forest is not None and forest.laid_out, "a laid-out forest (run layout)")
        self.require(program.sequences is None, "no sequences yet (splitting renumbers nodes)")
        budget = self.microbatch_tokens or 0
        sizes = forest.tree_end - forest.tree_start
        oversize = np.flatnonzero(sizes > budget) if budget else np.zeros(0, np.int64)
        if oversize.size == 0:
            return program.replace()  # nothing to split: the same parts, a new Program
        _check_trajectory_lengths(forest, budget, oversize)
        report = SplitSolve()
        part_of_traj, part_tree, part_count = _assign_parts(
            forest, budget, oversize, SplitBudget(self.time_limit_s), report, self.seed)
        split = cut_forest(forest, part_of_traj, part_tree, part_count)
        recomputed = split.num_tokens - forest.num_tokens
        note = {"budget": budget, "split_trees": int(oversize.size),
                "parts": int(sum(part_count[t] for t in oversize.tolist())),
                "recomputed_tokens": int(recomputed),
                "compact_tokens_before": forest.num_tokens,
                "recomputed_fraction": round(recomputed / max(forest.num_tokens, 1), 6),
                "trees_optimal": report.trees_optimal, "trees_improved": report.trees_improved,
                "trees_greedy": report.trees_greedy,
                "solver_time_s": round(report.wall_time_s, 4),
                "deterministic": report.deterministic}
        return program.replace(forest=split,
                               notes=program.notes + ((self.name, json.dumps(note)),))


def _check_trajectory_lengths(forest: Forest, budget: int, trees: np.ndarray) -> None:
    """One problem per oversize tree that holds a trajectory longer than the budget."""
    traj_tree = forest.node_tree[forest.traj_end_node]
    problems = []
    for t in trees.tolist():
        mine = np.flatnonzero(traj_tree == t)
        too_long = mine[forest.traj_length[mine] > budget]
        if too_long.size:
            j = int(too_long[np.argmax(forest.traj_length[too_long])])
            more = f" (and {too_long.size - 1} more)" if too_long.size > 1 else ""
            size = int(forest.tree_end[t] - forest.tree_start[t])
            problems.append(f"tree {forest.tree_ids[t]!r}: {size} compact tokens exceed "
                            f"--microbatch-tokens {budget} and cannot be split: its trajectory "
                            f"{forest.traj_ids[j]!r} alone has {int(forest.traj_length[j])} "
                            f"tokens{more} (a part holds whole trajectories)")
    if problems:
        raise InputError(problems)


def _assign_parts(forest: Forest, budget: int, oversize: np.ndarray, clock: SplitBudget,
                  report: SplitSolve, seed: int):
    """Global part id of every trajectory, the source tree of every part, parts per tree."""
    part_count = np.ones(forest.num_trees, np.int64)
    local_part = np.zeros(forest.num_trajectories, np.int64)
    ends = np.bincount(forest.traj_end_node, minlength=forest.num_nodes)
    roots = np.flatnonzero(forest.node_parent < 0)
    children = forest.children()
    # The layout stores subtree ends in tokens; node starts are strictly increasing, so the
    # node-index end is a lookup (no second walk over the node table).
    node_end = np.searchsorted(forest.node_start, forest.node_subtree_end)
    traj_tree = forest.node_tree[forest.traj_end_node]
    for t in oversize.tolist():
        root = int(roots[forest.node_tree[roots] == t][0])
        stop = int(node_end[root])
        owner = plan_tree_split(root, stop, forest.node_parent, forest.node_length,
                                forest.node_position, ends, children, node_end, budget)
        end_nodes = np.flatnonzero(ends[root:stop] > 0)  # local ids
        _, end_part = np.unique(owner[end_nodes], return_inverse=True)
        end_part = improve_split(end_part.astype(np.int64), end_nodes,
                                 forest.node_parent[root:stop] - root,
                                 forest.node_length[root:stop], budget, clock, report, seed)
        trajs = np.flatnonzero(traj_tree == t)
        label = end_part[np.searchsorted(end_nodes, forest.traj_end_node[trajs] - root)]
        # parts numbered in the order of their first trajectory (input order)
        used, first = np.unique(label, return_index=True)
        renumber = np.zeros(int(label.max()) + 1, np.int64)
        renumber[used[np.argsort(first, kind="stable")]] = np.arange(used.size)
        local_part[trajs] = renumber[label]
        part_count[t] = used.size
    first_part = derive.exclusive_cumsum(part_count)
    part_of_traj = first_part[traj_tree] + local_part
    part_tree = np.repeat(np.arange(forest.num_trees, dtype=np.int64), part_count)
    return part_of_traj, part_tree, part_count


def cut_forest(forest: Forest, part_of_traj: np.ndarray, part_tree: np.ndarray,
               part_count: np.ndarray) -> Forest:
    """The laid-out forest whose trees are the parts: part p holds the union of the root paths
    of its trajectories (`part_of_traj`), with chains of nodes that no longer branch or end a
    trajectory merged into one node (canonical form)."""
    parents = forest.node_parent.tolist()
    n_parts = part_tree.size
    # Nodes of every part: walk up from each end node until a node already in the part.
    members: list[set[int]] = [set() for _ in range(n_parts)]
    for part, end in zip(part_of_traj.tolist(), forest.traj_end_node.tolist()):
        seen, v = members[part], end
        while v >= 0 and v not in seen:
            seen.add(v)
            v = parents[v]
    ends = np.bincount(forest.traj_end_node, minlength=forest.num_nodes)
    owner_part = np.full(forest.num_nodes, -1, np.int64)
    owner_part[forest.traj_end_node] = part_of_traj
    pair_part, pair_node = [], []
    for part, nodes in enumerate(members):
        ordered = sorted(nodes)  # original preorder restricted to a part: a preorder of the part
        pair_part += [part] * len(ordered)
        pair_node += ordered
    pair_part = np.asarray(pair_part, np.int64)
    pair_node = np.asarray(pair_node, np.int64)
    # Kept children per (part, node); a trajectory of the part ends at v iff v's owner is it.
    key = pair_part * forest.num_nodes + pair_node
    parent = forest.node_parent[pair_node]
    parent_key = pair_part * forest.num_nodes + parent
    has_parent = parent >= 0
    kids_keys, kids_count = np.unique(parent_key[has_parent], return_counts=True)
    kept_children = np.zeros(key.size, np.int64)
    kept_children[np.searchsorted(key, kids_keys)] = kids_count  # key is sorted (part, node)
    ends_here = np.where(owner_part[pair_node] == pair_part, ends[pair_node], 0)
    parent_pair = np.searchsorted(key, parent_key)
    safe_parent = np.where(has_parent, parent_pair, 0)
    head = ~has_parent | (kept_children[safe_parent] >= 2) | (ends_here[safe_parent] > 0)
    new_id = np.cumsum(head) - 1  # merged nodes join the preceding head (their parent's chain)
    heads = np.flatnonzero(head)
    node_length = np.bincount(new_id, weights=forest.node_length[pair_node]).astype(np.int64)
    node_parent = np.where(has_parent[heads], new_id[safe_parent[heads]], -1)
    node_position = forest.node_position[pair_node[heads]]
    node_tree = pair_part[heads]
    node_start = derive.exclusive_cumsum(node_length)
    gather = derive.concat_ranges(forest.node_start[pair_node], forest.node_length[pair_node])
    traj_key = part_of_traj * forest.num_nodes + forest.traj_end_node
    traj_end_node = new_id[np.searchsorted(key, traj_key)]
    token_node, token_position = derive.token_node_and_position(node_start, node_length,
                                                                node_position)
    source = forest.tree_source if forest.tree_source is not None else \
        np.arange(forest.num_trees, dtype=np.int64)
    cut = Forest(
        token_ids=forest.token_ids[gather], token_node=token_node, token_position=token_position,
        node_parent=node_parent, node_tree=node_tree, node_start=node_start,
        node_length=node_length, node_position=node_position,
        node_multiplicity=derive.multiplicity(node_parent, node_position, traj_end_node),
        tree_ids=_part_names(forest.tree_ids, part_count), traj_ids=list(forest.traj_ids),
        traj_end_node=traj_end_node, traj_length=forest.traj_length.copy(), laid_out=False,
        tree_source=source[part_tree])
    return lay_out(cut, forest.conv_width)


def _part_names(tree_ids: list[str], part_count: np.ndarray) -> list[str]:
    names = []
    for name, count in zip(tree_ids, part_count.tolist()):
        names += [name] if count == 1 else [f"{name}/{k}" for k in range(count)]
    if len(set(names)) != len(names):  # "/k" collided with a real tree name
        names = [f"{name}@{p}" for p, name in enumerate(names)]
    return names
