"""Tree attention over compact tokens: mask ``j <= i < subtree_end[j]`` (docs/INTERFACES.md 4).

``tree_attention`` (Triton on CUDA, reference on CPU) and ``build_block_index`` (visit lists,
built once per microbatch and passed to every layer's call) are the public entry points.
"""
from .block_index import BlockIndex, build_block_index, query_windows
from .configs import KernelConfig, config_for, supports_head_dims
from .function import tree_attention, uses_triton
from .reference import (check_tree_attention_inputs, tree_attention_fp32_oracle, tree_attention_reference,
                        tree_attention_reference_chunked, tree_mask)

__all__ = ["BlockIndex", "build_block_index", "query_windows", "KernelConfig", "config_for", "supports_head_dims",
           "tree_attention", "uses_triton", "check_tree_attention_inputs", "tree_attention_fp32_oracle",
           "tree_attention_reference", "tree_attention_reference_chunked", "tree_mask"]
