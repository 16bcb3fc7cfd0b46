"""bench/fsdp_memory.py on the tiny model over 2 gloo ranks: the per-rank shards read from FSDP2's layout
add up to the replica exactly, the padded storage exceeds it by exactly FSDP2's dim-0 padding, and each
rank holds about half (plain FSDP2 and expert parallelism over both ranks)."""
from __future__ import annotations

import math
import sys

import torch
from bench_scripts import BENCH

WORLD = 2


def import_bench():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # the spawned ranks inherit sys.path and import the script by name
    import fsdp_memory
    return fsdp_memory


def padded_elements_over_ranks(config, world_size: int, ep: int) -> int:
    """Elements of FSDP2's padded shards summed over the ranks: dim 0 rounded up to a multiple of the
    ranks sharding it (torch.chunk's layout: every rank stores the first chunk's size). Routed experts
    are split over "ep" first (E / ep per rank), then sharded over the world / ep ranks holding them."""
    from harts_compiler.runtime import TreeModel
    with torch.device("meta"):
        model = TreeModel(config, activation_checkpointing=False)
    total = 0
    for name, param in model.named_parameters():
        expert = ".mlp.experts." in name and ep > 1
        rows, shards, copies = ((param.shape[0] // ep, world_size // ep, ep) if expert
                                else (param.shape[0], world_size, 1))
        total += copies * shards * math.ceil(rows / shards) * (param.numel() // param.shape[0])
    return total


def test_shards_add_up_to_the_replica():
    fsdp_memory = import_bench()
    from common import model_config
    config = model_config(tiny=True)
    rows = fsdp_memory.measure(config, WORLD, [1, 2])
    assert sorted(rows) == [1, 2]
    for ep, ranks in rows.items():
        assert len(ranks) == WORLD and all(r is not None for r in ranks)
        full = ranks[0]["full_elements"]
        assert sum(r["local_elements"] for r in ranks) == full
        padded = sum(r["padded_elements"] for r in ranks)
        assert padded == padded_elements_over_ranks(config, WORLD, ep) > full  # the tiny model pads
        assert sum(r["params"] for r in ranks) == sum(r["grads"] for r in ranks) == 4 * padded
        assert sum(r["adamw"] for r in ranks) == 8 * full
        assert all(r["replica"] == 16 * full for r in ranks)
        for r in ranks:
            assert abs(r["padded_elements"] - full / WORLD) <= 0.02 * full / WORLD
            assert r["gathered"] > 0
    # with the experts split over both ranks, a layer all-gathers half of them
    assert all(a["gathered"] < b["gathered"] for a, b in zip(rows[2], rows[1]))
