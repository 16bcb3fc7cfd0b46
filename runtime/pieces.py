"""Running a split tree's pieces: each piece's forward reads the carried tensors of the pieces before it.

`run_piece_chain` runs the pieces of one tree in order (codegen/pieces.py builds their tables). Per layer, a
piece's mixers read from earlier pieces the context's attention K/V, the conv inputs before their first
tokens, the replay rows and the linear-attention states their sequences start from (`ops.carry.LayerCarry`),
and keep what later pieces read. The carried tensors are the producing pieces' own tensors, so one backward of
the assembled output sends every later piece's gradient into the piece that made the tensor, and each piece's
backward runs once with the sum: every token is computed once, forward and backward, and the result is the
unsplit tree's (hence trajectory-wise training's).

The output is the tree's whole rows (a trajectory's log-probs are computed by the pieces its tokens lie in and
summed into one row: each position by exactly one piece), with the MoE statistics and aux loss over all its
pieces' tokens, each counted once per trajectory, exactly as for the unsplit tree.

Memory: every piece keeps its autograd graph until the backward (with activation checkpointing, its layer
inputs, which `TreeModel(offload_piece_inputs=True)` moves to host memory for every piece but the last:
ops/offload.py), while the activations inside a layer are bounded by the piece's tokens (the microbatch budget).
"""
from __future__ import annotations

import torch

from .moe import RouterStats
from .ops.carry import LayerCarry

_KINDS = ("kv", "conv", "replay")


def _gather(kept: list[dict], layer: int, kind: str, producers: torch.Tensor, rows: torch.Tensor, groups):
    """The carried rows of one kind for one layer, in the piece's order, from the producing pieces' kept
    tensors (context rows come from earlier pieces in increasing order: one slice per producer)."""
    parts = []
    for q, lo, hi in groups:
        source = kept[q][layer][kind]
        index = rows[lo:hi]
        parts.append(tuple(t[index] for t in source) if isinstance(source, tuple) else source[index])
    if not parts:
        return None
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(column) for column in zip(*parts))
    return torch.cat(parts)


def _groups(producers) -> list[tuple[int, int, int]]:
    """Runs of equal producer in a non-decreasing producer list: (producer, start, end)."""
    out, start = [], 0
    values = producers.tolist()
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            out.append((values[start], start, i))
            start = i
    return [run for run in out if run[2] > run[1]]


def _layer_inputs(kept: list[dict], layer: int, links, device, layer_kinds: set[str]) -> dict:
    inputs = {}
    for kind in _KINDS:
        if kind not in layer_kinds:
            continue
        producers, rows = getattr(links, kind)
        if producers.size:
            inputs[kind] = _gather(kept, layer, kind, producers, torch.as_tensor(rows, device=device),
                                   _groups(producers))
    if "states" in layer_kinds:
        producers, rows = links.state
        if producers.size:
            inputs["states"] = torch.stack([kept[q][layer]["states"][r] for q, r in
                                            zip(producers.tolist(), rows.tolist())])
    return inputs


def _layer_kinds(model) -> list[set[str]]:
    """Which carried kinds each decoder layer reads and keeps."""
    kinds = []
    for layer in model.model.layers:
        linear = layer.layer_type == "linear_attention"
        kinds.append({"conv", "replay", "states"} if linear else {"kv"})
    return kinds


def _sum_stats(per_piece: list[list[RouterStats]]) -> list[RouterStats]:
    """Per MoE layer, the routing sums over all pieces (each is a sum over that piece's tokens)."""
    if not per_piece or not per_piece[0]:
        return []
    layers = []
    for column in zip(*per_piece):
        prob = None if column[0].prob_sum is None else sum(s.prob_sum for s in column)
        layers.append(RouterStats(assigned=sum(s.assigned for s in column), prob_sum=prob,
                                  weight=sum(s.weight for s in column)))
    return layers


def lower_chain(model, chain):
    """`chain` with every piece lowered for `model` and uploaded, links included (what a trainer prepares
    while the previous step runs): its forward then reads device plans only."""
    import dataclasses

    indices = [model.launch_plan(index) for index in chain.indices]
    device = indices[0].positions.device if indices else None

    def rows_on_device(pair):
        return pair[0], torch.as_tensor(pair[1], device=device)

    links = [dataclasses.replace(link, kv=rows_on_device(link.kv), conv=rows_on_device(link.conv),
                                 replay=rows_on_device(link.replay)) for link in chain.links]
    return dataclasses.replace(chain, indices=indices, links=links)


def run_piece_chain(model, chain, **options):
    """Forward every piece of `chain` (a `codegen.pieces.PieceChain`) on `model`: the tree's TreeOutput, one
    autograd graph (the carried tensors link the pieces): `loss.backward()` runs every piece's backward once."""
    return _forward_chain(model, chain, detached=False, options=options)[0]


def run_piece_chain_detached(model, chain, **options):
    """The same forward with every carried tensor and every piece output cut into leaves: (TreeOutput over the
    leaves, `PieceBackward`). `loss.backward()` then only reaches the leaves; `PieceBackward.run()` runs the
    pieces' backwards one by one, last piece first, each once with its outputs' and carried tensors' gradients
    (what its later pieces sent back) injected. Every rank of a data-parallel step thus runs k forwards then k
    backwards for a k-piece tree, in a fixed order (FSDP2's collectives need that: `distributed.py`)."""
    out, pieces = _forward_chain(model, chain, detached=True, options=options)
    return out, PieceBackward(pieces)


class PieceBackward:
    """The pending backwards of a detached chain (see `run_piece_chain_detached`)."""

    def __init__(self, pieces: list[list[tuple[torch.Tensor, torch.Tensor]]]):
        self.pieces = pieces  # per piece: (output, its leaf) pairs

    def __len__(self) -> int:
        return len(self.pieces)

    def run(self) -> None:
        while self.pieces:
            pairs = self.pieces.pop()
            outputs, grads = [], []
            for output, leaf in pairs:
                if leaf.grad is not None:
                    outputs.append(output)
                    grads.append(leaf.grad)
            if not outputs:  # nothing reached this piece: a zero backward still runs (lockstep collectives)
                outputs, grads = [pairs[0][0]], [torch.zeros_like(pairs[0][0])]
            torch.autograd.backward(outputs, grads)


def _forward_chain(model, chain, *, detached: bool, options: dict):
    from .model import tree_output  # model.py dispatches here: import at call time

    kinds = _layer_kinds(model)
    kept: list[dict] = []
    pending: list[list] = []  # detached: per piece, (output, leaf) pairs
    rows_lp, rows_ent, stats = [], [], []
    position = {tid: j for j, tid in enumerate(chain.trajectory_ids)}

    def leaf(pairs, tensor):
        if not detached or not tensor.requires_grad:
            return tensor
        cut = tensor.detach().requires_grad_()
        pairs.append((tensor, cut))
        return cut

    for number, (index, links) in enumerate(zip(chain.indices, chain.links)):
        plan = model.launch_plan(index, reference_gdn=options.get("gdn_kernel") is not None
                                 or options.get("kda_kernel") is not None)
        carries = {i: LayerCarry(plan.piece, _layer_inputs(kept, i, links, plan.positions.device, kinds[i]))
                   for i in range(len(kinds))}
        offload = model.offload_piece_inputs and number < len(chain.indices) - 1  # the last piece's backward is next
        # the root module's forward: FSDP2's hooks run per piece
        piece_out = model(plan, carries=carries, offload_inputs=offload, **options)
        logprobs, entropy, router_stats = piece_out.logprobs, piece_out.entropy, piece_out.router_stats or []
        pairs: list = []
        kept.append({i: {kind: (tuple(leaf(pairs, t) for t in value) if isinstance(value, tuple)
                                else leaf(pairs, value)) for kind, value in carry.kept.items()}
                     for i, carry in carries.items()})
        logprobs, entropy = leaf(pairs, logprobs), leaf(pairs, entropy)
        router_stats = [RouterStats(assigned=s.assigned, weight=s.weight,
                                    prob_sum=None if s.prob_sum is None else leaf(pairs, s.prob_sum))
                        for s in router_stats]
        pending.append(pairs)
        rows = torch.as_tensor([position[t] for t in plan.trajectory_ids], dtype=torch.long, device=logprobs.device)
        rows_lp.append((rows, logprobs))
        rows_ent.append((rows, entropy))
        stats.append(router_stats)
    n, width = len(chain.trajectory_ids), int(chain.lengths.max(initial=0))
    logprobs = _assemble(rows_lp, n, width)
    entropy = _assemble(rows_ent, n, width)
    lengths = torch.as_tensor(chain.lengths, device=logprobs.device)
    out = tree_output(chain.trajectory_ids, logprobs, entropy, lengths, _sum_stats(stats), model.config)
    return out, pending


def _assemble(parts, n: int, width: int) -> torch.Tensor:
    """Whole rows from the pieces' partial rows (each position is computed by exactly one piece, 0 elsewhere)."""
    first = parts[0][1]
    out = first.new_zeros((n, width))
    for rows, values in parts:
        out = out.index_add(0, rows, torch.nn.functional.pad(values, (0, width - values.shape[1])))
    return out
