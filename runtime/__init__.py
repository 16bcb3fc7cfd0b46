"""Runtime: exact tree-mode execution of Qwen3-Next-family models over compiled microbatches.

    model = TreeModel.from_hf(hf_model)            # shares the HF parameters (no copy)
    model = TreeModel.from_pretrained(path)        # config.json + safetensors, names as on disk
    model = TreeModel.from_config("tiny-qwen3-next", seed=0, dtype=torch.float64)   # PRESETS
    out = model(microbatch_index_or_plan_microbatch, activation_checkpointing=False)
    out = trajectory_wise(model, token_lists_or_tree_batch)   # the baseline, same TreeOutput

TreeOutput: trajectory_ids, logprobs / entropy [rows, max_len] (fp32; fp64 for fp64 models),
lengths, aux_loss (transformers' load-balancing loss over the trajectories, unscaled by
router_aux_loss_coef; None without MoE), expert_load [moe_layers, E] (top-k assignments counted
once per trajectory).
"""
from .config import PRESETS, ModelConfig, UnsupportedModelError
from .model import InvalidBatchError, TreeModel, TreeOutput
from .trajectory import trajectory_wise

__all__ = ["PRESETS", "InvalidBatchError", "ModelConfig", "TreeModel", "TreeOutput", "UnsupportedModelError",
           "trajectory_wise"]
