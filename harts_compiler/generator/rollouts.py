"""Growing a batch as a segment trie (see `presets` for the rollout model), and its JSONL output."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from harts_compiler.progress import progress

from .presets import Preset, resolve_preset


class _SegmentTrie:
    """Nodes with token arrays; per parent, the set of first tokens its children already use."""

    def __init__(self, rng: np.random.Generator, vocab_size: int):
        self.rng = rng
        self.vocab_size = vocab_size
        self.parent: list[int] = []
        self.tokens: list[np.ndarray] = []
        self.first_tokens: dict[int, set[int]] = {}  # parent (-1 for roots) -> used first tokens
        self.num_tokens = 0

    def draw(self, length: int, parent: int, exclude: tuple[int, ...] = ()) -> np.ndarray:
        """Random tokens whose first token no child of `parent` uses yet (nor any in `exclude`)."""
        if self.num_tokens + length > MAX_COMPACT_TOKENS:  # checked before allocating the segment
            raise ValueError(f"scale/tasks/rollouts: the batch would pass {MAX_COMPACT_TOKENS:,} distinct tokens "
                             "(lower --scale, --tasks or --rollouts)")
        tokens = self.rng.integers(0, self.vocab_size, size=length, dtype=np.int64).astype(np.int32)
        used = self.first_tokens.get(parent, set())
        if len(used | set(exclude)) >= self.vocab_size:
            raise ValueError(f"vocab_size: {self.vocab_size} token ids cannot give "
                             f"{len(used) + 1} siblings distinct first tokens; use a larger vocab")
        while int(tokens[0]) in used or int(tokens[0]) in exclude:
            tokens[0] = self.rng.integers(0, self.vocab_size)
        return tokens

    def add(self, parent: int, tokens: np.ndarray) -> int:
        self.num_tokens += tokens.size
        used = self.first_tokens.setdefault(parent, set())
        if int(tokens[0]) in used:  # an internal error: callers draw with `draw`
            raise AssertionError(f"sibling under node {parent} already starts with {tokens[0]}")
        used.add(int(tokens[0]))
        self.parent.append(parent)
        self.tokens.append(tokens)
        return len(self.parent) - 1

    def add_new(self, parent: int, length: int) -> int:
        return self.add(parent, self.draw(length, parent))


# Generation holds the distinct tokens, and the statistics every trajectory's tokens (a few 8-byte arrays per
# token): a bound that keeps a mistyped --scale from filling the machine's memory (about 4 GB at the bound).
MAX_COMPACT_TOKENS = 100_000_000
MAX_TRAJECTORY_TOKENS = 100_000_000


@dataclass
class _Rollout:
    turn_nodes: list[int]       # context node at the start of each turn (turn 0 = after the task)
    turn_context: list[int]     # context length at the start of each turn


@dataclass(eq=False)
class RolloutBatch:
    """A generated batch as its segment trie; flat trajectories and explicit-tree records are
    built on first use (a large batch's summary never needs the flat token lists)."""

    preset: Preset
    seed: int
    node_parent: list[int] = field(repr=False)
    node_tokens: list[np.ndarray] = field(repr=False)
    ends: list[tuple[str, int]] = field(repr=False)  # (trajectory id, end node), output order

    @cached_property
    def trajectories(self) -> list[tuple[str, np.ndarray]]:
        return [(traj_id, self._path_tokens(node)) for traj_id, node in self.ends]

    @cached_property
    def trees(self) -> list[dict]:
        """JSONL tree records (see `to_tree_records`)."""
        return to_tree_records(self.node_parent, self.node_tokens, self.ends)

    def trajectory_tokens(self) -> int:
        """Tokens of all trajectories, from the trie alone (no flat token lists)."""
        return int(self.tree_summary()["trajectory_tokens"].sum())

    def _path_tokens(self, node: int) -> np.ndarray:
        parts = []
        while node >= 0:
            parts.append(self.node_tokens[node])
            node = self.node_parent[node]
        return np.concatenate(parts[::-1])

    def tree_summary(self) -> dict[str, np.ndarray]:
        """Per tree (root of the trie, creation order): compact tokens, tree-attention pairs
        (sum over compact tokens of position + 1: every token attends its whole path),
        trajectories and trajectory tokens. Used to size planner items without token lists."""
        n = len(self.node_parent)
        parent = np.asarray(self.node_parent, dtype=np.int64)
        length = np.array([len(t) for t in self.node_tokens], dtype=np.int64)
        start = np.zeros(n, dtype=np.int64)  # position of each node's first token
        tree = np.arange(n)
        for node in range(n):  # parents precede children
            if parent[node] >= 0:
                start[node] = start[parent[node]] + length[parent[node]]
                tree[node] = tree[parent[node]]
        roots = np.flatnonzero(parent < 0)
        index = np.searchsorted(roots, tree)
        pairs = length * start + length * (length + 1) // 2
        end_nodes = np.array([node for _, node in self.ends], dtype=np.int64)
        return {
            "compact_tokens": np.bincount(index, weights=length,
                                          minlength=len(roots)).astype(np.int64),
            "attention_pairs": np.bincount(index, weights=pairs, minlength=len(roots)),
            "trajectories": np.bincount(index[end_nodes], minlength=len(roots)),
            "trajectory_tokens": np.bincount(index[end_nodes],
                                             weights=start[end_nodes] + length[end_nodes],
                                             minlength=len(roots)).astype(np.int64),
        }


def generate(preset: str | Preset = "swe", seed: int = 0, *, quiet: bool = True, **overrides) -> RolloutBatch:
    """Generate a batch; the same (preset, seed, overrides) always gives the same batch. `quiet=False` shows a
    progress bar over the tasks on a terminal."""
    cfg = resolve_preset(preset, **overrides)
    if seed < 0:
        raise ValueError(f"seed: need a non-negative integer, got {seed}")
    rng = np.random.default_rng(seed)
    trie = _SegmentTrie(rng, cfg.vocab_size)
    ends: list[tuple[str, int]] = []  # (trajectory id, end node)
    shared_root = -1
    if cfg.system is not None and cfg.shared_system:
        shared_root = trie.add_new(-1, cfg.system.draw(rng, cfg.scale))
    for task in progress(range(cfg.tasks), desc="generating", unit="task", quiet=quiet):
        root = shared_root
        if cfg.system is not None and not cfg.shared_system:
            root = trie.add_new(-1, cfg.system.draw(rng, cfg.scale))
        task_len = cfg.task.draw(rng, cfg.scale)
        task_node = trie.add_new(root, task_len)
        context = task_len + (len(trie.tokens[root]) if root >= 0 else 0)
        rollouts: list[_Rollout] = []
        for r in range(cfg.rollouts):
            ends.extend(_grow_rollout(cfg, rng, trie, rollouts, task_node, context,
                                      f"t{task}-r{r}"))
    return RolloutBatch(cfg, seed, trie.parent, trie.tokens, ends)


def _grow_rollout(cfg: Preset, rng, trie: _SegmentTrie, rollouts: list[_Rollout],
                  task_node: int, task_context: int, name: str) -> list[tuple[str, int]]:
    """Append one rollout (forked or fresh) to `rollouts`; return the trajectories it emits."""
    n_turns = int(rng.integers(cfg.turns[0], cfg.turns[1] + 1))
    rollout = _Rollout([task_node], [task_context])
    forkable = [p for p in rollouts if len(p.turn_nodes) > 1]
    if forkable and rng.random() < cfg.fork_prob:
        parent = forkable[int(rng.integers(len(forkable)))]
        last = len(parent.turn_nodes) - 1
        lo = max(1, int(np.floor(cfg.fork_range[0] * last)))
        hi = max(lo, int(np.ceil(cfg.fork_range[1] * last)))
        turn = int(rng.integers(lo, min(hi, last) + 1))
        rollout = _Rollout(parent.turn_nodes[:turn + 1], parent.turn_context[:turn + 1])
        n_turns = max(n_turns, turn + 1)
    rollouts.append(rollout)
    node, context = rollout.turn_nodes[-1], rollout.turn_context[-1]
    emitted = []
    max_context = cfg.max_context * cfg.scale
    for turn in range(len(rollout.turn_nodes) - 1, n_turns):
        final = turn == n_turns - 1 or context >= max_context or cfg.tool is None
        thinking = cfg.thinking.draw(rng, cfg.scale)
        action = trie.draw(cfg.action.draw(rng, cfg.scale), node)
        edit = not final and rng.random() < cfg.edit_prob
        think = trie.draw(thinking, node, exclude=(int(action[0]),))
        full = trie.add(node, np.concatenate([think, action]))
        if edit:  # the response as trained (with thinking), then the context without it
            emitted.append((f"{name}-e{turn}", full))
            node, context = trie.add(node, action), context + len(action)
        else:
            node, context = full, context + len(think) + len(action)
        if final:
            break
        node = trie.add_new(node, cfg.tool.draw(rng, cfg.scale))
        context += len(trie.tokens[node])
        rollout.turn_nodes.append(node)
        rollout.turn_context.append(context)
    emitted.append((name, node))
    return emitted


def to_tree_records(parent: list[int], tokens: list[np.ndarray],
                    ends: list[tuple[str, int]]) -> list[dict]:
    """Explicit-tree JSONL records, one per root, with single-child chains merged into one node
    (a node is then a maximal run shared by the same trajectories, as the compiler builds it)."""
    n = len(parent)
    children: list[list[int]] = [[] for _ in range(n)]
    for node, p in enumerate(parent):
        if p >= 0:
            children[p].append(node)
    is_end = np.zeros(n, dtype=bool)
    is_end[[node for _, node in ends]] = True
    # A chain continues into the only child of a node no trajectory ends at.
    merged_into = list(range(n))  # node -> first node of its merged run
    for node in range(n):
        p = parent[node]
        if p >= 0 and len(children[p]) == 1 and not is_end[p]:
            merged_into[node] = merged_into[p]  # parents precede children in creation order
    run_tokens: dict[int, list[np.ndarray]] = {}
    for node in range(n):
        run_tokens.setdefault(merged_into[node], []).append(tokens[node])
    roots = [node for node in range(n) if parent[node] < 0]
    tree_of = list(range(n))
    for node in range(n):
        if parent[node] >= 0:
            tree_of[node] = tree_of[parent[node]]
    records = {root: {"id": f"tree{i}", "nodes": [], "trajectories": []}
               for i, root in enumerate(roots)}
    for head in sorted(run_tokens):
        p = parent[head]
        records[tree_of[head]]["nodes"].append({
            "id": head, "parent": None if p < 0 else merged_into[p],
            "tokens": np.concatenate(run_tokens[head]).tolist()})
    for traj_id, node in ends:
        records[tree_of[node]]["trajectories"].append({"id": traj_id, "node": merged_into[node]})
    return [records[root] for root in roots]


def write_jsonl(batch: RolloutBatch, path: str | Path, form: str = "flat", *, quiet: bool = True) -> None:
    """Write `batch` as HARTS input: `flat` = one trajectory per line, `trees` = one explicit tree
    per line (the same trajectories)."""
    if form not in ("flat", "trees"):
        raise ValueError(f"form: expected 'flat' or 'trees', got {form!r}")
    with open(path, "w") as out:
        if form == "flat":
            for traj_id, tokens in progress(batch.trajectories, desc="writing", unit="traj", quiet=quiet):
                out.write(json.dumps({"id": traj_id, "tokens": tokens.tolist()}) + "\n")
        else:
            for record in batch.trees:
                out.write(json.dumps(record) + "\n")
