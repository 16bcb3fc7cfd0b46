"""Runtime: exact tree-mode execution of Qwen3-Next-family models over compiled microbatches."""
from .config import PRESETS, ModelConfig, UnsupportedModelError
from .model import InvalidBatchError, TreeModel, TreeOutput
from .trajectory import trajectory_wise

__all__ = ["PRESETS", "InvalidBatchError", "ModelConfig", "TreeModel", "TreeOutput", "UnsupportedModelError",
           "trajectory_wise"]
