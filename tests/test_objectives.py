"""RL objectives: hand-computed cases, clipping/normaliser properties, and tree vs trajectory-wise."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from harts_compiler.codegen import trajectory_index
from harts_compiler.objectives import (
    aggregate, global_counts, grpo_advantages, grpo_loss, kl_penalty, loss_mask, ppo_clip_loss)
from harts_compiler.codegen.kernels.logprobs import token_logprobs
from test_logprobs import branching_token_lists, prefix_tree_index

F64 = torch.float64


def t(values):
    return torch.tensor(values, dtype=F64)


def test_loss_mask_and_aggregations_by_hand():
    lengths = torch.tensor([3, 1, 4])
    response = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 1]])
    mask = loss_mask(lengths, 4, response)
    assert mask.tolist() == [[False, True, True, False], [False] * 4, [False, True, False, True]]
    values = t([[9.0, 1.0, 2.0, 9.0], [9.0, 9.0, 9.0, 9.0], [9.0, 3.0, 9.0, 5.0]])
    # counted tokens: row 0 -> 1, 2; row 1 -> none; row 2 -> 3, 5
    assert aggregate(values, mask, "token-mean").item() == pytest.approx((1 + 2 + 3 + 5) / 4)
    assert aggregate(values, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 8) / 2)
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4) / 2)
    assert aggregate(values, mask, "token-mean", num_tokens=10).item() == pytest.approx(11 / 10)
    assert aggregate(values, mask, "seq-mean-token-sum", num_sequences=5).item() == pytest.approx(11 / 5)
    assert aggregate(values, mask, "seq-mean-token-mean",
                     num_sequences=torch.tensor(4.0)).item() == pytest.approx(5.5 / 4)


def ppo_token_by_hand(logp, old, adv, low, high, dual=None):
    ratio = math.exp(logp - old)
    loss = max(-adv * ratio, -adv * min(max(ratio, 1 - low), 1 + high))
    if dual is not None and adv < 0:
        loss = min(loss, -adv * dual)
    return loss


@pytest.mark.parametrize("dual", [None, 2.0])
def test_ppo_clip_loss_by_hand(dual):
    logprobs = t([[0.0, -1.0, -0.5, -2.0], [0.0, -0.3, -3.0, 0.0]])
    old = t([[0.0, -1.3, -0.1, -0.9], [0.0, -0.35, -1.5, 0.0]])
    advantages = t([1.5, -2.0])
    lengths = torch.tensor([4, 3])
    out = ppo_clip_loss(logprobs, old, advantages, lengths, clip_ratio_low=0.2,
                        clip_ratio_high=0.28, dual_clip=dual)
    tokens = [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2)]
    by_hand = [ppo_token_by_hand(logprobs[r, p].item(), old[r, p].item(), advantages[r].item(),
                                 0.2, 0.28, dual) for r, p in tokens]
    assert out.loss.item() == pytest.approx(sum(by_hand) / len(by_hand), rel=1e-12)
    # token (0, 1): ratio e^0.3 > 1.28 with A > 0 -> clipped; (1, 2): ratio e^-1.5, A < 0 -> clipped
    assert out.metrics["clip_fraction"].item() == pytest.approx(2 / 5)


def test_gradient_is_zero_exactly_where_the_ratio_is_clipped():
    # one token per row; ratio e^{d}; advantage sign per row
    deltas = t([0.5, -0.5, 0.5, -0.5, 0.1, -0.1, 1.5])
    adv = t([1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0])
    logprobs = torch.stack([torch.zeros(7, dtype=F64), deltas], 1).requires_grad_()
    old = torch.zeros_like(logprobs)
    lengths = torch.full((7,), 2)
    loss = ppo_clip_loss(logprobs, old, adv, lengths, clip_ratio_low=0.2, dual_clip=3.0).loss
    (grad,) = torch.autograd.grad(loss, logprobs)
    ratio = deltas.exp()
    # clipped: A>0 & ratio>1.2 (row 0), A<0 & ratio<0.8 (row 1); dual-clipped: A<0 & ratio>3 (row 6)
    clipped = torch.tensor([True, True, False, False, False, False, True])
    assert torch.all(grad[:, 0] == 0)
    assert torch.all(grad[clipped, 1] == 0)
    expected = -adv * ratio / 7  # d/dlogp of -A ratio, token-mean over 7 tokens
    torch.testing.assert_close(grad[~clipped, 1], expected[~clipped], rtol=1e-12, atol=0)


def test_on_policy_loss_is_minus_mean_advantage_with_policy_gradient():
    logprobs = t([[0.0, -0.7, -1.1], [0.0, -0.2, 0.0]]).requires_grad_()
    adv = t([[0.0, 2.0, -1.0], [0.0, 0.5, 7.0]])  # per-token advantages; (1, 2) is padding
    out = ppo_clip_loss(logprobs, None, adv, torch.tensor([3, 2]))
    assert out.loss.item() == pytest.approx(-(2.0 - 1.0 + 0.5) / 3)
    (grad,) = torch.autograd.grad(out.loss, logprobs)
    torch.testing.assert_close(grad, t([[0.0, -2.0 / 3, 1.0 / 3], [0.0, -0.5 / 3, 0.0]]))


def test_garbage_outside_the_mask_never_reaches_loss_or_gradient():
    logprobs = t([[0.0, -0.7, -1.1, 0.0], [0.0, -0.2, -0.4, -0.3]]).requires_grad_()
    lengths = torch.tensor([3, 4])
    response = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 1]])  # (1, 2) is a tool-output token
    nan = float("nan")
    old = t([[nan, -0.6, -1.0, -float("inf")], [nan, -0.1, -0.5, -0.35]])  # (1, 2): finite old, NaN adv
    ref = t([[nan, -0.8, -1.2, nan], [-float("inf"), -0.3, nan, -0.2]])
    adv = t([[nan, 1.0, -1.0, nan], [nan, 0.5, nan, 2.0]])
    entropy = t([[nan, 1.0, 2.0, nan], [nan, 0.5, nan, 0.7]])
    clean = [torch.where(loss_mask(lengths, 4, response), x, 0.5) for x in (old, ref, adv, entropy)]
    results = []
    for o, r, a, e in ((old, ref, adv, entropy), clean):
        out = ppo_clip_loss(logprobs, o, a, lengths, response_mask=response, dual_clip=3.0,
                            ref_logprobs=r, kl_coef=0.1, entropy=e, entropy_coef=0.01)
        results.append((out.loss, torch.autograd.grad(out.loss, logprobs)[0]))
    assert torch.isfinite(results[0][0]) and torch.isfinite(results[0][1]).all()
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])


def test_kl_estimators_and_entropy_bonus():
    logprobs = t([[0.0, -0.5, -2.0]]).requires_grad_()
    ref = t([[0.0, -0.9, -2.0]])
    k1 = kl_penalty(logprobs, ref, "k1")
    k3 = kl_penalty(logprobs, ref, "k3")
    assert k1[0, 1].item() == pytest.approx(0.4)
    assert k3[0, 1].item() == pytest.approx(math.exp(-0.4) + 0.4 - 1.0)
    assert k3[0, 2].item() == 0.0 and torch.all(k3 >= 0)
    entropy = t([[0.0, 1.0, 3.0]])
    out = ppo_clip_loss(logprobs, None, t([0.0]), torch.tensor([3]), ref_logprobs=ref,
                        kl_coef=0.1, entropy=entropy, entropy_coef=0.01)
    expected = 0.1 * (k3[0, 1] + k3[0, 2]).item() / 2 - 0.01 * (1.0 + 3.0) / 2
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)
    (grad,) = torch.autograd.grad(out.loss, logprobs)
    # d k3 / d logp = 1 - exp(ref - logp): zero where the policy equals the reference
    assert grad[0, 2].item() == 0.0
    assert grad[0, 1].item() == pytest.approx(0.1 * (1 - math.exp(-0.4)) / 2)


def test_grpo_advantages_by_hand_and_properties():
    rewards = t([1.0, 0.0, 0.0, 2.0, 5.0, 3.0])
    groups = ["a", "a", "a", "b", "b", "c"]
    adv = grpo_advantages(rewards, groups, eps=0.0)
    std_a = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    std_b = math.sqrt((1.5 ** 2 * 2) / 1)
    expected = [(2 / 3) / std_a, -(1 / 3) / std_a, -(1 / 3) / std_a, -1.5 / std_b, 1.5 / std_b, 0.0]
    torch.testing.assert_close(adv, t(expected))
    centred = grpo_advantages(rewards, torch.tensor([7, 7, 7, 1, 1, 4]), scale_by_std=False)
    torch.testing.assert_close(centred, t([2 / 3, -1 / 3, -1 / 3, -1.5, 1.5, 0.0]))
    # invariant to a per-group affine change of the rewards (positive scale)
    shifted = rewards * 3.0 + torch.tensor([1.0, 1.0, 1.0, -4.0, -4.0, 9.0], dtype=F64)
    torch.testing.assert_close(grpo_advantages(shifted, groups, eps=0.0), adv)


def test_grpo_loss_uses_group_advantages():
    logprobs = t([[0.0, -1.0, -0.5], [0.0, -0.2, -0.1], [0.0, -0.4, 0.0]]).requires_grad_()
    old = logprobs.detach() + 0.05
    rewards, groups = t([1.0, 0.0, 1.0]), [0, 0, 0]
    lengths = torch.tensor([3, 3, 2])
    out = grpo_loss(logprobs, old, rewards, groups, lengths, aggregation="seq-mean-token-mean")
    manual = ppo_clip_loss(logprobs, old, grpo_advantages(rewards, groups), lengths,
                           aggregation="seq-mean-token-mean")
    assert out.loss.item() == manual.loss.item()
    torch.testing.assert_close(out.metrics["advantages"], grpo_advantages(rewards, groups))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), split=st.integers(1, 5),
       mode=st.sampled_from(["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]))
def test_global_normalisers_make_microbatch_losses_add_up(seed, split, mode):
    gen = torch.Generator().manual_seed(seed)
    rows, max_len = 6, 9
    lengths = torch.randint(1, max_len + 1, (rows,), generator=gen)
    response = torch.rand(rows, max_len, generator=gen) > 0.3
    logprobs = (-torch.rand(rows, max_len, generator=gen, dtype=F64)).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(rows, max_len, generator=gen, dtype=F64)
    ref = logprobs.detach() + 0.2 * torch.randn(rows, max_len, generator=gen, dtype=F64)
    adv = torch.randn(rows, generator=gen, dtype=F64)
    kwargs = dict(aggregation=mode, dual_clip=3.0, ref_logprobs=None, kl_coef=0.05)
    mask = loss_mask(lengths, max_len, response)
    n_tok, n_seq = mask.sum().item(), (mask.sum(-1) > 0).sum().item()

    def loss(lo, hi):
        return ppo_clip_loss(logprobs[lo:hi], old[lo:hi], adv[lo:hi], lengths[lo:hi],
                             response_mask=response[lo:hi], num_tokens=max(n_tok, 1),
                             num_sequences=max(n_seq, 1), **{**kwargs, "ref_logprobs": ref[lo:hi]}).loss

    whole = ppo_clip_loss(logprobs, old, adv, lengths, response_mask=response,
                          **{**kwargs, "ref_logprobs": ref}).loss
    parts = loss(0, split) + loss(split, rows)  # two "ranks"
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-12)
    g_whole, = torch.autograd.grad(whole, logprobs)
    g_parts, = torch.autograd.grad(parts, logprobs)
    torch.testing.assert_close(g_parts, g_whole, rtol=1e-12, atol=1e-12)


def test_global_counts_make_microbatches_and_ranks_add_up_to_the_batch():
    """Two "ranks" x two microbatches each, normalised by `global_counts` over all of them (what
    the all-reduce returns), sum to one call on the whole batch, for every aggregation."""
    gen = torch.Generator().manual_seed(3)
    rows, max_len = 6, 7
    lengths = torch.tensor([7, 2, 5, 1, 6, 4])
    response = torch.rand(rows, max_len, generator=gen) > 0.25
    logprobs = (-torch.rand(rows, max_len, generator=gen, dtype=F64)).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(rows, max_len, generator=gen, dtype=F64)
    advantages = torch.randn(rows, generator=gen, dtype=F64)
    microbatches = [slice(0, 1), slice(1, 3), slice(3, 5), slice(5, 6)]  # ranks: 0-1 and 2-3
    counts = global_counts([loss_mask(lengths[m], max_len, response[m]) for m in microbatches])
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        parts = sum(ppo_clip_loss(logprobs[m], old[m], advantages[m], lengths[m],
                                  response_mask=response[m], aggregation=mode,
                                  num_tokens=counts[0], num_sequences=counts[1]).loss
                    for m in microbatches)
        whole = ppo_clip_loss(logprobs, old, advantages, lengths, response_mask=response,
                              aggregation=mode).loss
        torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(torch.autograd.grad(parts, logprobs)[0],
                                   torch.autograd.grad(whole, logprobs)[0], rtol=1e-12, atol=1e-12)


def test_global_counts_all_reduce_under_torch_distributed(tmp_path):
    """The collective path runs (one gloo rank in-process: the sum over ranks is its own count)."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}",
                                         rank=0, world_size=1)
    try:
        masks = [loss_mask(torch.tensor([3, 1, 4]), 4), loss_mask(torch.tensor([2]), 2)]
        num_tokens, num_sequences = global_counts(masks)
    finally:
        torch.distributed.destroy_process_group()
    assert (num_tokens.item(), num_sequences.item()) == (2 + 0 + 3 + 1, 3)


def test_bad_inputs_get_clear_errors():
    lp = torch.zeros(2, 3, dtype=F64)
    lengths = torch.tensor([3, 2])
    with pytest.raises(ValueError, match="aggregation must be one of"):
        ppo_clip_loss(lp, None, t([1.0, 1.0]), lengths, aggregation="mean")
    with pytest.raises(ValueError, match="advantages must be"):
        ppo_clip_loss(lp, None, t([1.0, 1.0, 1.0]), lengths)
    with pytest.raises(ValueError, match="old_logprobs must have the shape"):
        ppo_clip_loss(lp, lp[:, :2], t([1.0, 1.0]), lengths)
    with pytest.raises(ValueError, match="lengths must be"):
        ppo_clip_loss(lp, None, t([1.0, 1.0]), torch.tensor([3]))
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_clip_loss(lp, None, t([1.0, 1.0]), lengths, dual_clip=0.5)
    with pytest.raises(ValueError, match="kl_type must be one of"):
        ppo_clip_loss(lp, None, t([1.0, 1.0]), lengths, ref_logprobs=lp, kl_coef=0.1, kl_type="k9")
    with pytest.raises(ValueError, match="num_tokens must be > 0"):
        ppo_clip_loss(lp, None, t([1.0, 1.0]), lengths, num_tokens=0)
    with pytest.raises(ValueError, match="kl_coef=0.1 needs ref_logprobs"):
        ppo_clip_loss(lp, None, t([1.0, 1.0]), lengths, kl_coef=0.1)
    with pytest.raises(ValueError, match="entropy_coef=0.01 needs entropy"):
        ppo_clip_loss(lp, None, t([1.0, 1.0]), lengths, entropy_coef=0.01)
    with pytest.raises(ValueError, match="group_ids must have one id per row"):
        grpo_advantages(t([1.0, 2.0]), ["a"])


class TokenModel(torch.nn.Module):
    """Trivial position-aware model: hidden = tanh(E[token] + P[position]) -> lm_head."""

    def __init__(self, vocab, dim, max_pos, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Parameter(torch.randn(vocab, dim, generator=gen, dtype=F64))
        self.pos = torch.nn.Parameter(torch.randn(max_pos, dim, generator=gen, dtype=F64) * 0.5)
        self.lm_head = torch.nn.Parameter(torch.randn(vocab, dim, generator=gen, dtype=F64) * 0.6)

    def forward(self, index, chunk_tokens):
        hidden = torch.tanh(self.embed[torch.as_tensor(index.token_ids)] + self.pos[torch.as_tensor(index.positions)])
        return token_logprobs(hidden, self.lm_head, index, chunk_tokens=chunk_tokens)


@settings(max_examples=25, deadline=None)
@given(token_lists=branching_token_lists(vocab=6),
       mode=st.sampled_from(["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]))
def test_same_loss_on_tree_and_trajectory_wise_tensors(token_lists, mode):
    """The loss code cannot tell tree mode from trajectory-wise mode: equal values and grads."""
    model = TokenModel(vocab=6, dim=5, max_pos=max(map(len, token_lists)))
    rng = np.random.default_rng(len(token_lists))
    rows, max_len = len(token_lists), max(map(len, token_lists))
    rewards = torch.as_tensor(rng.integers(0, 2, size=rows), dtype=F64)
    groups = rng.integers(0, 2, size=rows).tolist()
    response = torch.as_tensor(rng.random((rows, max_len)) > 0.2)
    perturb = torch.as_tensor(rng.normal(size=(rows, max_len)) * 0.3)
    results = []
    for index, chunk in ((trajectory_index(token_lists), 4096), (prefix_tree_index(token_lists), 3)):
        logprobs, entropy = model(index, chunk)
        out = grpo_loss(logprobs, logprobs.detach() + perturb, rewards, groups, torch.as_tensor(index.lengths),
                        response_mask=response, aggregation=mode, dual_clip=3.0,
                        ref_logprobs=logprobs.detach() - perturb, kl_coef=0.1,
                        entropy=entropy, entropy_coef=0.01)
        grads = torch.autograd.grad(out.loss, list(model.parameters()))
        results.append((out.loss.detach(), logprobs.detach(), entropy.detach(), *grads))
    for traj_value, tree_value in zip(*results):
        torch.testing.assert_close(tree_value, traj_value, rtol=1e-11, atol=1e-12)
