"""Tree-aware short causal conv (docs/INTERFACES.md section 4, `causal_conv`)."""
from .function import ConvIndex, TreeCausalConvFunction, prepare_conv_index, tree_causal_conv
from .reference import tree_causal_conv_parts_reference, tree_causal_conv_reference

__all__ = ["ConvIndex", "TreeCausalConvFunction", "prepare_conv_index", "tree_causal_conv",
           "tree_causal_conv_parts_reference", "tree_causal_conv_reference"]
