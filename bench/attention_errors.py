"""Errors of the trajectory-wise SDPA anchors against the fp32 oracle of the tree, on the rows ours is measured on.

A tree's output gradient `do` is given per compact token. Trajectory-wise, each query token's `do` goes to the
first trajectory that holds it and zero to the others (`trajectory_groups(..., owned_only=True)` in
bench/attention.py): that is one valid trajectory-wise loss, and its exact gradients summed per compact token are
the tree's exactly (a query row's dq and its share of dk / dv are linear in its own do). So the anchor's output
(from each token's first trajectory) and its gradients summed per token in fp32 are compared with the same fp32
oracle as ours, row for row, instead of over the trajectories' duplicated rows.
"""
from __future__ import annotations

import torch
from common import format_table, rel_error


def anchor_errors(one, groups, ref, offset: int) -> list[float]:
    """[o, dq, dk, dv] errors of the anchor `one(context, q, k, v)` run on `groups` (trajectory_groups with
    owned_only) against `ref` ([o, dq, dk, dv] of the tree's query rows >= offset and all its key rows)."""
    leaves = [t for group in groups for t in group[1:4]]
    outs = [one(group[0], *group[1:4]) for group in groups]
    grads = torch.autograd.grad(outs, leaves, [group[4] for group in groups])
    o, dq, dk, dv = (torch.zeros_like(r) for r in ref)
    for at, (context, *_, index, owned) in enumerate(groups):
        rows = index[:, context:] - offset
        out, g_q, g_k, g_v = outs[at], *grads[3 * at:3 * at + 3]
        o[rows[owned]] = out.transpose(1, 2)[owned].float()
        dq.index_add_(0, rows.flatten(), g_q.transpose(1, 2).flatten(0, 1).float())
        dk.index_add_(0, index.flatten(), g_k.transpose(1, 2).flatten(0, 1).float())
        dv.index_add_(0, index.flatten(), g_v.transpose(1, 2).flatten(0, 1).float())
    return [rel_error(a, b) for a, b in zip((o, dq, dk, dv), ref)]


def error_table(rows: list[dict]) -> str:
    """One line per case and tensor: ours, cuDNN's, flash's error and ours over the smaller of the two."""
    lines = []
    for row in rows:
        for at, tensor in enumerate(("o", "dq", "dk", "dv")):
            line = {"case": row["case"], "tensor": tensor,
                    **{n: row[n][at] for n in ("ours", "cudnn", "flash") if n in row}}
            others = [line[n] for n in ("cudnn", "flash") if n in line]
            line["ratio"] = line["ours"] / min(others) if others and min(others) > 0 else None
            lines.append(line)
    return format_table(lines, [("case", "case"), ("tensor", "tensor"), ("ours", "ours"), ("cudnn", "cuDNN"),
                                ("flash", "flash"), ("ratio", "ours / best SDPA")])
