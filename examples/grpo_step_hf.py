"""One GRPO training step on a Hugging Face model, with HARTS dropped into the stack.

What an RL trainer changes to adopt HARTS: the forward of its policy. Instead of running the HF
model on every trajectory (recomputing the prompt and earlier turns that the trajectories of one
task share), it compiles the rollout batch once and runs `TreeModel.from_hf(hf_model)` per
microbatch. The TreeModel *shares* the HF model's parameters (no copy): gradients land on the HF
parameters and the trainer's own optimizer steps them. The loss is unchanged: `TreeOutput.logprobs`
has the trajectory-wise `[rows, max_len]` layout every PPO/GRPO loss already takes.

This script does the step both ways from the same starting weights and checks that they agree:

  1. HARTS:    compile -> per microbatch TreeModel forward, GRPO loss (global normalisers), backward
               -> optimizer.step() on the HF parameters
  2. ordinary: HF forward on the right-padded batch (attention mask) -> log-softmax + gather ->
               the same loss -> backward -> optimizer.step() on a deepcopy of the starting model

and prints the largest log-prob, loss, gradient and parameter differences, both wall times and
the prefix-compression ratio. It exits 1 when a difference is above the bar of its dtype.

Run (a tiny random Qwen3-Next on the CPU, a few seconds):

    python examples/grpo_step_hf.py                       # fp32, the default
    python examples/grpo_step_hf.py --dtype float64
    python examples/grpo_step_hf.py --checkpoint DIR      # a Qwen3-Next / Qwen3.5 checkpoint dir
    python examples/grpo_step_hf.py --rollouts batch.jsonl   # e.g. from `harts gen`

Note on --dtype float64: transformers' torch fallback of the gated delta rule (and its gated
RMSNorm and attention softmax) computes in fp32 whatever the model's dtype, so the HF side of an
fp64 run is only fp32-accurate (measured: log-probs 8e-8 apart, gradients 1.2e-5 relative) and
both dtypes use the fp32 bars. HARTS' own fp64 exactness (tree mode == trajectory-wise to ~1e-13)
is what `harts demo` checks.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
import transformers

import harts_compiler as hc
from harts_compiler.generator import generate
from harts_compiler.objectives import grpo_advantages, ppo_clip_loss
from harts_compiler.runtime import PRESETS, TreeModel
from harts_compiler.runtime.distributed import assemble_rows
from harts_compiler.verify import worst_gradient_difference

# Agreement bars: values (log-probs, loss) max abs diff; gradients max relative diff per parameter.
# One pair for both dtypes: transformers computes parts of the model in fp32 (module docstring).
BARS = {"values": 1e-5, "gradients": 5e-5}
LEARNING_RATE = 1e-2
ENTROPY_COEF = 1e-2


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--checkpoint", help="HF checkpoint dir (default: tiny random Qwen3-Next)")
    parser.add_argument("--rollouts", help="JSONL batch (default: generated with harts_compiler.generator)")
    parser.add_argument("--tasks", type=int, default=2, help="generated batch: tasks (GRPO groups)")
    parser.add_argument("--rollouts-per-task", type=int, default=4)
    parser.add_argument("--scale", type=float, default=0.03, help="generated batch: length scale")
    parser.add_argument("--microbatch-tokens", type=int, default=None,
                        help="compact-token budget per microbatch (default: twice the longest trajectory)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def load_hf_model(args, dtype):
    """The trainer's policy: a HF checkpoint, or a tiny random Qwen3-Next (eager attention, CPU)."""
    if args.checkpoint:
        return transformers.AutoModelForCausalLM.from_pretrained(
            args.checkpoint, dtype=dtype, attn_implementation="eager", experts_implementation="eager")
    preset = {k: v for k, v in PRESETS["tiny-qwen3-next"].items() if k != "model_type"}
    # eager experts: transformers' default grouped_mm MoE kernel has no fp64 path
    config = transformers.Qwen3NextConfig(**preset, attn_implementation="eager", experts_implementation="eager")
    torch.manual_seed(args.seed)
    model = transformers.Qwen3NextForCausalLM(config)
    # The random init draws decay rates A up to 16, so the delta-rule state forgets everything
    # within a token and A_log's gradient is ~1e-9 (pure rounding noise). Slower decays, as trained
    # models have, make the recurrent state carry across the trees' branch points.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.log(torch.empty_like(param).uniform_(0.05, 0.5)))
    return model.to(dtype)


def rollout_batch(args, vocab_size):
    """(TreeBatch, GRPO group of each trajectory). The group is the task: the id up to its first
    '-' (the generator's ids are `t{task}-r{rollout}[-e{turn}]`; adapt this to your own ids)."""
    if args.rollouts:
        batch = hc.TreeBatch.load(args.rollouts)
    else:
        rollouts = generate("swe", seed=args.seed, tasks=args.tasks, rollouts=args.rollouts_per_task,
                            scale=args.scale, turns=(3, 6), vocab_size=vocab_size).trajectories
        batch = hc.TreeBatch.from_trajectories([t for _, t in rollouts], [i for i, _ in rollouts])
    return batch, [traj_id.split("-")[0] for traj_id in batch.ids]


def grpo_loss(logprobs, entropy, lengths, advantages, num_tokens):
    """The trainer's loss, identical for both paths: on-policy PPO-clip (first epoch: old = current
    log-probs; pass the rollout engine's as `old_logprobs` otherwise) plus an entropy bonus (so the
    loss *value* depends on the model too: on-policy, the PPO term's value is -mean(advantage)),
    token-mean over the *batch's* tokens, so per-microbatch losses add up to the batch's loss."""
    return ppo_clip_loss(logprobs, None, advantages, lengths, num_tokens=num_tokens,
                         entropy=entropy, entropy_coef=ENTROPY_COEF).loss


def compile_batch(policy, batch, args):
    """The rollout batch -> a Plan: prefix trees, linear-attention rounds, microbatches."""
    # a budget below the whole batch gives several microbatches (larger trees are split exactly)
    budget = args.microbatch_tokens or 2 * int(batch.lengths.max())
    options = hc.CompileOptions(conv_width=policy.conv_width, vocab_size=policy.config.vocab_size,
                                microbatch_tokens=budget)
    return hc.compile(batch, options)  # plan.stats: compression, microbatches, ...


def harts_step(policy, plan, advantage_of, num_tokens):
    """Forward + loss + backward per microbatch; the gradients land on the HF parameters.
    Returns (loss, [n_traj, max_len] log-probs in input order)."""
    loss, outputs = 0.0, []
    for microbatch in plan.microbatches():
        out = policy(microbatch)  # out.logprobs [rows, max_len], rows in out.trajectory_ids order
        advantages = torch.tensor([advantage_of[t] for t in out.trajectory_ids], dtype=out.logprobs.dtype)
        mb_loss = grpo_loss(out.logprobs, out.entropy, out.lengths, advantages, num_tokens)
        mb_loss.backward()  # backward per microbatch, as a trainer does: activations freed here
        loss += mb_loss.detach()  # summed on the device: no host sync per microbatch
        outputs.append(out)
    logprobs, _ = assemble_rows(plan, outputs, "logprobs")  # back to input order, for the comparison
    return float(loss), logprobs.detach()


def ordinary_step(hf_model, token_lists, advantages, num_tokens):
    """What the trainer did before: HF forward on the right-padded batch, log-softmax + gather."""
    lengths = torch.tensor([len(t) for t in token_lists])
    input_ids = torch.zeros(len(token_lists), int(lengths.max()), dtype=torch.long)
    for row, tokens in enumerate(token_lists):
        input_ids[row, :len(tokens)] = torch.as_tensor(tokens)
    attention_mask = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).long()
    logits = hf_model(input_ids=input_ids, attention_mask=attention_mask).logits
    # position p holds log P(token_p | tokens_<p) (logits at p-1 predict token p) and the entropy
    # of that distribution; 0 at p=0 (padding is masked by the loss)
    log_probs = torch.log_softmax(logits[:, :-1], dim=-1)
    logprobs = torch.nn.functional.pad(log_probs.gather(-1, input_ids[:, 1:, None])[..., 0], (1, 0))
    entropy = torch.nn.functional.pad(-(log_probs.exp() * log_probs).sum(-1), (1, 0))
    loss = grpo_loss(logprobs, entropy, lengths, advantages.to(logprobs.dtype), num_tokens)
    loss.backward()
    return loss.item(), logprobs.detach()


def compare(hf_model, reference, tree_lp, ref_lp, lengths):
    """Largest differences: log-probs (valid positions), relative gradient per parameter."""
    valid = (torch.arange(tree_lp.shape[1])[None, :] < lengths[:, None])
    logprob_diff = float((tree_lp - ref_lp).abs()[valid].max())
    grads = lambda model: {name: p.grad for name, p in model.named_parameters()}  # noqa: E731
    grad_diff, worst = worst_gradient_difference(grads(hf_model), grads(reference))
    return logprob_diff, grad_diff, worst


def main(argv=None) -> int:
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    hf_model = load_hf_model(args, dtype).train()
    reference = copy.deepcopy(hf_model)  # same starting weights for the ordinary path
    vocab_size = getattr(hf_model.config, "text_config", hf_model.config).vocab_size

    # rollouts, seeded rewards (one per trajectory) and GRPO advantages (normalised per task)
    batch, groups = rollout_batch(args, vocab_size)
    token_lists = [batch.trajectory(j) for j in range(len(batch))]
    rewards = torch.rand(len(batch), generator=torch.Generator().manual_seed(args.seed), dtype=torch.float64)
    advantages = grpo_advantages(rewards, groups)
    advantage_of = dict(zip(batch.ids, advantages.tolist()))
    num_tokens = sum(len(t) - 1 for t in token_lists)  # global normaliser: every predicted token

    # 1. HARTS: compile, tree-mode forward/backward per microbatch, the trainer's own optimizer
    policy = TreeModel.from_hf(hf_model)  # a view of the same nn.Parameters, no copy
    shared = {id(p) for p in policy.parameters()} <= {id(p) for p in hf_model.parameters()}
    # any optimizer works (it only sees .grad); SGD keeps the parameter check plain: dp = -lr * g
    optimizer = torch.optim.SGD(hf_model.parameters(), lr=LEARNING_RATE)
    start = time.perf_counter()
    plan = compile_batch(policy, batch, args)
    compile_seconds = time.perf_counter() - start
    # (untimed warm-up of both paths: torch's lazy initialisation would otherwise hit the first)
    harts_step(policy, plan, advantage_of, num_tokens)
    ordinary_step(reference, token_lists, advantages, num_tokens)
    for model in (hf_model, reference):
        model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    tree_loss, tree_lp = harts_step(policy, plan, advantage_of, num_tokens)
    tree_seconds = time.perf_counter() - start
    # 2. the ordinary way, on the copy
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LEARNING_RATE)
    start = time.perf_counter()
    ref_loss, ref_lp = ordinary_step(reference, token_lists, advantages, num_tokens)
    ref_seconds = time.perf_counter() - start

    lengths = torch.as_tensor(batch.lengths)
    logprob_diff, grad_diff, worst = compare(hf_model, reference, tree_lp, ref_lp, lengths)
    optimizer.step()
    ref_optimizer.step()
    with torch.no_grad():
        ref_params = dict(reference.named_parameters())
        param_diff = max(float((p - ref_params[n]).abs().max()) for n, p in hf_model.named_parameters())
        # SGD moves a parameter by lr * gradient: the bar is lr * the gradient bar, plus one
        # rounding of the updated parameter (each side rounds p - lr * g to a float on its own)
        max_grad = max(float(p.grad.abs().max()) for p in reference.parameters() if p.grad is not None)
        max_param = max(float(p.abs().max()) for p in reference.parameters())
    param_bar = LEARNING_RATE * BARS["gradients"] * max_grad + torch.finfo(dtype).eps * max_param
    loss_diff = abs(tree_loss - ref_loss)

    stats = plan.stats
    print(f"model: {type(hf_model).__name__}, {sum(p.numel() for p in hf_model.parameters()):,} "
          f"parameters, {args.dtype}; {stats['trajectories']} trajectories in {len(set(groups))} "
          f"GRPO groups, {len(plan.microbatches())} microbatch(es)")
    print(f"compression {stats['compression']:.2f}x ({stats['trajectory_tokens']} trajectory tokens "
          f"-> {stats['compact_tokens']} computed)")
    checks = [("max |log-prob diff|", logprob_diff, BARS["values"]),
              ("|loss diff|", loss_diff, BARS["values"]),
              ("max rel. gradient diff", grad_diff, BARS["gradients"]),
              ("max |parameter diff| after step", param_diff, param_bar)]
    for label, value, bar in checks:
        print(f"{label:<33} {value:.3e}  (bar {bar:.1e}) {'ok' if value <= bar else 'MISSED'}")
    print(f"loss: harts {tree_loss:.10f}, ordinary {ref_loss:.10f}; worst gradient: {worst}")
    print(f"TreeModel shares the HF model's parameters (no copy): {shared}")
    print(f"wall time, forward + loss + backward: harts {tree_seconds * 1e3:.0f} ms (+ compile "
          f"{compile_seconds * 1e3:.0f} ms), ordinary {ref_seconds * 1e3:.0f} ms  [CPU: per-op "
          f"overhead dominates a tiny model; GPU speed: BENCHMARKS.md]")
    passed = shared and all(value <= bar for _, value, bar in checks)
    print("agree: HARTS step == ordinary HF step" if passed else "DISAGREE: beyond the bars above")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
