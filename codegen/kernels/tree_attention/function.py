"""Autograd Function and public wrapper of tree attention (docs/INTERFACES.md section 4).

``tree_attention`` runs the Triton kernels on CUDA tensors, and on CPU tensors under
``TRITON_INTERPRET=1`` (tests at tiny sizes); otherwise, and always for float64, it runs the
plain-torch reference (query-chunked, so a few thousand tokens fit on CPU). On Hopper (sm_90), for
bf16 / fp16 inputs whose config names Gluon launches (head dim 256, MLA), the Gluon kernels run instead: the
same contract, warp-specialised with TMA producers (``hopper_launches``).
"""
from __future__ import annotations

import torch

from ..interpreter_safe import interpreter_needs_fp32, interpreting
from ..upload import to_device
from .backward import bwd_delta, bwd_dkdv, bwd_dq
from .block_index import BlockIndex, build_block_index
from .configs import GLUON_HEAD_DIMS, KernelConfig, config_for
from .forward import tree_attention_forward
from .reference import check_tree_attention_inputs, tree_attention_reference_chunked

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def gluon_kernels():
    """(forward_gluon, backward_gluon, backward_dkdv_gluon), or None where Triton lacks Gluon's Hopper API as the
    kernels use it (warp_specialize with per-partition registers: Triton >= 3.6). Imported on first use, so runs
    that never reach a Hopper GPU do not pay for Gluon's import."""
    try:
        from . import backward_dkdv_gluon, backward_gluon, forward_gluon
    except ImportError:
        return None
    return forward_gluon, backward_gluon, backward_dkdv_gluon


def hopper_launches(q: torch.Tensor, v: torch.Tensor, config: KernelConfig) -> dict | None:
    """The Gluon launches of ``config`` when its Hopper kernels run this input, else None (the Triton kernels run):
    CUDA tensors on an sm_90 device, bf16 / fp16, head dims whose Gluon launches are tuned and GPU-tested
    (``GLUON_HEAD_DIMS``: a config found for other dims may carry launches meant for its tuned dims) and a Triton
    that has Gluon's Hopper API."""
    if config.gluon is None or not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return None
    if (q.shape[2], v.shape[2]) not in GLUON_HEAD_DIMS:
        return None
    if torch.cuda.get_device_capability(q.device) != (9, 0) or gluon_kernels() is None:
        return None
    return config.gluon


class TreeAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, subtree_end, scale: float, index: BlockIndex, config: KernelConfig):
        gluon = hopper_launches(q, v, config)
        if gluon:
            o, lse = gluon_kernels()[0].tree_attention_forward_gluon(q, k, v, subtree_end, index, scale,
                                                                      gluon["fwd"])
        else:
            o, lse = tree_attention_forward(q, k, v, subtree_end, index, scale, config.fwd)
        ctx.save_for_backward(q, k, v, o, lse, subtree_end)
        ctx.scale, ctx.index, ctx.config, ctx.gluon = scale, index, config, gluon
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, subtree_end = ctx.saved_tensors
        do = do.contiguous()
        delta = bwd_delta(o, do)
        args = (q, k, v, do, lse, delta, subtree_end, ctx.index, ctx.scale)
        if ctx.gluon:
            _, backward_gluon, backward_dkdv_gluon = gluon_kernels()
            dq = backward_gluon.bwd_dq_gluon(*args, ctx.gluon["dq"])
            dk, dv = backward_dkdv_gluon.bwd_dkdv_gluon(*args, ctx.gluon["dkdv"])
        else:
            dq = bwd_dq(*args, ctx.config.dq)
            dk, dv = bwd_dkdv(*args, ctx.config.dkdv)
        return dq, dk, dv, None, None, None, None


def uses_triton(q: torch.Tensor) -> bool:
    """Whether `tree_attention` runs the Triton kernels for this input."""
    if q.dtype not in KERNEL_DTYPES:
        return False
    return q.is_cuda or interpreting()


def _check_block_index(index: BlockIndex, subtree_end: torch.Tensor, num_queries: int) -> None:
    if not isinstance(index, BlockIndex):
        raise ValueError(f"block_index must be a BlockIndex from build_block_index, got {type(index)}")
    if index.num_tokens != subtree_end.shape[0]:
        raise ValueError(f"block_index was built for T={index.num_tokens} tokens, "
                         f"but subtree_end has T={subtree_end.shape[0]}")
    if index.num_queries != num_queries:
        raise ValueError(f"block_index was built for Tq={index.num_queries} queries, but q has Tq={num_queries} "
                         "rows (build_block_index(..., num_queries=Tq))")
    if index.device != subtree_end.device:
        raise ValueError(f"block_index is on {index.device}, subtree_end on {subtree_end.device}")


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, subtree_end: torch.Tensor,
                   *, scale: float, block_index: BlockIndex | None = None,
                   config: KernelConfig | None = None) -> torch.Tensor:
    """Exact softmax attention with the tree mask ``j <= i < subtree_end[j]``.

    q [Tq, HQ, D], k [Tk, HKV, D], v [Tk, HKV, Dv] (HQ % HKV == 0, Tq <= Tk), subtree_end [Tk] int32
    -> o [Tq, HQ, Dv]. The queries are the last Tq tokens (global row = local + Tk - Tq): the first
    Tk - Tq keys are context (an earlier microbatch's ancestors, say) and get gradients too.
    Dv may differ from D (MLA: 192 / 128).
    ``block_index``: ``build_block_index(subtree_end, config.block_m, config.block_n, num_queries=Tq)
    .with_tiles(subtree_end, config.tiles)`` uploaded to q's device, built once per microbatch and read by
    every layer; built here (from a host copy of ``subtree_end``) if omitted.
    ``config``: launch configuration override (benchmarks); default per head dims.
    """
    check_tree_attention_inputs(q, k, v, subtree_end)
    if not uses_triton(q):
        return tree_attention_reference_chunked(q, k, v, subtree_end, scale=scale)
    default = config_for(q.shape[2], v.shape[2])  # validates the head dims even when a config is given
    config = config or default
    if interpreter_needs_fp32(q):  # the interpreter's 16-bit dots are wrong: fp32, autograd casts back
        out = tree_attention(q.float(), k.float(), v.float(), subtree_end, scale=scale,
                             block_index=block_index, config=config)
        return out.to(q.dtype)
    if block_index is None:  # standalone use: plan on the host, upload (a model's launch plan carries it)
        block_index = build_block_index(subtree_end, config.block_m, config.block_n, num_queries=q.shape[0])
    if not isinstance(block_index.q_ptr, torch.Tensor):  # a host index: its other tiles, then one upload
        block_index = to_device(block_index.with_tiles(subtree_end, config.tiles), q.device)
    _check_block_index(block_index, subtree_end, q.shape[0])
    return TreeAttentionFunction.apply(q.contiguous(), k.contiguous(), v.contiguous(),
                                       subtree_end.contiguous(), float(scale), block_index, config)
