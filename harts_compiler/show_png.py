"""`harts show --png`: the trees as icicles and the rank x slot schedule as a lockstep timeline (matplotlib).

Tree panels: one row per node in layout order (continuation child first, so a row's subtree follows it), a bar
from the node's first to one past its last token position, shaded by how many trajectories share it; hatched
bars in front of a node are the ancestor tokens its linear-attention sequence replays; dotted lines are chunk
boundaries; a label "12  r1" names node 12 and the linear-attention round its first token runs in; for a tree
run as pieces, a dashed blue line starts each piece after the first (a cut inside a node is drawn as a tick at
its position on that node's row). Schedule
panel: each rank's microbatches as bars of their predicted time, slot s starting when the slowest rank finished
slot s - 1 (ranks run slots in lockstep), so white space is idle time.
"""
from __future__ import annotations

import numpy as np

MAX_BOUNDARY_LINES = 120  # more chunk boundaries than this would grey out the panel
MAX_NODE_LABELS = 40
MAX_TREE_INCHES = 9.0  # a tree of thousands of nodes gets thin rows, not a figure metres tall


def draw_plan(path: str, views, loads, chunk_size: int, dp_size: int) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Patch

    node_rows = [max(len(view.nodes), 3) for view in views]
    heights = [min(1.0 + 0.16 * rows, MAX_TREE_INCHES) for rows in node_rows]
    heights += [1.2 + 0.45 * dp_size] if loads else []
    figure, axes = plt.subplots(len(heights), 1, figsize=(11, sum(heights) + 0.4), layout="constrained",
                                gridspec_kw={"height_ratios": heights}, squeeze=False)
    axes = axes[:, 0]
    most_shared = max([node.shared for view in views for node in view.nodes] + [2])
    norm, cmap = LogNorm(vmin=1, vmax=most_shared), plt.get_cmap("viridis")
    for axis, view in zip(axes, views):
        _draw_tree(axis, view, chunk_size, norm, cmap)
    if views:  # one colour scale for every panel (all panels keep one width)
        bar = figure.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=list(axes), fraction=0.03, pad=0.01,
                              aspect=40)
        bar.set_label("trajectories sharing the node")
        ticks = [t for t in (1, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000) if t <= most_shared]
        bar.set_ticks(ticks, labels=[str(t) for t in ticks])
        bar.minorticks_off()
        axes[0].legend(handles=[Patch(facecolor="white", edgecolor="crimson", hatch="////", label="replayed tokens"),
                                Patch(facecolor="none", edgecolor="grey", linestyle=":",
                                      label=f"chunk boundary (C={chunk_size})")]
                       + ([Patch(facecolor="none", edgecolor="royalblue", linestyle="--", label="piece start")]
                          if any(view.pieces for view in views) else []),
                       loc="lower right", fontsize=8, framealpha=0.9)
    if loads:
        _draw_schedule(axes[-1], loads, dp_size)
    figure.savefig(path, dpi=110, format="png")
    plt.close(figure)


def _draw_tree(axis, view, chunk_size: int, norm, cmap) -> None:
    from matplotlib.collections import LineCollection

    row_of = {node.node: row for row, node in enumerate(view.nodes)}
    rows = np.arange(len(view.nodes))
    starts = np.array([node.start for node in view.nodes])
    tokens = np.array([node.tokens for node in view.nodes])
    replay = np.array([node.replay for node in view.nodes])
    axis.barh(rows, tokens, left=starts, height=0.8, color=cmap(norm([node.shared for node in view.nodes])),
              edgecolor="none")
    replays = replay > 0
    if replays.any():
        axis.barh(rows[replays], replay[replays], left=starts[replays] - replay[replays], height=0.8,
                  facecolor="white", edgecolor="crimson", hatch="////", linewidth=0.5)
    # from each parent's end down to its child's row
    links = [[(node.start, row_of[node.parent] + 0.4), (node.start, row - 0.4)]
             for row, node in enumerate(view.nodes) if node.parent in row_of]
    axis.add_collection(LineCollection(links, colors="0.55", linewidths=0.6))
    if len(view.nodes) <= MAX_NODE_LABELS:
        for row, node in enumerate(view.nodes):
            label = f" {node.node}" + (f"  r{node.round}" if node.round is not None else "")
            axis.text(node.end, row, label, va="center", fontsize=6, color="0.3")
    for row, node in enumerate(view.nodes):  # piece starts: between rows, or at a position inside a node
        if row and node.pieces and view.nodes[row - 1].pieces[-1] != node.pieces[0]:
            axis.axhline(row - 0.5, color="royalblue", linestyle="--", linewidth=0.8)
        for cut in node.piece_cuts:
            axis.plot([cut, cut], [row - 0.45, row + 0.45], color="royalblue", linewidth=1.2)
    deepest = max(node.end for node in view.nodes)
    boundaries = np.arange(chunk_size, deepest, chunk_size)
    if boundaries.size <= MAX_BOUNDARY_LINES:
        for b in boundaries:
            axis.axvline(b, color="grey", linestyle=":", linewidth=0.6, zorder=0)
    axis.set_xlim(0, deepest * 1.04)
    axis.set_ylim(len(view.nodes) - 0.5, -0.5)  # root on top, layout order downwards
    axis.set_yticks([])
    axis.set_ylabel("nodes\n(layout order)", fontsize=8)
    axis.set_xlabel("token position (depth in the trajectory)", fontsize=8)
    rounds = f", {view.rounds} rounds, {view.replay:,} replay tokens" if view.rounds is not None else ""
    rounds += f", {view.pieces} pieces" if view.pieces else ""
    axis.set_title(f"tree {view.name!r}: {view.trajectories} trajectories, {len(view.nodes)} nodes, "
                   f"{view.compact_tokens:,} compact tokens for {view.trajectory_tokens:,} trajectory tokens{rounds}",
                   fontsize=9, loc="left")
    axis.tick_params(labelsize=8)


def _draw_schedule(axis, loads, dp_size: int) -> None:
    slots = max(load.slot for load in loads) + 1
    slot_time = np.zeros(slots)
    for load in loads:
        slot_time[load.slot] = max(slot_time[load.slot], load.predicted_ms)
    slot_start = np.concatenate([[0.0], np.cumsum(slot_time)[:-1]])
    colors = [f"C{s % 10}" for s in range(slots)]
    for load in loads:
        left = slot_start[load.slot]
        axis.barh(load.rank, load.predicted_ms, left=left, height=0.6, color=colors[load.slot], alpha=0.85,
                  edgecolor="black", linewidth=0.4)
        if load.predicted_ms > 0.06 * slot_time.sum():  # room for a label
            axis.text(left + load.predicted_ms / 2, load.rank,
                      f"slot {load.slot}\n{load.compact_tokens:,} tok, {load.predicted_ms:,.0f} ms",
                      ha="center", va="center", fontsize=7)
    for start in list(slot_start[1:]) + [slot_time.sum()]:
        axis.axvline(start, color="black", linewidth=0.8, linestyle="--")
    axis.set_yticks(range(dp_size), [f"rank {r}" for r in range(dp_size)])
    axis.set_ylim(dp_size - 0.5, -0.5)
    axis.set_xlim(0, slot_time.sum() * 1.02 if slot_time.sum() else 1)
    axis.set_xlabel("predicted time, ms (slots run in lockstep: a slot ends when its slowest rank does)", fontsize=8)
    totals = np.bincount([load.rank for load in loads], weights=[load.predicted_ms for load in loads],
                         minlength=dp_size)
    axis.set_title(f"schedule: {dp_size} ranks x {slots} slots, step {slot_time.sum():,.1f} ms predicted "
                   f"(balanced {totals.mean():,.1f} ms)", fontsize=9, loc="left")
    axis.tick_params(labelsize=8)
