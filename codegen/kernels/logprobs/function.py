"""Per-trajectory token log-probs and entropy from compact hidden states (docs/design.md section 5).

The logits of a compact token are shared by every trajectory through it, but the *next* token
differs per trajectory at the last token of a branching node. So:

- ``lse`` and entropy are computed once per compact token that predicts something;
- the target logit once per distinct ``(src, token)`` pair (``index.target_src/target_token``);
- ``logprob[row, p] = logit[src, tok] - lse[src]`` and ``entropy[row, p] = H(src)`` are then
  gathered into the trajectory-wise ``[rows, max_len]`` layout. The gather's backward sums the
  gradients of trajectories sharing a pair or a token: exactly the trajectory-wise gradient.

``_ChunkedLogProbs`` never holds ``[T, V]`` logits: forward loops over chunks of the needed
tokens and keeps only ``lse`` and entropy per token; backward recomputes each chunk's logits and
forms ``d logits`` in closed form (``onehot - softmax`` for a log-prob, ``-p (log p + H)`` for the
entropy), then ``d hidden`` and ``d lm_head_weight`` (accumulated over chunks in fp32).
Peak extra memory is a few ``[chunk_tokens, V]`` fp32 buffers plus one fp32 ``[V, D]`` gradient
accumulator for low-precision weights.

Per chunk the matmuls are cuBLAS (bf16 in, fp32 logits out, no bf16 rounding of logits); the
element-wise softmax work is either plain torch (CPU, fp64, the oracle path) or one-pass Triton
kernels (`kernels.py`, the default on CUDA). Measured on one H200 (bench/logprobs.py,
T=32768, V=151936, D=2048, bf16, log-probs + entropy, fwd+bwd): 144 ms and 4.8 GiB peak at
chunk_tokens=4096 vs 257-261 ms and 92.7 GiB for dense log_softmax + gather. On one compiled
tree (root 4096 + 8 branches of 3584: 32768 compact, 61440 trajectory tokens) 147 ms in tree
mode vs 266 ms for the same op trajectory-wise (dense: out of memory), identical log-probs.
"""
from __future__ import annotations

import numpy as np
import torch

from ..interpreter_safe import interpreting
from ..segment_add import segment_add
from ..upload import to_device
from .plan import RowSums, TargetPlan, check_targets, plan_targets


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _matmul_out(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b returned in out_dtype; for bf16/fp16 CUDA inputs the fp32 accumulator is kept as
    the output (torch.mm's out_dtype) instead of being rounded to bf16 first."""
    if a.dtype == out_dtype:
        return a @ b
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=out_dtype)
        except torch.cuda.OutOfMemoryError:
            raise
        except (TypeError, RuntimeError, NotImplementedError):
            pass  # torch without mm(out_dtype=) for this dtype: round through the input dtype
    return (a @ b).to(out_dtype)


def _accumulate_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor,
                            hidden_chunk: torch.Tensor) -> None:
    """grad_weight += grad_logits^T @ hidden_chunk, with grad_weight in the accumulation dtype."""
    if hidden_chunk.dtype == grad_weight.dtype:
        grad_weight.addmm_(grad_logits.t(), hidden_chunk)
    else:
        grad_weight.add_(_matmul_out(grad_logits.t(), hidden_chunk, grad_weight.dtype))


# Per-chunk element-wise math over raw logits z [c, V] (accumulation dtype); `slot`/`token`
# locate this chunk's targets (row in the chunk, token id). Two implementations, same results:
# plain torch (any device/dtype, the CPU path) and one-pass Triton kernels (fp32 logits).

def _chunk_stats_torch(z, slot, token, inv_temp):
    """-> (lse [c], entropy [c], target log-probs); consumes z."""
    if inv_temp != 1.0:
        z.mul_(inv_temp)
    lse = torch.logsumexp(z, dim=-1)
    log_p = z.sub_(lse[:, None])
    target_logprob = log_p[slot, token]
    # H = -sum p log p, in place so the chunk needs only two [c, V] buffers
    entropy = log_p.exp().mul_(log_p).sum(dim=-1).neg_()
    return lse, entropy, target_logprob


def _chunk_stats_triton(z, slot, token, inv_temp):
    lse, entropy = logits_kernels().logits_stats(z, inv_temp)
    return lse, entropy, z[slot, token] * inv_temp - lse[slot]


def _chunk_grad_logits_torch(z, lse, entropy, per_src, grad_entropy, slot, token, grad_target,
                             inv_temp, out_dtype):
    """d loss / d z (consumes z): sum_t g_t (onehot_t - p) + g_H (-p (log p + H)), all / T,
    = onehot terms - p (G + g_H (log p + H)) with G = per_src = sum of g_t over a row's targets."""
    if inv_temp != 1.0:
        z.mul_(inv_temp)
    coef = z.sub_(lse[:, None])  # log p
    probs = coef.exp()
    if grad_entropy is not None:
        coef.add_(entropy[:, None]).mul_(grad_entropy[:, None]).add_(per_src[:, None])
    else:
        coef.copy_(per_src[:, None].expand_as(coef))
    grad = coef.mul_(probs).neg_()
    del probs
    if grad_target is not None:
        grad.index_put_((slot, token), grad_target, accumulate=True)
    if inv_temp != 1.0:
        grad.mul_(inv_temp)
    return grad.to(out_dtype)


def _chunk_grad_logits_triton(z, lse, entropy, per_src, grad_entropy, slot, token, grad_target,
                              inv_temp, out_dtype):
    grad = logits_kernels().logits_grad(z, lse, entropy, per_src, grad_entropy, inv_temp, out_dtype)
    if grad_target is not None:
        # overwrite the target entries with their exact fp32 value (pairs are distinct)
        log_p = z[slot, token] * inv_temp - lse[slot]
        coef = per_src[slot]
        if grad_entropy is not None:
            coef = coef + grad_entropy[slot] * (log_p + entropy[slot])
        grad[slot, token] = ((grad_target - torch.exp(log_p) * coef) * inv_temp).to(out_dtype)
    return grad


def logits_kernels():
    """The Triton kernel module, imported on first use (keeps CPU-only imports light and lets
    tests set TRITON_INTERPRET before any kernel is defined)."""
    from . import kernels
    return kernels


class _ChunkedLogProbs(torch.autograd.Function):
    """(hidden [T, D], weight [V, D]) -> (target log-probs [P], entropy of needed tokens [N])."""

    @staticmethod
    def forward(ctx, hidden, weight, plan: TargetPlan, temperature: float, use_triton: bool):
        acc_dtype = _accumulation_dtype(hidden.dtype)
        inv_temp = 1.0 / temperature
        chunk_stats = _chunk_stats_triton if use_triton else _chunk_stats_torch
        n_needed = plan.needed.numel()
        lse = torch.empty(n_needed, dtype=acc_dtype, device=hidden.device)
        entropy = torch.empty(n_needed, dtype=acc_dtype, device=hidden.device)
        target_logprob_sorted = torch.empty(plan.target_token.numel(), dtype=acc_dtype,
                                            device=hidden.device)
        for c in range(len(plan.token_bounds) - 1):
            a, b = plan.token_bounds[c], plan.token_bounds[c + 1]
            ta, tb = plan.target_bounds[c], plan.target_bounds[c + 1]
            z = _matmul_out(hidden[plan.needed[a:b]], weight.t(), acc_dtype)  # [c, V]
            lse[a:b], entropy[a:b], target_logprob_sorted[ta:tb] = chunk_stats(
                z, plan.target_slot[ta:tb] - a, plan.target_token[ta:tb], inv_temp)
            del z
        target_logprob = torch.empty_like(target_logprob_sorted)
        target_logprob[plan.target_order] = target_logprob_sorted
        ctx.save_for_backward(hidden, weight, lse, entropy)
        ctx.plan, ctx.inv_temp, ctx.use_triton = plan, inv_temp, use_triton
        ctx.set_materialize_grads(False)
        return target_logprob, entropy

    @staticmethod
    def backward(ctx, grad_target_logprob, grad_entropy):
        hidden, weight, lse, entropy = ctx.saved_tensors
        plan: TargetPlan = ctx.plan
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        nothing = (None,) * 5
        if (grad_target_logprob is None and grad_entropy is None) or not (need_hidden or need_weight):
            return nothing
        acc_dtype = lse.dtype
        grad_logits_of = _chunk_grad_logits_triton if ctx.use_triton else _chunk_grad_logits_torch
        grad_sorted = None
        if grad_target_logprob is not None:
            grad_sorted = grad_target_logprob.to(acc_dtype)[plan.target_order]
        if grad_entropy is not None:
            grad_entropy = grad_entropy.to(acc_dtype)
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_weight else None

        for c in range(len(plan.token_bounds) - 1):
            a, b = plan.token_bounds[c], plan.token_bounds[c + 1]
            ta, tb = plan.target_bounds[c], plan.target_bounds[c + 1]
            rows = plan.needed[a:b]
            slot, token = plan.target_slot[ta:tb] - a, plan.target_token[ta:tb]
            per_src = torch.zeros(b - a, dtype=acc_dtype, device=hidden.device)
            grad_target = None
            if grad_sorted is not None:
                grad_target = grad_sorted[ta:tb]
                per_src.index_add_(0, slot, grad_target)
            hidden_chunk = hidden[rows]
            z = _matmul_out(hidden_chunk, weight.t(), acc_dtype)  # recomputed [c, V] logits
            grad_logits = grad_logits_of(
                z, lse[a:b], entropy[a:b], per_src,
                None if grad_entropy is None else grad_entropy[a:b],
                slot, token, grad_target, ctx.inv_temp, hidden.dtype)
            del z
            if need_hidden:
                grad_hidden[rows] = grad_logits @ weight
            if need_weight:
                _accumulate_weight_grad(grad_weight, grad_logits, hidden_chunk)
            del grad_logits
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def _check_inputs(hidden, lm_head_weight, temperature) -> None:
    """Shape, dtype and device checks (no device read); ValueError names the argument."""
    if hidden.dim() != 2:
        raise ValueError(f"token_logprobs: hidden must be [T, D], got shape {tuple(hidden.shape)}")
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"token_logprobs: lm_head_weight must be [V, D={hidden.shape[1]}], "
                         f"got shape {tuple(lm_head_weight.shape)}")
    if not hidden.dtype.is_floating_point or lm_head_weight.dtype != hidden.dtype:
        raise ValueError(f"token_logprobs: hidden and lm_head_weight must share one float dtype, "
                         f"got {hidden.dtype} and {lm_head_weight.dtype}")
    if lm_head_weight.device != hidden.device:
        raise ValueError(f"token_logprobs: hidden is on {hidden.device}, lm_head_weight on "
                         f"{lm_head_weight.device}")
    if not float(temperature) > 0.0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature!r}")


def target_plan_of(index, vocab: int, chunk_tokens: int = 4096, *, triton: bool = False) -> TargetPlan:
    """The checked host TargetPlan of index tables (a MicrobatchIndex or anything with its target fields), for the
    Triton path (`triton`) or the torch one."""
    tables = [np.asarray(getattr(index, name).cpu() if hasattr(getattr(index, name), "cpu") else getattr(index, name))
              for name in ("target_src", "target_token", "row_target", "row_pred", "lengths")]
    num_tokens = len(index.token_ids)
    # a piece of a split tree computes only the positions its own tokens predict: partial rows
    check_targets(*tables, num_tokens, vocab, partial_rows=getattr(index, "context", None) is not None)
    return plan_targets(*tables[:4], num_tokens, chunk_tokens, triton=triton)


def _gather_rows(values: torch.Tensor, row_index: torch.Tensor) -> torch.Tensor:
    return values[row_index.clamp(min=0)].masked_fill(row_index < 0, 0.0)


def _to_rows(values: torch.Tensor, row_index: torch.Tensor, sums: RowSums | None) -> torch.Tensor:
    """values[row_index] with 0 where row_index < 0 (differentiable; backward sums duplicates: with `sums` (the
    Triton path), one segment_add in fp32, else torch's gather backward)."""
    if values.numel() == 0:  # nothing to predict; stay in the graph so backward() still works
        return values.sum().expand(row_index.shape)
    if sums is not None:
        return _RowGather.apply(values, row_index, sums)
    return _gather_rows(values, row_index)


class _RowGather(torch.autograd.Function):
    """`_gather_rows` whose backward is one `segment_add` over the plan's RowSums: fixed order, no atomics, no sort.
    The gather's own backward sorts all rows x max_len positions on every call, a cost per trajectory token that
    tree mode cannot compress (3-4% of a full-length tree step)."""

    @staticmethod
    def forward(ctx, values, row_index, sums: RowSums):
        ctx.sums, ctx.size = sums, values.shape[0]
        return _gather_rows(values, row_index)

    @staticmethod
    def backward(ctx, grad):
        sums = ctx.sums
        out = grad.new_zeros(ctx.size, 1)
        segment_add(out, sums.dst, grad.contiguous().view(-1, 1), sums.bounds, sums.src)
        return out.view(-1), None, None


def token_logprobs(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets, *,
                   chunk_tokens: int = 4096, temperature: float = 1.0,
                   use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-trajectory token log-probs and entropies, trajectory-wise layout.

    hidden         [T, D]  compact tokens after the final norm
    lm_head_weight [V, D]  same dtype and device as hidden
    targets        a `TargetPlan` on hidden's device (a model's launch plan carries one), or host index
                   tables (a `MicrobatchIndex`), which are checked, planned and uploaded here
    chunk_tokens   tokens whose [chunk_tokens, V] fp32 logits are live at once (when `targets` is tables)
    temperature    logits are divided by it before the softmax (log-probs *and* entropy)
    use_triton     one-pass Triton kernels for the element-wise softmax work (default: on CUDA
                   for fp32/bf16/fp16 inputs); False = plain torch (the CPU path)

    Returns (logprobs, entropy), both [rows, max_len]: logprobs[r, p] = log P(token_p | <p) and
    entropy[r, p] the entropy of the distribution predicting token_p, for 1 <= p < lengths[r];
    0 at p = 0 and in padding. float32 (float64 for float64 inputs). Differentiable w.r.t.
    hidden and lm_head_weight; tokens that predict nothing are never computed and get zero grad.
    """
    _check_inputs(hidden, lm_head_weight, temperature)
    if use_triton is None:
        use_triton = hidden.is_cuda and hidden.dtype != torch.float64
    elif use_triton and hidden.dtype == torch.float64:
        raise ValueError("token_logprobs: use_triton=True needs fp32/bf16/fp16 inputs, got float64")
    elif use_triton and not hidden.is_cuda and not interpreting():
        raise ValueError("token_logprobs: use_triton=True needs CUDA tensors (or TRITON_INTERPRET=1 "
                         f"on CPU), got hidden on {hidden.device}")
    if not isinstance(targets, TargetPlan):
        targets = to_device(target_plan_of(targets, lm_head_weight.shape[0], chunk_tokens, triton=use_triton),
                            hidden.device)
    if targets.num_tokens != hidden.shape[0]:
        raise ValueError(f"token_logprobs: the targets were planned for {targets.num_tokens} tokens, hidden has "
                         f"{hidden.shape[0]}")
    if targets.needed.device != hidden.device:
        raise ValueError(f"token_logprobs: the targets are on {targets.needed.device}, hidden on {hidden.device}")
    target_logprob, needed_entropy = _ChunkedLogProbs.apply(hidden, lm_head_weight, targets,
                                                            float(temperature), bool(use_triton))
    # the planned row sums serve the Triton path; the torch path (CPU, float64) keeps torch's gather backward
    target_sums, needed_sums = (targets.target_sums, targets.needed_sums) if use_triton else (None, None)
    return (_to_rows(target_logprob, targets.row_target, target_sums),
            _to_rows(needed_entropy, targets.row_needed, needed_sums))
