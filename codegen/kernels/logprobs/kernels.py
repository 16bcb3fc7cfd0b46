"""Triton kernels for the per-chunk softmax statistics and logit gradients of `token_logprobs`.

The chunked op's matmuls are cuBLAS; what is left per chunk is element-wise work over a
``[C, V]`` fp32 logits buffer, which plain torch does in ~8 memory passes. Each kernel here
makes one pass (one program per row, looping over the vocabulary in blocks of ``BV``):

- `logits_stats`: online ``lse = log sum exp(z / T)`` and entropy ``H = lse - sum p z / T``
  (accumulated centred on the running max, so ``H`` suffers no cancellation);
- `logits_grad`:  ``d z = -p (G + g_H (log p + H)) / T`` written straight in the hidden dtype
  (the one-hot ``+ g_t / T`` terms of the targets are added by the caller, a few entries).

Both take the *raw* logits (temperature applied on load), so no extra pass divides by T.
The vocabulary size is a constexpr: fixed per model (one compile), and the vocabulary loop
then has static bounds, which Triton's CPU interpreter also needs.
Run on CPU under ``TRITON_INTERPRET=1`` (tests) at small sizes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def logits_stats_kernel(
    z,          # [C, V] fp32 raw logits
    lse,        # [C] fp32 out: logsumexp of z / T
    entropy,    # [C] fp32 out: entropy of softmax(z / T)
    stride_z,
    inv_temp,
    V: tl.constexpr,
    BV: tl.constexpr,
):
    i_c = tl.program_id(0)
    p_row = z + i_c.to(tl.int64) * stride_z
    b_m = float("-inf")  # running max
    b_s = 0.0  # running sum of exp(x - m)
    b_t = 0.0  # running sum of exp(x - m) * (x - m): centred, so H needs no cancellation
    for v_start in range(0, V, BV):
        o_v = v_start + tl.arange(0, BV)
        m_v = o_v < V
        b_x = tl.load(p_row + o_v, mask=m_v, other=float("-inf")).to(tl.float32) * inv_temp
        b_m_new = tl.maximum(b_m, tl.max(b_x, axis=0))
        b_alpha = tl.exp(b_m - b_m_new)
        b_e = tl.exp(b_x - b_m_new)  # 0 where masked (x = -inf, m_new finite)
        # re-centre the old sum on m_new: sum e^{x-m_new}(x-m_new) = alpha (t + (m - m_new) s)
        b_shift = tl.where(b_s > 0, (b_m - b_m_new) * b_s, 0.0)
        b_t = b_alpha * (b_t + b_shift) + tl.sum(tl.where(m_v, b_e * (b_x - b_m_new), 0.0), axis=0)
        b_s = b_s * b_alpha + tl.sum(b_e, axis=0)
        b_m = b_m_new
    # lse = m + log s;  H = lse - E_p[x] = log s - t / s (both terms >= 0)
    tl.store(lse + i_c, b_m + tl.log(b_s))
    tl.store(entropy + i_c, tl.log(b_s) - b_t / b_s)


@triton.jit
def logits_grad_kernel(
    z,          # [C, V] fp32 raw logits
    dz,         # [C, V] out, hidden dtype: -p (G + g_H (log p + H)) / T
    lse,        # [C] fp32
    entropy,    # [C] fp32
    grad_src,   # [C] fp32, G: sum of the log-prob grads of the targets this row predicts
    grad_entropy,  # [C] fp32, g_H (unused unless HAS_ENTROPY)
    stride_z,
    stride_dz,
    inv_temp,
    V: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    BV: tl.constexpr,
):
    i_c = tl.program_id(0)
    p_row = z + i_c.to(tl.int64) * stride_z
    p_out = dz + i_c.to(tl.int64) * stride_dz
    b_lse = tl.load(lse + i_c)
    b_coef0 = tl.load(grad_src + i_c)
    if HAS_ENTROPY:
        b_gh = tl.load(grad_entropy + i_c)
        b_h = tl.load(entropy + i_c)
    for v_start in range(0, V, BV):
        o_v = v_start + tl.arange(0, BV)
        m_v = o_v < V
        b_logp = tl.load(p_row + o_v, mask=m_v, other=0.0).to(tl.float32) * inv_temp - b_lse
        b_p = tl.exp(b_logp)
        if HAS_ENTROPY:
            b_coef = b_coef0 + b_gh * (b_logp + b_h)
        else:
            b_coef = b_coef0
        b_d = -b_p * b_coef * inv_temp
        tl.store(p_out + o_v, b_d.to(p_out.dtype.element_ty), mask=m_v)


def _block_v(vocab: int) -> int:
    return min(triton.next_power_of_2(vocab), 4096)


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits must be a row-contiguous fp32 [C, V] tensor, got {logits.dtype} "
                         f"{tuple(logits.shape)} strides {logits.stride()}")


def logits_stats(logits: torch.Tensor, inv_temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse [C], entropy [C]) of softmax(logits * inv_temperature), fp32, one pass."""
    _check_logits(logits)
    n_rows, vocab = logits.shape
    lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(lse)
    if n_rows:
        logits_stats_kernel[(n_rows,)](logits, lse, entropy, logits.stride(0),
                                       float(inv_temperature), V=vocab, BV=_block_v(vocab),
                                       num_warps=8)
    return lse, entropy


def logits_grad(logits: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                grad_src: torch.Tensor, grad_entropy: torch.Tensor | None,
                inv_temperature: float, out_dtype: torch.dtype) -> torch.Tensor:
    """d loss / d logits without the targets' one-hot terms, in ``out_dtype`` [C, V]."""
    _check_logits(logits)
    n_rows, vocab = logits.shape
    grad = torch.empty(logits.shape, dtype=out_dtype, device=logits.device)
    if n_rows:
        has_entropy = grad_entropy is not None
        logits_grad_kernel[(n_rows,)](
            logits, grad, lse.float().contiguous(), entropy.float().contiguous(),
            grad_src.float().contiguous(),
            grad_entropy.float().contiguous() if has_entropy else grad_src,
            logits.stride(0), grad.stride(0), float(inv_temperature), V=vocab,
            HAS_ENTROPY=has_entropy, BV=_block_v(vocab), num_warps=8)
    return grad
