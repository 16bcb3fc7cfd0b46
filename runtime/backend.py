"""Which kernels run a model: the one place that chooses between the Triton kernels and the torch reference.

The Triton kernels run 16-bit models on CUDA (the shapes checked on the H200); fp32 and fp64 models run the
exact plain-torch paths (the kernels' dots would take fp32 operands through TF32, ~1e-3 relative), which are
also the CPU path and the oracle. The choice is made once per forward, from the model and its parameters'
dtype and device, as the `LaunchTarget` that the plan is lowered for; the ops read it from the plan. Tree
attention's Triton / Gluon choice on Hopper is the kernel's own (by device and dtype, at call time:
`tree_attention.function.hopper_launches`); the plan's attention tiles hold the block lists of both.
"""
from __future__ import annotations

import torch

from harts_compiler.codegen import LaunchTarget
from harts_compiler.codegen.kernels.chunk_gdn import GDNKernelConfig, triton_supports
from harts_compiler.codegen.kernels.tree_attention import config_for, supports_head_dims

from .config import ModelConfig

HALF_DTYPES = (torch.bfloat16, torch.float16)


def select_backend(config: ModelConfig, dtype: torch.dtype, device, *, triton_linear_attention: bool = True,
                   reference_gdn: bool = False, gdn_config: GDNKernelConfig | None = None) -> LaunchTarget:
    """The LaunchTarget of a model whose parameters have `dtype` on `device`: its sizes and the kernels of each
    op family. `triton_linear_attention=False` keeps GDN and the short conv on torch (the model's option);
    `reference_gdn`: the caller passes its own reference kernel (the tests' token-loop oracle). `gdn_triton`
    selects the Triton kernels of the model's delta rule (GDN, or KDA for Kimi-style models: the same plan and
    shapes); attention takes MLA's q/k head dim (nope + rope) with its own v head dim."""
    cuda, half = torch.device(device).type == "cuda", dtype in HALF_DTYPES
    linear = cuda and half and triton_linear_attention
    qk_dim, v_dim = config.attention_head_dims
    attention = cuda and half and supports_head_dims(qk_dim, v_dim)
    return LaunchTarget(
        vocab_size=config.vocab_size, conv_width=config.linear_conv_kernel_dim,
        gdn_triton=linear and not reference_gdn
        and triton_supports(dtype, config.linear_key_head_dim, config.linear_value_head_dim),
        conv_triton=linear, attention_tiles=config_for(qk_dim, v_dim).tiles if attention else (),
        logprobs_triton=cuda and dtype != torch.float64, embed_triton=cuda and half,
        gdn_config=gdn_config or GDNKernelConfig())
