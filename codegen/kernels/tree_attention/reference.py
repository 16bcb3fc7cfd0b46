"""Plain-torch tree attention: the CPU path and the oracle of the Triton kernels.

Tree mask over compact tokens (docs/design.md section 4): query ``i`` attends key ``j`` iff
``j <= i < subtree_end[j]``. Every query sees at least itself (``subtree_end[i] > i``), so no
softmax row is empty. The queries may be the last ``Tq`` of the ``Tk`` key tokens (``i`` global,
``Tk - Tq`` context keys first), and the value head dim may differ from the q/k one (MLA).

Two variants with the same signature and the same result:
- ``tree_attention_reference``: dense ``[HQ, T, T]`` masked softmax (simple, for tiny sizes);
- ``tree_attention_reference_chunked``: the same over blocks of queries, each block checkpointed
  under autograd, so memory stays ``O(HQ * chunk * T)`` in forward and backward (a few thousand
  tokens on CPU).
``tree_attention_fp32_oracle`` gives the chunked reference's output and gradients in fp32, the
yardstick of the GPU tests and benchmarks.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def check_tree_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                subtree_end: torch.Tensor) -> None:
    """Raise a ValueError naming the offending argument for any contract violation.

    q [Tq, HQ, D], k [Tk, HKV, D], v [Tk, HKV, Dv], subtree_end [Tk] with Tq <= Tk: the queries are the
    last Tq tokens (query offset Tk - Tq); Tq == Tk is the plain case. Dv may differ from D (MLA)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [Tq, HQ, D], got shape {tuple(q.shape)}")
    if k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"k and v must be [Tk, HKV, D] and [Tk, HKV, Dv], got {tuple(k.shape)} and {tuple(v.shape)}")
    n_queries, n_q_heads, head_dim = q.shape
    n_keys = k.shape[0]
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must agree in tokens and heads, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[2] != head_dim:
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} (D must agree)")
    if n_queries > n_keys:
        raise ValueError(f"q has Tq={n_queries} rows, more than the Tk={n_keys} of k "
                         "(the queries are a suffix of the keys)")
    if k.shape[1] == 0 or n_q_heads % k.shape[1] != 0:
        raise ValueError(f"q heads ({n_q_heads}) must be a multiple of k/v heads ({k.shape[1]})")
    if not (q.dtype.is_floating_point and k.dtype == q.dtype and v.dtype == q.dtype):
        raise ValueError(f"q, k, v must share one float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if subtree_end.dim() != 1 or subtree_end.shape[0] != n_keys:
        raise ValueError(f"subtree_end must be [Tk={n_keys}], got shape {tuple(subtree_end.shape)}")
    if subtree_end.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"subtree_end must be int32 or int64, got {subtree_end.dtype}")
    if subtree_end.device != q.device or k.device != q.device or v.device != q.device:
        raise ValueError("q, k, v and subtree_end must be on one device, got "
                         f"{q.device}, {k.device}, {v.device}, {subtree_end.device}")


def tree_mask(subtree_end: torch.Tensor, query_index: torch.Tensor,
              key_index: torch.Tensor) -> torch.Tensor:
    """Boolean [len(query_index), len(key_index)]: may query i attend key j."""
    i = query_index[:, None]
    j = key_index[None, :]
    return (j <= i) & (i < subtree_end[key_index].to(torch.int64)[None, :])


def _repeat_kv(x: torch.Tensor, n_q_heads: int) -> torch.Tensor:
    # [T, HKV, D] -> [HKV*G, T, D]: query head h reads kv head h // G (GQA by repetition)
    group = n_q_heads // x.shape[1]
    return x.transpose(0, 1).repeat_interleave(group, dim=0)


def _masked_softmax_attention(q_heads: torch.Tensor, k_heads: torch.Tensor, v_heads: torch.Tensor,
                              mask: torch.Tensor, scale: float) -> torch.Tensor:
    # q_heads [H, M, D], k_heads [H, N, D], v_heads [H, N, Dv], mask [M, N] -> [M, H, Dv]
    scores = torch.matmul(q_heads, k_heads.transpose(1, 2)) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v_heads).transpose(0, 1)


def tree_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             subtree_end: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Dense masked softmax. q [Tq, HQ, D], k [Tk, HKV, D], v [Tk, HKV, Dv], subtree_end [Tk]
    -> o [Tq, HQ, Dv]; the queries are the last Tq tokens."""
    check_tree_attention_inputs(q, k, v, subtree_end)
    n_queries, n_q_heads, _ = q.shape
    n_keys = k.shape[0]
    key_index = torch.arange(n_keys, device=q.device)
    mask = tree_mask(subtree_end, key_index[n_keys - n_queries:], key_index)
    return _masked_softmax_attention(q.transpose(0, 1), _repeat_kv(k, n_q_heads),
                                     _repeat_kv(v, n_q_heads), mask, scale)


def tree_attention_reference_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     subtree_end: torch.Tensor, *, scale: float,
                                     query_chunk: int = 256) -> torch.Tensor:
    """Same result as ``tree_attention_reference`` with memory bounded by ``query_chunk``.

    Queries ``[s, e)`` (global rows) only see keys ``< e`` (``j <= i``), so each chunk reads a key
    prefix. Under autograd each chunk is checkpointed: its [H, chunk, e] scores are recomputed in the
    backward instead of kept alive for the whole sequence.
    """
    check_tree_attention_inputs(q, k, v, subtree_end)
    if query_chunk <= 0:
        raise ValueError(f"query_chunk must be positive, got {query_chunk}")
    n_queries, n_q_heads, _ = q.shape
    n_keys = k.shape[0]
    offset = n_keys - n_queries
    k_heads = _repeat_kv(k, n_q_heads)
    v_heads = _repeat_kv(v, n_q_heads)
    q_heads = q.transpose(0, 1)
    index = torch.arange(n_keys, device=q.device)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))

    def one_chunk(q_chunk, k_prefix, v_prefix, query_index):
        mask = tree_mask(subtree_end, query_index, index[:k_prefix.shape[1]])
        return _masked_softmax_attention(q_chunk, k_prefix, v_prefix, mask, scale)

    outputs = []
    # at least one (possibly empty) chunk, so an empty output still hangs off q, k and v in the graph
    for start in range(0, max(n_queries, 1), query_chunk):
        end = min(start + query_chunk, n_queries)
        args = (q_heads[:, start:end], k_heads[:, :offset + end], v_heads[:, :offset + end],
                index[offset + start:offset + end])
        if needs_grad:
            outputs.append(checkpoint(one_chunk, *args, use_reentrant=False))
        else:
            outputs.append(one_chunk(*args))
    return torch.cat(outputs, dim=0)


def tree_attention_fp32_oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                               subtree_end: torch.Tensor, *, scale: float,
                               query_chunk: int = 256) -> list[torch.Tensor]:
    """[o, dq, dk, dv] of the chunked reference on q, k, v upcast to fp32, output gradient ``do``.

    TF32 matmuls are switched off meanwhile: on CUDA they would make the oracle itself only
    ~1e-3 accurate, the size of the bf16 errors it is there to measure.
    """
    leaves = [x.float().requires_grad_() for x in (q, k, v)]
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        out = tree_attention_reference_chunked(*leaves, subtree_end, scale=scale, query_chunk=query_chunk)
        grads = torch.autograd.grad(out, leaves, do.float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return [out.detach(), *grads]
