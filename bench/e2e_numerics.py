"""The numerics check of bench/e2e.py: log-probs of tree mode and of trajectory-wise mode, both in bf16, against
a float64 trajectory-wise reference of the same weights that runs the plain-torch kernels (stricter than fp32,
whose Triton matmuls may round through TF32), on the first trajectories of a preset's batch."""
from __future__ import annotations

import numpy as np
import torch

import harts_compiler as hc
from harts_compiler.codegen.kernels.chunk_gdn import chunk_gated_delta_rule_reference
from harts_compiler.codegen.kernels.chunk_kda import chunk_kimi_delta_attention_reference
from common import linear_kernel_arguments, plan_microbatches, trajectory_microbatches


def subset(batch, tokens: int):
    """The first trajectories (input order) whose tokens fit in `tokens` (at least one)."""
    cut = max(1, int(np.searchsorted(np.cumsum(batch.lengths), tokens, side="right")))
    return hc.TreeBatch.from_trajectories([batch.trajectory(j) for j in range(cut)], list(batch.ids[:cut]))


# the float64 numerics reference: the plain-torch kernel of each linear-attention rule
REFERENCE_KERNELS = {"gdn": chunk_gated_delta_rule_reference, "kda": chunk_kimi_delta_attention_reference}


def logprob_rows(outputs) -> dict:
    """{trajectory id: float64 log-probs of positions 1..len-1} from TreeOutputs."""
    rows = {}
    for out in outputs:
        logprobs = out.logprobs.detach().double().cpu().numpy()
        for r, (traj_id, n) in enumerate(zip(out.trajectory_ids, out.lengths.tolist())):
            rows[traj_id] = logprobs[r, 1:n]
    return rows


def max_abs_difference(rows, reference) -> float:
    return max(float(np.abs(rows[k] - v).max(initial=0.0)) for k, v in reference.items())


def mean_abs_difference(rows, reference) -> float:
    """Mean over all scored tokens: the max alone is one token's worst case."""
    diffs = np.concatenate([np.abs(rows[k] - v).ravel() for k, v in reference.items()])
    return float(diffs.mean()) if diffs.size else 0.0


def numerics(row, model, reference, args) -> None:
    """Fills row['err_tree'], row['err_traj'] (max |log-prob - float64 reference|) and their means."""
    batch = subset(row.pop("_batch"), args.numerics_tokens)
    with torch.no_grad():
        shape = dict(chunk_size=args.chunk_size, conv_width=model.conv_width)
        _, tree_indices, *_ = plan_microbatches(batch, args.microbatch_tokens, args.device, **shape)
        traj_indices = trajectory_microbatches(batch, args.microbatch_tokens, **shape)
        tree = logprob_rows(model(i) for i in tree_indices)
        traj = logprob_rows(model(i) for i in traj_indices)
        kernels = linear_kernel_arguments(model.config, REFERENCE_KERNELS[model.config.linear_rule])
        ref = logprob_rows(reference(i, **kernels) for i in traj_indices)
    row.update(numerics_trajectories=len(batch), numerics_tokens=int(batch.lengths.sum()),
               err_tree=max_abs_difference(tree, ref), err_traj=max_abs_difference(traj, ref),
               err_tree_vs_traj=max_abs_difference(tree, traj), mean_err_tree=mean_abs_difference(tree, ref),
               mean_err_traj=mean_abs_difference(traj, ref))
    row["numerics_ok"] = bool(row["err_tree"] <= args.error_factor * row["err_traj"])
