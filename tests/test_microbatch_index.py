"""build_microbatch_index vs a brute-force per-trajectory construction.

Everything is recovered from the index tensors alone and compared with the input trajectories:
each compact token's prefix comes from the tree mask (its ancestors), so tokens, positions,
multiplicities, conv predecessors and log-prob targets are checked against the trajectories; the
rounds are executed with an exact rolling hash as a stand-in linear recurrence (state bank,
replay rows, exports) and every own row's state must equal the trajectory-wise prefix hash.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import harts_compiler as hc
from harts_compiler.codegen.microbatch import build_microbatch_index
from harts_compiler.testing import random_token_lists, token_lists_strategy

MOD = (1 << 61) - 1


def prefix_hash(tokens) -> int:
    state = 0
    for t in tokens:
        state = (state * 1_000_003 + int(t) + 1) % MOD
    return state


def check_index(index, token_lists, ids, chunk_size, conv_width):
    index.check()
    C, W = chunk_size, conv_width
    T = index.num_tokens
    tok = index.token_ids
    pos = index.positions
    end = index.subtree_end.astype(np.int64)
    k, q = np.meshgrid(np.arange(T), np.arange(T))  # k: key (column), q: query (row)
    visible = (k <= q) & (q < end[k])
    prefix, ancestors_by_pos = [], []
    for i in range(T):
        anc = np.flatnonzero(visible[i])
        anc = anc[np.argsort(pos[anc])]
        assert pos[anc].tolist() == list(range(pos[i] + 1)), "ancestors must be one per position"
        assert anc[-1] == i
        ancestors_by_pos.append(anc)
        prefix.append(tuple(tok[anc].tolist()))
    assert len(set(prefix)) == T, "every compact token is a distinct prefix"
    rows = {tid: r for r, tid in enumerate(index.trajectory_ids)}
    trajs = [token_lists[ids.index(tid)] for tid in index.trajectory_ids]
    expected_prefixes = {tuple(t[:p + 1]) for t in trajs for p in range(len(t))}
    assert set(prefix) == expected_prefixes
    compact_of = {p: i for i, p in enumerate(prefix)}
    mult = index.multiplicity
    for i in range(T):
        assert mult[i] == sum(1 for t in trajs if tuple(t[:len(prefix[i])]) == prefix[i])
        want = [ancestors_by_pos[i][p] if p >= 0 else -1 for p in range(pos[i] - W + 1, pos[i])]
        assert index.conv_pred[i].tolist() == want
    # log-prob targets: distinct pairs; row (traj, p) predicts tokens[p] from compact(tokens[:p])
    src, target_tok = index.target_src, index.target_token
    assert len(set(zip(src.tolist(), target_tok.tolist()))) == src.size
    row_target, row_pred = index.row_target, index.row_pred
    assert index.lengths.tolist() == [len(t) for t in trajs]
    for tid, r in rows.items():
        t = trajs[r]
        for p in range(row_target.shape[1]):
            if p == 0 or p >= len(t):
                assert row_target[r, p] == -1 and row_pred[r, p] == -1
                continue
            c = compact_of[tuple(t[:p])]
            assert row_pred[r, p] == c
            assert (src[row_target[r, p]], target_tok[row_target[r, p]]) == (c, t[p])
    check_rounds(index, prefix, pos, C)


def check_rounds(index, prefix, pos, C):
    """Execute the rounds with an exact rolling hash and check every structural rule."""
    T = index.num_tokens
    bank: dict[int, tuple[int, tuple]] = {}  # bank id -> (state, prefix it belongs to)
    owner_count = np.zeros(T, np.int64)
    for rnd in index.rounds:
        cu = rnd.cu_seqlens.tolist()
        row_src = rnd.row_src
        own_rows = set(rnd.own_rows.tolist())
        assert rnd.own_dst.tolist() == row_src[rnd.own_rows].tolist()
        owner_count[rnd.own_dst] += 1
        exports = {}
        for s, off, b in zip(rnd.export_seq.tolist(), rnd.export_offset.tolist(), rnd.export_bank.tolist()):
            assert off > 0 and off % C == 0 and off <= cu[s + 1] - cu[s]
            assert b not in bank and b not in {x[1] for v in exports.values() for x in v}
            exports.setdefault(s, []).append((off, b))
        new_states = {}
        for s in range(rnd.num_sequences):
            seq_rows = row_src[cu[s]:cu[s + 1]]
            first = seq_rows[0]
            sigma = pos[first]
            assert sigma % C == 0
            assert pos[seq_rows].tolist() == list(range(sigma, sigma + seq_rows.size))
            for a, b in zip(seq_rows[:-1], seq_rows[1:]):
                assert prefix[b][:-1] == prefix[a]  # consecutive rows follow one path
            n_replay = sum(1 for r in range(cu[s], cu[s + 1]) if r not in own_rows)
            assert n_replay < C
            assert all((cu[s] + r in own_rows) == (r >= n_replay) for r in range(seq_rows.size))
            bank_id = int(rnd.init_state[s])
            if bank_id < 0:
                assert sigma == 0
                state = 0
            else:
                state, state_prefix = bank[bank_id]  # KeyError: not exported in an earlier round
                assert state_prefix == prefix[first][:sigma]
            for r, i in enumerate(seq_rows.tolist(), start=0):
                for off, b in exports.get(s, []):
                    if off == r:
                        new_states[b] = (state, prefix[i][:-1])
                state = (state * 1_000_003 + int(index.token_ids[i]) + 1) % MOD
                if r >= n_replay:
                    assert state == prefix_hash(prefix[i]), "own row state differs from trajectory"
            for off, b in exports.get(s, []):
                if off == seq_rows.size:
                    new_states[b] = (state, prefix[seq_rows[-1]])
        assert len(new_states) == rnd.export_bank.size
        bank.update(new_states)  # usable from the next round on
    assert sorted(bank) == list(range(index.num_states))
    assert np.all(owner_count == 1), "every compact token is an own row exactly once"


def check_plan(token_lists, chunk_size, conv_width=4, **options):
    ids = [f"t{j}" for j in range(len(token_lists))]
    batch = hc.TreeBatch.from_trajectories(token_lists, ids)
    plan = hc.compile(batch, hc.CompileOptions(chunk_size=chunk_size, conv_width=conv_width, **options))
    seen = []
    for mb in plan.microbatches():
        index = build_microbatch_index(plan, mb)
        assert index.num_tokens == mb.compact_tokens and len(index.rounds) == mb.rounds
        check_index(index, token_lists, ids, chunk_size, conv_width)
        seen += index.trajectory_ids
    assert sorted(seen) == sorted(ids)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_lists_strategy(max_traj=8, max_len=24), st.sampled_from([1, 2, 3, 4, 8, 64]),
       st.integers(1, 4))
def test_index_matches_brute_force(token_lists, chunk_size, conv_width):
    check_plan(token_lists, chunk_size, conv_width)


@pytest.mark.parametrize("chunk_size", [2, 4, 8])
@pytest.mark.parametrize("seed", range(3))
def test_several_microbatches_and_ranks(seed, chunk_size):
    token_lists = random_token_lists(np.random.default_rng(seed), n_traj=14, vocab=5, max_len=40)
    total = sum(map(len, token_lists))
    check_plan(token_lists, chunk_size, dp_size=2, microbatch_tokens=total)
    check_plan(token_lists, chunk_size, dp_size=3)


def test_deep_tree_many_rounds():
    rng = np.random.default_rng(9)
    root = rng.integers(0, 50, 37).tolist()
    token_lists = [root]
    for _ in range(10):  # chains of forks at off-boundary positions
        parent = token_lists[int(rng.integers(len(token_lists)))]
        token_lists.append(parent[:int(rng.integers(1, len(parent) + 1))]
                           + rng.integers(50, 100, int(rng.integers(1, 30))).tolist())
    check_plan(token_lists, 4)


def test_accepts_program_and_int():
    plan = hc.compile(hc.TreeBatch.from_trajectories([[1, 2, 3], [1, 2, 4]]))
    index = build_microbatch_index(plan.program, 0)
    assert isinstance(index.token_ids, np.ndarray) and index.subtree_end.dtype == np.int64
    assert plan.microbatches()[0].build_index().num_tokens == index.num_tokens
    with pytest.raises(ValueError, match="scheduled"):
        build_microbatch_index(plan.program.replace(microbatches=None), 0)


def tricky_batches(C: int) -> dict:
    """docs/design.md section 11's list of shapes, for chunk size C."""
    root = list(range(100, 100 + 2 * C))
    return {
        "branch_on_boundary": [root + [1, 2], root + [3]],
        "branch_in_first_chunk": [root[:C // 2 + 1] + [1], root[:C // 2 + 1] + [2, 2]],
        "replay_across_short_nodes": [root[:C + 1] + [1] + [7, 7], root[:C + 1] + [1] + [8],
                                      root[:C + 1] + [2], root[:C + 1] + [1, 7, 7, 9, 9]],
        "nodes_shorter_than_conv": [[5, 1], [5, 2, 3], [5, 2, 4], [5, 2, 3, 6]],
        "prefix_and_duplicates": [root, root[:C + 2], root, root[:1]],
        "single_token_nodes": [[1, 2, 3], [1, 2, 4], [1, 5], [1, 2, 3, 6], [1, 2, 3, 7]],
        "hundreds_of_children": [root + [1000 + k, k % 3] for k in range(300)],
    }


@pytest.mark.parametrize("chunk_size", [2, 4, 8])
@pytest.mark.parametrize("name", list(tricky_batches(4)))
def test_tricky_shapes(name, chunk_size):
    check_plan(tricky_batches(chunk_size)[name], chunk_size)
