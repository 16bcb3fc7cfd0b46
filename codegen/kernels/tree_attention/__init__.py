"""Tree attention over compact tokens: mask ``j <= i < subtree_end[j]`` (docs/INTERFACES.md 4)."""
from .reference import (check_tree_attention_inputs, tree_attention_reference,
                        tree_attention_reference_chunked, tree_mask)

__all__ = ["check_tree_attention_inputs", "tree_attention_reference",
           "tree_attention_reference_chunked", "tree_mask"]
