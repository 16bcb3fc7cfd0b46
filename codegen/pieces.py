"""The index tables of a split tree's pieces and the links between them (docs/design.md, "Pieces").

A piece is a contiguous range [a, b) of its tree's compact tokens (`cut-pieces`). Its *context* is the root
path of token a; everything it needs from earlier pieces lies on that path:

- attention: the context's K/V (every context key, with its subtree end; the mask does the rest);
- short conv: the inputs of the context tokens its tokens' conv windows reach;
- linear attention: each of its sequences *fragments* starts at a chunk-aligned point with the state there
  and replays the < C path rows before its first token (the alignment rule of the rounds, applied at cuts).

Sequences of the whole tree (`replay-min`) are cut at the piece bounds into fragments; a fragment that
starts at a cut starts at floor(pos/C)*C with the state of its own sequence there. A state is named by
(sequence, aligned position) and resolved to the fragment that produces it (`_resolve`), so a piece's
rounds, exports and carried states are exactly the chunks the unsplit tree computes.

Cost: O(tree tokens) numpy for the restrictions, O(pieces x context nodes + fragments) Python.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .index import LinearRound, MicrobatchIndex, PieceContext
from .microbatch import build_trees_index
from .riders import append_riders


@dataclasses.dataclass
class PieceLinks:
    """Where a piece's carried inputs come from: for each row (in the piece's order) the producing piece (an
    index into the chain) and the row in that piece's `*_out` list."""

    kv: tuple[np.ndarray, np.ndarray]
    conv: tuple[np.ndarray, np.ndarray]
    replay: tuple[np.ndarray, np.ndarray]
    state: tuple[np.ndarray, np.ndarray]


@dataclasses.dataclass
class PieceChain:
    """A split tree's pieces in execution order: index tables and the links between them."""

    tree: int
    indices: list[MicrobatchIndex]
    links: list[PieceLinks]
    trajectory_ids: list[str]  # the tree's trajectories, the order of the assembled rows
    lengths: np.ndarray


def _path_tokens(a: int, token_node, node_parent, node_start) -> np.ndarray:
    """Tree-local tokens on the root path of token a, before a, in order (`node_start` ends with T: laid-out
    nodes are stored back to back, node v holds [node_start[v], node_start[v + 1]))."""
    v = int(token_node[a])
    parts = [np.arange(node_start[v], a)]
    v = int(node_parent[v])
    while v >= 0:
        parts.append(np.arange(node_start[v], node_start[v + 1]))
        v = int(node_parent[v])
    return np.concatenate(parts[::-1]).astype(np.int64)


@dataclasses.dataclass
class _Fragment:
    seq: int  # tree-local sequence
    piece: int
    x: int  # first own token (tree-local)
    y: int  # end of own tokens
    sigma: int  # start position
    replay: np.ndarray  # tree-local replay tokens
    init_key: tuple[int, int] | None  # (sequence, aligned position) of the state it starts from
    exports: dict = dataclasses.field(default_factory=dict)  # offset -> bank id in its piece


def build_piece_chain(program, tree: int, riders=()) -> PieceChain:
    """Index tables and links of the pieces of `tree` (a tree that `cut-pieces` split); the whole trees
    `riders` run in the forward of its `Pieces.rider_piece` (`codegen/riders.py`)."""
    forest, seqs, pieces = program.forest, program.sequences, program.pieces
    mine = pieces.of_tree(tree) if pieces is not None else np.zeros(0, np.int64)
    if mine.size == 0:
        raise ValueError(f"build_piece_chain: tree {tree} does not run as pieces")
    whole = build_trees_index(program, np.asarray([tree]))
    lo = int(forest.tree_start[tree])
    bounds = np.concatenate([pieces.piece_start[mine], pieces.piece_end[mine][-1:]]) - lo
    T = int(bounds[-1])
    C = seqs.chunk_size
    position = forest.token_position[lo:lo + T]
    pred = np.where(forest.token_pred[lo:lo + T] >= 0, forest.token_pred[lo:lo + T] - lo, -1)
    nodes = np.flatnonzero(forest.node_tree == tree)
    node_start = np.append(forest.node_start[nodes] - lo, T)
    token_node = forest.token_node[lo:lo + T] - nodes[0]
    node_parent = np.where(forest.node_parent[nodes] >= 0, forest.node_parent[nodes] - nodes[0], -1)
    piece_of = lambda tokens: np.searchsorted(bounds, tokens, side="right") - 1  # noqa: E731
    k = mine.size

    fragments = _fragments(seqs, tree, lo, bounds, position, pred, C)
    contexts = [_path_tokens(int(bounds[p]), token_node, node_parent, node_start) for p in range(k)]
    conv_ctx, replay_ctx = [], []
    for p in range(k):
        a, b = int(bounds[p]), int(bounds[p + 1])
        preds = whole.conv_pred[a:b]
        conv_ctx.append(np.unique(preds[(preds >= 0) & (preds < a)]))
        reps = [f.replay for f in fragments if f.piece == p]
        reps = np.concatenate(reps) if reps else np.zeros(0, np.int64)
        replay_ctx.append(np.unique(reps[reps < a]))
    states = _assign_states(fragments, k)  # per piece: caller-state keys; fragments get their bank ids

    outputs = {name: [set() for _ in range(k)] for name in ("kv", "conv", "replay")}
    for p in range(k):
        for name, rows in (("kv", contexts[p]), ("conv", conv_ctx[p]), ("replay", replay_ctx[p])):
            for q, token in zip(piece_of(rows).tolist(), rows.tolist()):
                outputs[name][q].add(token)
    out_rows = {name: [np.asarray(sorted(s), np.int64) for s in sets] for name, sets in outputs.items()}
    state_out = [[] for _ in range(k)]  # per producing piece: (fragment id, offset)
    for p in range(k):
        for fid, offset in states[p]:
            if (fid, offset) not in state_out[fragments[fid].piece]:
                state_out[fragments[fid].piece].append((fid, offset))

    indices, links = [], []
    for p in range(k):
        a, b = int(bounds[p]), int(bounds[p + 1])
        index = _piece_index(whole, p, a, b, contexts[p], conv_ctx[p], replay_ctx[p], fragments, states[p],
                             state_out[p], {name: out_rows[name][p] for name in out_rows})
        indices.append(index)

        def source(name, rows):
            producer = piece_of(rows)
            return producer, np.asarray([int(np.searchsorted(out_rows[name][q], t)) for q, t in
                                         zip(producer.tolist(), rows.tolist())], np.int64)
        state_pieces = np.asarray([fragments[f].piece for f, _ in states[p]], np.int64)
        state_rows = np.asarray([state_out[fragments[f].piece].index((f, o)) for f, o in states[p]], np.int64)
        links.append(PieceLinks(kv=source("kv", contexts[p]), conv=source("conv", conv_ctx[p]),
                                replay=source("replay", replay_ctx[p]), state=(state_pieces, state_rows)))
    trajectory_ids, lengths = list(whole.trajectory_ids), whole.lengths
    if len(riders):
        ride = build_trees_index(program, np.asarray(riders, np.int64))
        p = int(np.flatnonzero(mine == pieces.rider_piece(tree))[0])
        indices[p] = append_riders(indices[p], ride)
        trajectory_ids += ride.trajectory_ids
        lengths = np.concatenate([lengths, ride.lengths])
    return PieceChain(tree=tree, indices=indices, links=links, trajectory_ids=trajectory_ids, lengths=lengths)


def _fragments(seqs, tree: int, lo: int, bounds: np.ndarray, position, pred, C: int) -> list[_Fragment]:
    """The tree's sequences cut at the piece bounds, in compact order of their first own token."""
    ids = np.flatnonzero(seqs.seq_tree == tree)
    local = {int(s): i for i, s in enumerate(ids.tolist())}
    out = []
    for i, s in enumerate(ids.tolist()):
        start, end = int(seqs.seq_own_start[s]) - lo, int(seqs.seq_own_end[s]) - lo
        p0 = int(np.searchsorted(bounds, start, side="right")) - 1
        p1 = int(np.searchsorted(bounds, end - 1, side="right")) - 1
        for p in range(p0, p1 + 1):
            x, y = max(start, int(bounds[p])), min(end, int(bounds[p + 1]))
            if x == start:
                init = int(seqs.seq_init_seq[s])
                key = None if init < 0 else (local[init], int(seqs.seq_start_position[init]) +
                                             int(seqs.seq_init_offset[s]))
                out.append(_Fragment(i, p, x, y, int(seqs.seq_start_position[s]),
                                     seqs.replay_of(s).astype(np.int64) - lo, key))
            else:  # starts at a cut: the aligned point before it, replaying its own sequence's rows
                sigma = int(position[x]) // C * C
                replay = []
                t = x
                for _ in range(int(position[x]) - sigma):
                    t = int(pred[t])
                    replay.append(t)
                out.append(_Fragment(i, p, x, y, sigma, np.asarray(replay[::-1], np.int64), (i, sigma)))
    out.sort(key=lambda f: f.x)
    return out


def _resolve(key, fragments: list[_Fragment], by_seq: dict, sigma0: dict):
    """(fragment id, offset) that produces the state `key` = (sequence, aligned position), None = zeros."""
    while key is not None:
        seq, beta = key
        if beta == sigma0[seq]:  # the sequence's own initial state
            first = by_seq[seq][0]
            key = fragments[first].init_key
            continue
        chosen = [f for f in by_seq[seq] if fragments[f].sigma < beta][-1]
        frag = fragments[chosen]
        offset = beta - frag.sigma
        if offset > frag.replay.size + frag.y - frag.x:
            raise AssertionError("pieces: a state beyond its fragment (compiler bug)")
        return chosen, offset
    return None


def _assign_states(fragments: list[_Fragment], k: int) -> list[list[tuple[int, int]]]:
    """Each fragment's source (`src`), round, exports and their bank ids; per piece the states it reads
    from earlier pieces, in first-use order."""
    by_seq: dict[int, list[int]] = {}
    for i, f in enumerate(fragments):
        by_seq.setdefault(f.seq, []).append(i)
    for ids in by_seq.values():
        ids.sort(key=lambda i: fragments[i].x)
    sigma0 = {seq: fragments[ids[0]].sigma for seq, ids in by_seq.items()}
    carried = [[] for _ in range(k)]
    banks = [0] * k
    for i, f in enumerate(fragments):  # compact order: a source precedes the fragments it feeds
        f.src = _resolve(f.init_key, fragments, by_seq, sigma0)
        if f.src is None:
            f.round = 0
            continue
        src_frag = fragments[f.src[0]]
        if src_frag.piece != f.piece:
            if f.src not in carried[f.piece]:
                carried[f.piece].append(f.src)
            f.round = 0
            _export(src_frag, f.src[1], banks)
        else:
            f.round = src_frag.round + 1
            _export(src_frag, f.src[1], banks)
    return carried


def _export(frag: _Fragment, offset: int, banks: list[int]) -> None:
    if offset not in frag.exports:
        frag.exports[offset] = banks[frag.piece]
        banks[frag.piece] += 1


def _piece_index(whole: MicrobatchIndex, p: int, a: int, b: int, context, conv_ctx, replay_ctx, fragments,
                 carried, state_out, out_rows) -> MicrobatchIndex:
    T = b - a
    keys = np.concatenate([context, np.arange(a, b)])
    subtree = np.searchsorted(keys, whole.subtree_end)  # tree-local ends -> the piece's key space
    conv = whole.conv_pred[a:b]
    conv_local = np.where(conv >= a, conv - a, -1)
    from_ctx = (conv >= 0) & (conv < a)
    conv_local[from_ctx] = T + np.searchsorted(conv_ctx, conv[from_ctx])
    conv_pred = np.concatenate([conv_local, np.full((conv_ctx.size, conv.shape[1]), -1, np.int64)])

    def gdn_row(tokens):
        tokens = np.asarray(tokens, np.int64)
        return np.where(tokens >= a, tokens - a, T + np.searchsorted(replay_ctx, tokens))

    mine = [i for i, f in enumerate(fragments) if f.piece == p]
    n_rounds = 1 + max(fragments[i].round for i in mine)
    carried_slot = {key: j for j, key in enumerate(carried)}
    rounds = []
    for r in range(n_rounds):
        members = [fragments[i] for i in mine if fragments[i].round == r]
        rows, own_rows, own_dst, init, e_seq, e_off, e_bank, cu = [], [], [], [], [], [], [], [0]
        for n, f in enumerate(members):
            packed = np.concatenate([gdn_row(f.replay), np.arange(f.x - a, f.y - a)])
            own_rows.append(cu[-1] + f.replay.size + np.arange(f.y - f.x))
            own_dst.append(np.arange(f.x - a, f.y - a))
            rows.append(packed)
            cu.append(cu[-1] + packed.size)
            if f.src is None:
                init.append(-1)
            elif fragments[f.src[0]].piece != p:
                init.append(-2 - carried_slot[f.src])
            else:
                init.append(fragments[f.src[0]].exports[f.src[1]])
            for offset, bank in sorted(f.exports.items()):
                e_seq.append(n)
                e_off.append(offset)
                e_bank.append(bank)
        if r == 0 and replay_ctx.size:  # the carried replay rows, kept by a sequence whose outputs are unused
            rows.append(T + np.arange(replay_ctx.size))
            own_rows.append(cu[-1] + np.arange(replay_ctx.size))
            own_dst.append(T + np.arange(replay_ctx.size))
            cu.append(cu[-1] + replay_ctx.size)
            init.append(-1)
        rounds.append(LinearRound(cu_seqlens=np.asarray(cu), row_src=np.concatenate(rows),
                                  own_rows=np.concatenate(own_rows), own_dst=np.concatenate(own_dst),
                                  init_state=np.asarray(init), export_seq=np.asarray(e_seq, np.int64),
                                  export_offset=np.asarray(e_off, np.int64), export_bank=np.asarray(e_bank, np.int64)))
    num_states = sum(len(f.exports) for f in (fragments[i] for i in mine))

    # log-prob targets whose logits this piece computes (their source token is one of its own)
    has_src = (whole.target_src >= a) & (whole.target_src < b)
    renumber = np.cumsum(has_src) - 1
    row_own = (whole.row_pred >= a) & (whole.row_pred < b)
    rows_kept = np.flatnonzero(row_own.any(axis=1))
    row_pred = np.where(row_own, whole.row_pred - a, -1)[rows_kept]
    row_target = np.where(row_own, renumber[np.maximum(whole.row_target, 0)], -1)[rows_kept]
    context_info = PieceContext(
        kv_subtree_end=subtree[context], conv_rows=int(conv_ctx.size), replay_rows=int(replay_ctx.size),
        num_states=len(carried), kv_out=out_rows["kv"] - a, conv_out=out_rows["conv"] - a,
        replay_out=out_rows["replay"] - a,
        state_out=np.asarray([fragments[f].exports[o] for f, o in state_out], np.int64))
    index = MicrobatchIndex(
        trajectory_ids=[whole.trajectory_ids[r] for r in rows_kept.tolist()],
        token_ids=whole.token_ids[a:b], positions=whole.positions[a:b], multiplicity=whole.multiplicity[a:b],
        conv_pred=conv_pred, subtree_end=subtree[a:b], rounds=rounds, num_states=num_states,
        target_src=whole.target_src[has_src] - a, target_token=whole.target_token[has_src],
        row_target=row_target, row_pred=row_pred, lengths=whole.lengths[rows_kept],
        chunk_size=whole.chunk_size, conv_width=whole.conv_width, context=context_info)
    index.check()
    return index
