"""Test helpers for the runtime: a naive but valid tree plan, random rollout trees, comparisons.

`naive_tree_index` builds a `MicrobatchIndex` straight from trajectories without the compiler:
every distinct prefix is one compact token (a token-level trie in DFS preorder, first child first);
a chain of first children is one linear-attention sequence; every other child starts a new
sequence at its aligned boundary, replays its ancestors from there, and starts from the state the
sequence that computed position boundary-1 exports — one round deeper than that sequence (not the
minimum number of rounds, which is the compiler's job, but every runtime path is exercised:
replay, banks, several rounds, sequences starting from a parent's initial state).

It lets the runtime be tested independently of the compiler; tests that go through
`harts_compiler.compile` live in test_runtime_tree.py.
"""
from __future__ import annotations

import random
from typing import Sequence

import numpy as np
import torch

from harts_compiler.codegen import LaunchPlan, LaunchTarget, LinearRound, MicrobatchIndex, lower


def _trie(token_lists):
    """Token-level trie: per compact token (DFS preorder) parent, token, position, multiplicity."""
    children: list[dict[int, int]] = [{}]  # node 0 = virtual root
    token, count = [-1], [0]
    ends = []
    for seq in token_lists:
        node = 0
        for t in seq:
            nxt = children[node].get(int(t))
            if nxt is None:
                nxt = len(token)
                children[node][int(t)] = nxt
                children.append({})
                token.append(int(t))
                count.append(0)
            count[nxt] += 1
            node = nxt
        ends.append(node)
    # DFS preorder with children in insertion order (the first child continues the sequence)
    order, parent_of, stack = [], {}, [(c, 0) for c in reversed(list(children[0].values()))]
    while stack:
        node, parent = stack.pop()
        parent_of[node] = parent
        order.append(node)
        stack.extend((c, node) for c in reversed(list(children[node].values())))
    compact = {node: i for i, node in enumerate(order)}
    parent = np.array([compact[parent_of[n]] if parent_of[n] else -1 for n in order], dtype=np.int64)
    first_child = np.full(len(order), -1, dtype=np.int64)
    for n in order:
        kids = list(children[n].values())
        if kids:
            first_child[compact[n]] = compact[kids[0]]
    return (parent, np.array([token[n] for n in order]), np.array([count[n] for n in order]), first_child,
            [compact[e] for e in ends])


def naive_tree_index(token_lists: Sequence[Sequence[int]], ids=None, *, chunk_size: int = 64,
                     conv_width: int = 4) -> MicrobatchIndex:
    C = chunk_size
    parent, token_ids, multiplicity, first_child, traj_end = _trie(token_lists)
    T = len(parent)
    position = np.zeros(T, dtype=np.int64)
    for i in range(T):  # preorder: parents come first
        position[i] = position[parent[i]] + 1 if parent[i] >= 0 else 0
    subtree_end = np.arange(1, T + 1)
    for i in reversed(range(T)):
        if parent[i] >= 0:
            subtree_end[parent[i]] = max(subtree_end[parent[i]], subtree_end[i])

    def ancestor_at(i, pos):  # the token at position `pos` on i's path
        while position[i] > pos:
            i = parent[i]
        return i

    conv_pred = np.full((T, conv_width - 1), -1, dtype=np.int64)
    for i in range(T):
        for j in range(conv_width - 1):
            pos = position[i] - (conv_width - 1) + j
            if pos >= 0:
                conv_pred[i, j] = ancestor_at(i, pos)

    # sequences: chains of first children; start = a token that is not its parent's first child
    seq_of_own = np.full(T, -1, dtype=np.int64)
    sequences = []  # dicts: start position sigma, replay list, own range, init (seq, offset) or None
    for s in range(T):
        if parent[s] >= 0 and first_child[parent[s]] == s:
            continue
        own_end = s + 1
        while first_child[own_end - 1] == own_end:
            own_end += 1
        sigma = (position[s] // C) * C
        replay = [ancestor_at(parent[s], p) for p in range(sigma, position[s])]
        init = None
        if sigma > 0:
            source = seq_of_own[ancestor_at(parent[s], sigma - 1)]
            init = (int(source), int(sigma - sequences[source]["sigma"]))
        rnd = 0 if init is None else sequences[init[0]]["round"] + 1
        seq_of_own[s:own_end] = len(sequences)
        sequences.append(dict(sigma=sigma, replay=replay, own=(s, own_end), init=init, round=rnd))

    # bank ids in round order, one per distinct exported (sequence, offset)
    exports = sorted({seq["init"] for seq in sequences if seq["init"] is not None},
                     key=lambda e: (sequences[e[0]]["round"], e))
    bank_of = {e: b for b, e in enumerate(exports)}
    rounds = []
    for r in range(max(seq["round"] for seq in sequences) + 1):
        members = [n for n, seq in enumerate(sequences) if seq["round"] == r]
        local = {n: j for j, n in enumerate(members)}
        cu, row_src, own_rows, own_dst, init_state = [0], [], [], [], []
        for n in members:
            seq = sequences[n]
            start = len(row_src)
            row_src += seq["replay"]
            own_rows += list(range(len(row_src), len(row_src) + seq["own"][1] - seq["own"][0]))
            own_dst += list(range(*seq["own"]))
            row_src += list(range(*seq["own"]))
            cu.append(len(row_src))
            init_state.append(bank_of[seq["init"]] if seq["init"] is not None else -1)
            assert len(row_src) - start > 0
        mine = [e for e in exports if e[0] in local]
        as_long = lambda values: torch.tensor(values, dtype=torch.long)
        rounds.append(LinearRound(
            cu_seqlens=torch.tensor(cu, dtype=torch.int32), row_src=as_long(row_src), own_rows=as_long(own_rows),
            own_dst=as_long(own_dst), init_state=as_long(init_state),
            export_seq=as_long([local[e[0]] for e in mine]), export_offset=as_long([e[1] for e in mine]),
            export_bank=as_long([bank_of[e] for e in mine])))

    # targets: distinct (predicting token, next token) pairs; rows restore every trajectory
    lengths = np.array([len(t) for t in token_lists], dtype=np.int64)
    max_len = int(lengths.max())
    row_pred = np.full((len(token_lists), max_len), -1, dtype=np.int64)
    row_target = np.full_like(row_pred, -1)
    pairs: dict[tuple[int, int], int] = {}
    for r, end in enumerate(traj_end):
        path = [end]
        while parent[path[-1]] >= 0:
            path.append(parent[path[-1]])
        path.reverse()
        for p in range(1, len(path)):
            key = (path[p - 1], int(token_ids[path[p]]))
            row_pred[r, p] = path[p - 1]
            row_target[r, p] = pairs.setdefault(key, len(pairs))
    target_src = [k[0] for k in pairs]
    target_token = [k[1] for k in pairs]
    t = lambda a: torch.as_tensor(np.asarray(a, dtype=np.int64))
    index = MicrobatchIndex(
        trajectory_ids=[str(i) for i in (ids if ids is not None else range(len(token_lists)))],
        token_ids=t(token_ids), positions=t(position), multiplicity=t(multiplicity),
        conv_pred=t(conv_pred).reshape(T, conv_width - 1),
        subtree_end=torch.as_tensor(subtree_end, dtype=torch.int32), rounds=rounds, num_states=len(exports),
        target_src=t(target_src), target_token=t(target_token), row_target=t(row_target), row_pred=t(row_pred),
        lengths=t(lengths), chunk_size=C, conv_width=conv_width)
    index.check()
    return index


def cpu_plan(index: MicrobatchIndex, vocab_size: int = 1 << 20, **target) -> LaunchPlan:
    """`index` lowered for the torch path (or `target`'s kernels) and put on the CPU: what a model's forward reads."""
    return lower(index, LaunchTarget(vocab_size=vocab_size, conv_width=index.conv_width, **target)).to("cpu")


def run_without_device_reads(step) -> None:
    """Run `step` once to compile its kernels, then again with CUDA's sync debug mode raising on any operation
    that makes the host wait for the device."""
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def random_rollout_batch(rng: random.Random, *, vocab: int, n_traj: int, max_len: int) -> list[list[int]]:
    """Agentic-looking trajectories: each new one forks an earlier one at a random point (or is a
    prefix / duplicate of it), so trees with shared prefixes, prefixes and duplicates all appear."""
    root = [rng.randrange(vocab) for _ in range(rng.randint(1, max_len))]
    batch = [root]
    for _ in range(n_traj - 1):
        base = rng.choice(batch)
        kind = rng.random()
        if kind < 0.1:
            batch.append(list(base))  # duplicate
        elif kind < 0.2:
            batch.append(base[:rng.randint(1, len(base))])  # prefix
        else:
            cut = rng.randint(0, len(base))
            batch.append(base[:cut] + [rng.randrange(vocab) for _ in range(rng.randint(1, max(1, max_len - cut)))])
    return batch


# -- sanity tests of the helper itself ------------------------------------------------------------

def test_naive_index_restores_every_trajectory():
    rng = random.Random(3)
    for chunk in (1, 2, 4, 64):
        batch = random_rollout_batch(rng, vocab=5, n_traj=12, max_len=20)
        index = naive_tree_index(batch, chunk_size=chunk)
        for r, traj in enumerate(batch):
            n = len(traj)
            pred = index.row_pred[r, 1:n]
            assert index.token_ids[pred].tolist() == traj[:-1]
            assert index.target_token[index.row_target[r, 1:n]].tolist() == traj[1:]
            assert index.positions[pred].tolist() == list(range(n - 1))
        assert int(index.multiplicity.sum()) == sum(len(t) for t in batch)


def test_naive_index_sequences_are_aligned_and_replay_is_short():
    rng = random.Random(5)
    batch = random_rollout_batch(rng, vocab=3, n_traj=10, max_len=30)
    index = naive_tree_index(batch, chunk_size=4)
    assert len(index.rounds) > 1  # several rounds actually happen at this chunk size
    for rnd in index.rounds:
        for n in range(rnd.num_sequences):
            rows = rnd.row_src[int(rnd.cu_seqlens[n]):int(rnd.cu_seqlens[n + 1])]
            assert int(index.positions[rows[0]]) % 4 == 0
            assert (index.positions[rows] == index.positions[rows[0]] + np.arange(rows.size)).all()


def per_expert_tensors(name: str, p, gate: str, up: str, down: str) -> dict | None:
    """transformers' fused expert tensors (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`) split back into
    one weight per expert under the checkpoint's own names (e.g. gate_proj/up_proj/down_proj, or w1/w3/w2);
    None for any other parameter."""
    if name.endswith("experts.gate_up_proj"):
        gate_part, up_part = p.chunk(2, dim=1)
        out = {}
        for e in range(p.shape[0]):
            out[name.replace("gate_up_proj", f"{e}.{gate}.weight")] = gate_part[e].contiguous()
            out[name.replace("gate_up_proj", f"{e}.{up}.weight")] = up_part[e].contiguous()
        return out
    if name.endswith("experts.down_proj"):
        return {name.replace("down_proj", f"{e}.{down}.weight"): p[e].contiguous() for e in range(p.shape[0])}
    return None
