"""Scheduled microbatch of a Program -> `MicrobatchIndex` (docs/INTERFACES.md section 3).

All compact indices become local to the microbatch: its trees are concatenated in schedule
order, so a token of tree t moves by the constant `shift[t] = tree_start[t] - local base of t`.
Cost: O(compact tokens + trajectory tokens of the microbatch) vectorised numpy, plus O(sequences)
Python for the round tables.
"""
from __future__ import annotations

import numpy as np

from harts_compiler.ir import derive

from .index import LinearRound, MicrobatchIndex


def build_microbatch_index(program, microbatch) -> MicrobatchIndex:
    """Host index tables of one microbatch. `program`: a Program or Plan (scheduled); `microbatch`: its index
    or a PlannedMicrobatch."""
    program = getattr(program, "program", program)
    m = microbatch if isinstance(microbatch, (int, np.integer)) else microbatch.index
    forest, seqs, mbs = program.forest, program.sequences, program.microbatches
    if forest is None or seqs is None or mbs is None:
        raise ValueError("build_microbatch_index: the program must be laid out, sequenced and "
                         "scheduled (run the full pipeline)")
    trees = mbs.trees_of(int(m))
    if program.pieces is not None and np.isin(trees, program.pieces.piece_tree).any():
        raise ValueError(f"build_microbatch_index: microbatch {int(m)} holds a tree that runs as pieces, which "
                         "read each other's carried state; run it with TreeModel(...)(microbatch) or "
                         "build_piece_chain")
    return build_trees_index(program, trees)


def build_trees_index(program, trees: np.ndarray) -> MicrobatchIndex:
    """The index of `trees` run together as one microbatch (concatenated in the given order)."""
    forest, seqs = program.forest, program.sequences
    tree_len = forest.tree_end[trees] - forest.tree_start[trees]
    base = derive.exclusive_cumsum(tree_len)
    shift = np.zeros(forest.num_trees, np.int64)
    shift[trees] = forest.tree_start[trees] - base
    glob = derive.concat_ranges(forest.tree_start[trees], tree_len)  # global compact index of local token i
    # Every index a token refers to (predecessor, subtree end, replay row) lies in its own tree,
    # so "global -> local" is a subtraction of that tree's shift, repeated per token.
    token_shift = np.repeat(shift[trees], tree_len)

    # --- per-token tables --------------------------------------------------------------------
    token_node = forest.token_node[glob]
    global_pred = forest.token_pred[glob]
    pred = np.where(global_pred >= 0, global_pred - token_shift, -1)
    first_node = np.concatenate([[0], np.flatnonzero(np.diff(token_node) != 0) + 1])
    node_start_local = first_node.astype(np.int64)
    node_length_local = np.diff(np.append(first_node, glob.size)).astype(np.int64)
    conv_pred = derive.conv_predecessors(pred, node_start_local, node_length_local,
                                         forest.conv_width)
    target_src, target_token, token_target = derive.log_prob_targets(pred, forest.token_ids[glob])
    subtree_end = forest.node_subtree_end[token_node] - token_shift

    # --- trajectory rows: [rows, max_len], row-major flat positions ----------------------------
    traj_tree = forest.node_tree[forest.traj_end_node]
    trajs = np.flatnonzero(np.isin(traj_tree, trees))
    lengths = forest.traj_length[trajs]
    run_lo, run_hi = forest.traj_run_ptr[trajs], forest.traj_run_ptr[trajs + 1]
    runs = derive.concat_ranges(run_lo, run_hi - run_lo)
    compact = derive.concat_ranges(forest.run_start[runs], forest.run_length[runs])
    compact -= np.repeat(shift[traj_tree[trajs]], lengths)
    max_len = int(lengths.max(initial=0))
    row_start = derive.exclusive_cumsum(lengths)
    flat = np.repeat(np.arange(trajs.size, dtype=np.int64) * max_len - row_start, lengths)
    flat += np.arange(compact.size, dtype=np.int64)
    previous = np.empty_like(compact)
    previous[1:] = compact[:-1]
    previous[row_start] = -1  # p = 0 has no predecessor (and no target: token_target is -1)
    row_target = np.full((trajs.size, max_len), -1, np.int64)
    row_pred = np.full((trajs.size, max_len), -1, np.int64)
    row_target.ravel()[flat] = token_target[compact]
    row_pred.ravel()[flat] = previous

    rounds, num_states = _rounds(seqs, trees, shift)
    index = MicrobatchIndex(
        trajectory_ids=[forest.traj_ids[j] for j in trajs.tolist()],
        token_ids=forest.token_ids[glob],
        positions=forest.token_position[glob],
        multiplicity=forest.node_multiplicity[token_node],
        conv_pred=conv_pred,
        subtree_end=subtree_end,
        rounds=rounds, num_states=num_states,
        target_src=target_src,
        target_token=target_token,
        row_target=row_target,
        row_pred=row_pred,
        lengths=lengths,
        chunk_size=seqs.chunk_size, conv_width=forest.conv_width)
    return index


def _rounds(seqs, trees: np.ndarray, shift: np.ndarray) -> tuple[list[LinearRound], int]:
    """One LinearRound per round index; a tree's round k runs in the microbatch's round k.
    Exported states get bank ids in execution order (round, then sequence, then offset)."""
    chosen = np.flatnonzero(np.isin(seqs.seq_tree, trees))
    n_rounds = int(seqs.tree_rounds[trees].max(initial=0))
    bank: dict[tuple[int, int], int] = {}
    out = []
    for k in range(n_rounds):
        members = chosen[seqs.seq_round[chosen] == k]
        replay_len = seqs.replay_ptr[members + 1] - seqs.replay_ptr[members]
        own_len = seqs.seq_own_end[members] - seqs.seq_own_start[members]
        seq_len = replay_len + own_len
        cu = np.concatenate([[0], np.cumsum(seq_len)])
        replay_rows = seqs.replay[derive.concat_ranges(seqs.replay_ptr[members], replay_len)]
        # Packed rows: per sequence, its replay rows then its own rows.
        seq_shift = shift[seqs.seq_tree[members]]
        row_src = np.empty(int(cu[-1]), np.int64)
        row_src[derive.concat_ranges(cu[:-1], replay_len)] = replay_rows - np.repeat(seq_shift, replay_len)
        own_rows = derive.concat_ranges(cu[:-1] + replay_len, own_len)
        row_src[own_rows] = derive.concat_ranges(seqs.seq_own_start[members] - seq_shift, own_len)
        own_dst = row_src[own_rows]
        init_state = np.asarray([-1 if s < 0 else bank[(s, o)] for s, o in
                                 zip(seqs.seq_init_seq[members].tolist(),
                                     seqs.seq_init_offset[members].tolist())], np.int64)
        export_seq, export_offset, export_bank = [], [], []
        for i, s in enumerate(members.tolist()):
            for offset in seqs.exports_of(s).tolist():
                bank[(s, offset)] = len(bank)
                export_seq.append(i)
                export_offset.append(offset)
                export_bank.append(bank[(s, offset)])
        out.append(LinearRound(
            cu_seqlens=cu, row_src=row_src,
            own_rows=own_rows, own_dst=own_dst,
            init_state=init_state,
            export_seq=np.asarray(export_seq, np.int64),
            export_offset=np.asarray(export_offset, np.int64),
            export_bank=np.asarray(export_bank, np.int64)))
    return out, len(bank)
