"""How a tree plan's GDN scan launches queue for the SMs: a model, no GPU.

A tree step's scans run one launch per lane and round (chunk_gdn/lanes.py); each launch has one program per
(sequence, value head, state column block), and a wide scan program fills an SM (its shared memory), so a
round's programs can outnumber the SMs. The model: programs of a launch take as many steps as their sequence has
chunks, a lane's launches run one after the other (stream order), and a free SM takes the next program of the
earliest-issued launch that may run (the order in which the GPU hands out the blocks of concurrent kernels). It
prints, per direction, the steps the launches take in two issue orders against two bounds: all programs' chunks
spread over the SMs (throughput) and the slowest lane's chain of launches (latency, `gdn_batch.lane_chains`).

    python3 bench/gdn_scan_queue.py [--trees agentic P4096 ...] [--sms 132]

Orders: "lanes" issues each round's launches lane by lane (the backward walks them in reverse); "chain" issues
them by the chunk chain left in their lane, longest first (forward: from that round on; backward: up to it).
"""
from __future__ import annotations

import argparse
import heapq

import numpy as np

from gdn_batch import lane_chains
from gdn_cases import tree_cases, two_level_plan, two_level_round_specs
from harts_compiler.codegen.kernels.chunk_gdn import GDNKernelConfig, plan_tree_gdn


def queue_steps(launches, sms: int) -> int:
    """Steps until every program of `launches` (issue order; each (lane, [program lengths])) has run."""
    pending = [sorted(lengths, reverse=True) for _, lengths in launches]  # a launch starts its longest first
    last_of_lane, follower, may_run = {}, [None] * len(launches), [True] * len(launches)
    for i, (lane, _) in enumerate(launches):  # a lane's launch waits for the one before it on its stream
        if lane in last_of_lane:
            follower[last_of_lane[lane]], may_run[i] = i, False
        last_of_lane[lane] = i
    left = [len(p) for p in pending]
    nxt, running, free, now = [0] * len(launches), [], sms, 0
    while True:
        for i in range(len(launches)):
            while free and may_run[i] and nxt[i] < len(pending[i]):
                heapq.heappush(running, (now + pending[i][nxt[i]], i))
                nxt[i] += 1
                free -= 1
        if not running:
            return now
        now, i = heapq.heappop(running)
        free += 1
        left[i] -= 1
        if left[i] == 0 and follower[i] is not None:
            may_run[follower[i]] = True


def scan_orders(trees, sms: int, heads: int, value_dim: int = 128) -> dict:
    """Model steps of the forward and backward scans of two-level `trees` in both issue orders, and the bounds."""
    config = GDNKernelConfig()
    tree_plan = two_level_plan(list(trees), device="cpu")
    plan = plan_tree_gdn(two_level_round_specs(tree_plan), tree_plan.compact_rows, config=config)
    chunks = np.diff(plan.index.seq_chunk_start)
    rows = []
    for launch in plan.launches:
        block_v = config.scan_launch_for(launch.round_seqs, heads, value_dim, 2)[0]
        seqs = range(launch.first_seq, launch.first_seq + launch.num_seqs)
        lengths = [int(chunks[s]) for s in seqs for _ in range(heads * (value_dim // block_v))]
        rows.append(dict(lane=launch.lane, round=int(launch.first_seq >= len(trees)),
                         lengths=lengths, longest=launch.longest_chunks))  # the plan's order: lane by lane

    def chain(row, later: bool) -> int:  # the lane's chain from this round on (later) or up to it, this one's included
        return sum(r["longest"] for r in rows if r["lane"] == row["lane"]
                   and (r["round"] >= row["round"] if later else r["round"] <= row["round"]))

    def steps(order):
        return queue_steps([(r["lane"], r["lengths"]) for r in order], sms)
    forward_chain = sorted(rows, key=lambda r: (r["round"], -chain(r, True), r["lane"]))
    backward_chain = sorted(rows, key=lambda r: (-r["round"], -chain(r, False), r["lane"]))
    return dict(forward_lanes=steps(rows), forward_chain=steps(forward_chain), backward_lanes=steps(rows[::-1]),
                backward_chain=steps(backward_chain), throughput=sum(map(sum, (r["lengths"] for r in rows))) / sms,
                chain=int(lane_chains(plan).max(initial=0)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="*", default=["agentic"], help="bench/gdn_cases.tree_cases names")
    parser.add_argument("--sms", type=int, default=132, help="scan programs at once (one an SM: H100 / H200 132)")
    parser.add_argument("--heads", type=int, default=16, help="value heads")
    args = parser.parse_args()
    print(f"{'trees':18s} {'fwd lanes':>9s} {'fwd chain':>9s} {'bwd lanes':>9s} {'bwd chain':>9s} "
          f"{'throughput':>10s} {'chain':>6s}   (chunk steps)")
    for name, trees in tree_cases(args.trees):
        if len(trees) < 2:
            continue  # one tree: one lane, nothing to order
        r = scan_orders(trees, args.sms, args.heads)
        print(f"{name:18s} {r['forward_lanes']:9d} {r['forward_chain']:9d} {r['backward_lanes']:9d} "
              f"{r['backward_chain']:9d} {r['throughput']:10.0f} {r['chain']:6d}")


if __name__ == "__main__":
    main()
