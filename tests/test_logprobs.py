"""Chunked log-prob restoration equals dense trajectory-wise log_softmax + gather.

Tree-shaped indices come from a token-level trie of the trajectories (`prefix_tree_index`):
every distinct prefix is one compact token, so a branching token is the src of several targets,
duplicate trajectories share every pair and a trajectory may be a prefix of another. The oracle
runs the dense reference on the trajectory-wise index with each trajectory's hidden states
gathered from the compact ones; the gather's backward sums over trajectories, which is exactly
the gradient the tree-mode op must produce.
"""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from harts_compiler.codegen import trajectory_index
from harts_compiler.codegen.kernels.logprobs import token_logprobs
from harts_compiler.codegen.kernels.logprobs import dense_token_logprobs


def prefix_tree_index(token_lists, device="cpu"):
    """Trie index of `token_lists` with the fields `token_logprobs` reads, plus token_ids,
    positions and `paths` ([rows, max_len] compact index of every trajectory token, -1 pad)."""
    children: list[dict[int, int]] = [{}]  # node 0 is a virtual root above all first tokens
    parent, token, depth = [-1], [-1], [-1]
    node_paths = []
    for seq in token_lists:
        node, path = 0, []
        for t in seq:
            nxt = children[node].get(int(t))
            if nxt is None:
                nxt = len(children)
                children.append({})
                parent.append(node)
                token.append(int(t))
                depth.append(depth[node] + 1)
                children[node][int(t)] = nxt
            node = nxt
            path.append(node)
        node_paths.append(path)
    order, stack = [], list(reversed(children[0].values()))
    while stack:  # DFS preorder, children in first-seen order
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(list(children[node].values())))
    compact = {node: i for i, node in enumerate(order)}
    target_of, target_src, target_token = {}, [], []
    for node in order:
        if parent[node] != 0:
            target_of[compact[node]] = len(target_src)
            target_src.append(compact[parent[node]])
            target_token.append(token[node])
    lengths = np.array([len(p) for p in node_paths], dtype=np.int64)
    max_len = int(lengths.max())
    paths = np.full((len(node_paths), max_len), -1, dtype=np.int64)
    row_target = np.full_like(paths, -1)
    row_pred = np.full_like(paths, -1)
    for r, path in enumerate(node_paths):
        cpath = [compact[n] for n in path]
        paths[r, :len(cpath)] = cpath
        for p in range(1, len(cpath)):
            row_target[r, p] = target_of[cpath[p]]
            row_pred[r, p] = cpath[p - 1]

    def as_tensor(values):
        return torch.as_tensor(np.asarray(values, dtype=np.int64), device=device)

    return types.SimpleNamespace(
        trajectory_ids=[str(i) for i in range(len(node_paths))],
        token_ids=as_tensor([token[n] for n in order]),
        positions=as_tensor([depth[n] for n in order]),
        target_src=as_tensor(target_src), target_token=as_tensor(target_token),
        row_target=as_tensor(row_target), row_pred=as_tensor(row_pred),
        lengths=as_tensor(lengths), paths=as_tensor(paths))


def flat_paths(tree_index) -> torch.Tensor:
    """Compact index of every trajectory token, trajectories concatenated (trajectory_index order)."""
    return tree_index.paths[tree_index.paths >= 0]


@st.composite
def branching_token_lists(draw, max_trajectories=7, vocab=5):
    """Trajectories that reuse prefixes of earlier ones: shared nodes, branch points,
    duplicates and strict-prefix trajectories all occur."""
    lists: list[list[int]] = []
    for _ in range(draw(st.integers(1, max_trajectories))):
        prefix: list[int] = []
        if lists and draw(st.booleans()):
            base = draw(st.sampled_from(lists))
            prefix = base[:draw(st.integers(1, len(base)))]
        suffix = draw(st.lists(st.integers(0, vocab - 1), min_size=0 if prefix else 1, max_size=6))
        lists.append(prefix + suffix)
    return lists


# Triton kernels run compiled on a GPU, else under the CPU interpreter (conftest.py sets it)
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_params(n_tokens, dim, vocab, dtype, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n_tokens, dim, generator=gen, dtype=torch.float64).to(device, dtype)
    weight = (torch.randn(vocab, dim, generator=gen, dtype=torch.float64) * 0.7).to(device, dtype)
    return hidden.requires_grad_(), weight.requires_grad_()


def loss_weights(shape, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed + 1000)
    return tuple(torch.randn(shape, generator=gen, dtype=torch.float64).to(device) for _ in range(2))


def assert_close_scaled(got, want, tol, name=""):
    """|got - want| <= tol * max(1, max|want|): summed gradients are judged against their scale."""
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=0, atol=tol * scale, msg=lambda m: f"{name}: {m}")


def run_and_grad(fn, hidden, weight, seed):
    logprobs, entropy = fn(hidden, weight)
    w_lp, w_ent = loss_weights(logprobs.shape, seed, logprobs.device)
    loss = (logprobs.double() * w_lp).sum() + (entropy.double() * w_ent).sum()
    grad_hidden, grad_weight = torch.autograd.grad(loss, (hidden, weight))
    return logprobs.detach(), entropy.detach(), grad_hidden, grad_weight


def assert_tree_matches_trajectory_wise(token_lists, vocab, dtype, chunk_tokens, temperature=1.0,
                                        seed=0, tol=1e-11, use_triton=False):
    device = TRITON_DEVICE if use_triton else "cpu"
    tree = prefix_tree_index(token_lists, device=device)
    traj = trajectory_index(token_lists)
    hidden, weight = random_params(tree.token_ids.numel(), 6, vocab, dtype, seed, device)

    got = run_and_grad(lambda h, w: token_logprobs(h, w, tree, chunk_tokens=chunk_tokens,
                                                   temperature=temperature, use_triton=use_triton),
                       hidden, weight, seed)
    want = run_and_grad(lambda h, w: dense_token_logprobs(h[flat_paths(tree)], w, traj,
                                                          temperature=temperature),
                        hidden, weight, seed)
    for name, g, w in zip(("logprobs", "entropy", "grad hidden", "grad weight"), got, want):
        assert_close_scaled(g, w, tol, name)


@settings(max_examples=40, deadline=None)
@given(token_lists=branching_token_lists(), chunk_tokens=st.sampled_from([1, 3, 5, 4096]))
def test_tree_index_matches_trajectory_wise_fp64(token_lists, chunk_tokens):
    assert_tree_matches_trajectory_wise(token_lists, vocab=5, dtype=torch.float64,
                                        chunk_tokens=chunk_tokens)


@pytest.mark.parametrize("seed", range(4))
def test_compiled_plan_index_matches_trajectory_wise(seed):
    """The compiler's own MicrobatchIndex (hc.compile + build_microbatch_index): hidden of token p is
    the compact hidden of the token predicting p + 1 (the last token of a row predicts nothing)."""
    import harts_compiler as hc
    from harts_compiler.codegen.microbatch import build_microbatch_index
    from harts_compiler.testing import random_token_lists

    vocab = 5
    token_lists = random_token_lists(np.random.default_rng(seed), n_traj=12, vocab=vocab, max_len=20)
    ids = [f"t{j}" for j in range(len(token_lists))]
    plan = hc.compile(hc.TreeBatch.from_trajectories(token_lists, ids),
                      hc.CompileOptions(chunk_size=4, microbatch_tokens=200))
    for microbatch in plan.microbatches():
        index = build_microbatch_index(plan, microbatch)
        rows = [token_lists[ids.index(t)] for t in index.trajectory_ids]
        hidden, weight = random_params(index.num_tokens, 6, vocab, torch.float64, seed)
        padded = torch.cat([hidden, torch.zeros(1, hidden.shape[1], dtype=hidden.dtype)])
        source = torch.cat([torch.cat([torch.as_tensor(index.row_pred[r, 1:len(t)]),
                                       torch.tensor([index.num_tokens])]) for r, t in enumerate(rows)])
        got = run_and_grad(lambda h, w: token_logprobs(h, w, index, chunk_tokens=3), hidden, weight, seed)
        want = run_and_grad(lambda h, w: dense_token_logprobs(
            torch.cat([h, padded[-1:]])[source], w, trajectory_index(rows)), hidden, weight, seed)
        for name, g, w in zip(("logprobs", "entropy", "grad hidden", "grad weight"), got, want):
            assert_close_scaled(g, w, 1e-12, name)


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("chunk_tokens", [2, 7, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_hand_made_tree_fp32(chunk_tokens, temperature, use_triton):
    # root "1 2 3" branches into "4 ..." (itself branching: shared src, several target tokens)
    # and "6 7 8"; trajectory 3 duplicates 1, trajectory 4 is a strict prefix of trajectory 0
    token_lists = [[1, 2, 3, 4, 5, 0, 2], [1, 2, 3, 6, 7, 8], [1, 2, 3, 4, 9, 9],
                   [1, 2, 3, 6, 7, 8], [1, 2, 3, 4], [1, 2, 3, 4, 0]]
    assert_tree_matches_trajectory_wise(token_lists, vocab=11, dtype=torch.float32,
                                        chunk_tokens=chunk_tokens, temperature=temperature,
                                        tol=2e-6, use_triton=use_triton)


@pytest.mark.parametrize("chunk_tokens", [1, 5, 13, 10_000])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_trajectory_index_matches_dense(chunk_tokens, dtype, tol):
    rng = np.random.default_rng(chunk_tokens)
    vocab = 37
    token_lists = [rng.integers(0, vocab, size=n).tolist() for n in (1, 9, 23, 4, 17)]
    index = trajectory_index(token_lists)
    hidden, weight = random_params(index.num_tokens, 16, vocab, dtype, seed=chunk_tokens)
    got = run_and_grad(lambda h, w: token_logprobs(h, w, index, chunk_tokens=chunk_tokens,
                                                   temperature=0.8), hidden, weight, 3)
    want = run_and_grad(lambda h, w: dense_token_logprobs(h, w, index, temperature=0.8),
                        hidden, weight, 3)
    assert got[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    for name, g, w in zip(("logprobs", "entropy", "grad hidden", "grad weight"), got, want):
        assert_close_scaled(g, w, tol, name)
    # layout: 0 at p = 0 and in padding, log-probs < 0 and entropies > 0 elsewhere
    valid = torch.as_tensor(index.row_target >= 0)
    assert torch.all(got[0][~valid] == 0) and torch.all(got[1][~valid] == 0)
    assert torch.all(got[0][valid] < 0) and torch.all(got[1][valid] > 0)


# 4100: several vocabulary blocks per row (online max/sum rescaling across blocks)
@pytest.mark.parametrize("vocab,tol", [(37, 2e-6), (4100, 2e-6)])
def test_triton_kernels_match_dense_fp32(vocab, tol):
    rng = np.random.default_rng(vocab)
    token_lists = [rng.integers(0, vocab, size=n).tolist() for n in (6, 11, 3)]
    token_lists.append(token_lists[1][:7] + [1, 2])  # a branch: shared src, two target tokens
    tree = prefix_tree_index(token_lists, device=TRITON_DEVICE)
    traj = trajectory_index(token_lists)
    hidden, weight = random_params(tree.token_ids.numel(), 8, vocab, torch.float32, seed=1,
                                   device=TRITON_DEVICE)
    for pick in (None, 0, 1):  # both outputs, log-probs only, entropy only
        def loss_of(fn):
            outputs = fn()
            return outputs if pick is None else outputs[pick:pick + 1]

        got_out = loss_of(lambda: token_logprobs(hidden, weight, tree, chunk_tokens=5,
                                                 temperature=0.7, use_triton=True))
        want_out = loss_of(lambda: dense_token_logprobs(hidden[flat_paths(tree)], weight, traj,
                                                        temperature=0.7))
        got_grads = torch.autograd.grad(sum((o * (i + 1.5)).sum() for i, o in enumerate(got_out)),
                                        (hidden, weight))
        want_grads = torch.autograd.grad(sum((o * (i + 1.5)).sum() for i, o in enumerate(want_out)),
                                         (hidden, weight))
        for g, w in zip(list(got_out) + list(got_grads), list(want_out) + list(want_grads)):
            assert_close_scaled(g.detach(), w.detach(), tol)


def test_one_output_only_gets_its_gradient():
    token_lists = [[3, 1, 4, 1, 5], [3, 1, 4, 2, 6, 5], [3, 1]]
    tree = prefix_tree_index(token_lists)
    traj = trajectory_index(token_lists)
    hidden, weight = random_params(tree.token_ids.numel(), 5, 7, torch.float64, seed=5)
    for pick in (0, 1):
        got = torch.autograd.grad(token_logprobs(hidden, weight, tree, chunk_tokens=3)[pick].sum(),
                                  (hidden, weight))
        want = torch.autograd.grad(dense_token_logprobs(hidden[flat_paths(tree)], weight, traj)[pick].sum(),
                                   (hidden, weight))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_tokens_predicting_nothing_are_never_computed():
    # the last token of every leaf predicts nothing: NaN there must not reach any output or grad
    token_lists = [[1, 2, 3, 4], [1, 2, 5], [6, 7]]
    tree = prefix_tree_index(token_lists)
    hidden, weight = random_params(tree.token_ids.numel(), 4, 8, torch.float64, seed=2)
    unused = torch.ones(tree.token_ids.numel(), dtype=torch.bool)
    unused[tree.target_src] = False
    assert unused.sum() == 3
    with torch.no_grad():
        hidden[unused] = float("nan")
    logprobs, entropy = token_logprobs(hidden, weight, tree, chunk_tokens=2)
    grad_hidden, grad_weight = torch.autograd.grad(logprobs.sum() + entropy.sum(), (hidden, weight))
    assert torch.isfinite(logprobs).all() and torch.isfinite(entropy).all()
    assert torch.isfinite(grad_weight).all()
    assert torch.all(grad_hidden[unused] == 0) and torch.isfinite(grad_hidden).all()


def test_saves_no_vocab_sized_activation():
    # everything autograd keeps must be O(T + P) beyond hidden and the weight themselves
    rng = np.random.default_rng(0)
    vocab, dim = 301, 8
    index = trajectory_index([rng.integers(0, vocab, size=n).tolist() for n in (40, 25, 33)])
    hidden, weight = random_params(index.num_tokens, dim, vocab, torch.float32, seed=0)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(hidden, weight, index, chunk_tokens=16)
    biggest = max(t.numel() for t in saved if t.data_ptr() not in (hidden.data_ptr(), weight.data_ptr()))
    assert biggest < 4 * index.row_target.size < index.num_tokens * vocab


def test_empty_targets_give_zero_outputs():
    index = trajectory_index([[4], [2]])  # single-token trajectories predict nothing
    hidden, weight = random_params(2, 3, 6, torch.float32, seed=0)
    logprobs, entropy = token_logprobs(hidden, weight, index)
    assert logprobs.shape == (2, 1) and torch.all(logprobs == 0) and torch.all(entropy == 0)


def test_bad_inputs_get_clear_errors():
    index = trajectory_index([[1, 2, 3], [2, 0]])
    hidden, weight = random_params(index.num_tokens, 4, 5, torch.float32, seed=0)
    cases = [
        (dict(hidden=hidden[:, :3]), "lm_head_weight must be"),
        (dict(weight=weight.double()), "share one float dtype"),
        (dict(weight=weight[:3]), "outside the vocabulary"),
        (dict(chunk_tokens=0), "chunk_tokens must be a positive int"),
        (dict(temperature=0.0), "temperature must be > 0"),
        (dict(index=types.SimpleNamespace(**{**vars(index), "row_pred": np.roll(index.row_pred, 1, 1)})),
         "row_pred disagrees"),
        (dict(index=types.SimpleNamespace(**{**vars(index), "lengths": index.lengths + 1})),
         "lengths"),
        (dict(index=types.SimpleNamespace(**{**vars(index), "target_src": index.target_src.astype(float)})),
         "target_src must be an integer array"),
        (dict(index=types.SimpleNamespace(**{**vars(index), "target_src": index.target_src[[0, 0, 2]],
                                             "target_token": index.target_token[[0, 0, 2]],
                                             "row_pred": np.where(index.row_target >= 0, index.target_src[[0, 0, 2]][
                                                 np.maximum(index.row_target, 0)], -1)})),
         "repeated \\(src, token\\) pairs"),
    ]
    for override, message in cases:
        args = dict(hidden=hidden, weight=weight, index=index, chunk_tokens=4, temperature=1.0) | override
        with pytest.raises(ValueError, match=message):
            token_logprobs(args["hidden"], args["weight"], args["index"],
                           chunk_tokens=args["chunk_tokens"], temperature=args["temperature"])


@pytest.mark.gpu
@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("chunk_tokens", [512, 1000])
def test_bf16_cuda_no_worse_than_dense_bf16(chunk_tokens, use_triton):
    """bf16 chunked op vs fp32 dense reference: error within 2x of the dense bf16 baseline's."""
    rng = np.random.default_rng(1)
    vocab, dim = 32_000, 256
    base = [rng.integers(0, vocab, size=600).tolist()]
    token_lists = [base[0][:int(rng.integers(100, 600))] + rng.integers(0, vocab, size=int(n)).tolist()
                   for n in rng.integers(1, 400, size=8)]
    tree = prefix_tree_index(token_lists, device="cuda")
    traj = trajectory_index(token_lists)
    hidden64, weight64 = random_params(tree.token_ids.numel(), dim, vocab, torch.float64, seed=7)
    results = {}
    for name, dtype in (("ref", torch.float32), ("bf16", torch.bfloat16)):
        h = hidden64.detach().to("cuda", dtype).requires_grad_()
        w = weight64.detach().to("cuda", dtype).requires_grad_()
        results[name + "_dense"] = run_and_grad(
            lambda a, b: dense_token_logprobs(a[flat_paths(tree)], b, traj), h, w, 0)
        if dtype == torch.bfloat16:
            results["bf16_chunked"] = run_and_grad(
                lambda a, b: token_logprobs(a, b, tree, chunk_tokens=chunk_tokens,
                                            use_triton=use_triton), h, w, 0)
    for i, name in enumerate(("logprobs", "entropy", "grad hidden", "grad weight")):
        ref = results["ref_dense"][i].double()
        print(name, "dense bf16", (results["bf16_dense"][i].double() - ref).abs().max().item(),
              "chunked bf16", (results["bf16_chunked"][i].double() - ref).abs().max().item())
        dense_err = (results["bf16_dense"][i].double() - ref).abs().max().item()
        ours_err = (results["bf16_chunked"][i].double() - ref).abs().max().item()
        assert ours_err <= 2.0 * dense_err + 1e-6, f"{name}: chunked {ours_err:.3g} vs dense bf16 {dense_err:.3g}"
