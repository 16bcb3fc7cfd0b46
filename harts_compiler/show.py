"""`harts show`: a plan as text (each tree's nodes, then the rank x slot load table) and, with --png, a picture.

The input is a saved plan (`.hir`) or a JSONL batch, compiled here with the same option flags as
`harts compile`. Everything shown is read from the plan itself (the forest, the replay-min sequences,
the schedule) and from the cost model the plan was compiled with, so what you see is what runs.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .compile_flags import COMPILE_FLAGS, add_compile_options, given_options
from .errors import InputError, check_output_file

@dataclass(frozen=True)
class NodeView:
    """One node of a laid-out tree as `show` prints and draws it (positions are token depths)."""

    node: int
    level: int  # nodes above it in its tree
    parent: int
    start: int  # position of its first token
    end: int  # one past its last token's position
    shared: int  # trajectories whose path contains it
    children: int
    ends: tuple[str, ...]  # trajectories that end here
    continuation: bool  # continues its parent's linear-attention sequence (no replay, same round)
    round: int | None  # round of the sequence holding its first token (None: no sequences yet)
    replay: int  # ancestor tokens its sequence re-reads (0 for a continuation)
    pieces: tuple[int, ...] = ()  # the pieces its tokens fall in (empty: its tree runs whole)
    piece_cuts: tuple[int, ...] = ()  # positions inside it where a new piece starts

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class TreeView:
    tree: int
    name: str
    nodes: list[NodeView]  # preorder (layout order), continuation child first
    trajectories: int
    trajectory_tokens: int
    rounds: int | None
    replay: int
    sequences: int
    cell: tuple[int, int] | None  # (rank, slot) it is scheduled on
    pieces: int = 0  # pieces it runs as (0: whole)
    rides_with: str = ""  # "piece p of tree 'x'": the piece whose forward it runs in

    @property
    def compact_tokens(self) -> int:
        return sum(node.tokens for node in self.nodes)


@dataclass(frozen=True)
class CellLoad:
    rank: int
    slot: int
    compact_tokens: int
    trajectories: int
    rounds: int
    predicted_ms: float


def tree_views(plan, count: int) -> list[TreeView]:
    """Views of the plan's first `count` trees; the batch-wide tables are built once (O(nodes + trajectories))."""
    forest, seqs, mbs = plan.program.forest, plan.program.sequences, plan.program.microbatches
    has_parent = forest.node_parent >= 0
    kids = np.bincount(forest.node_parent[has_parent], minlength=forest.num_nodes)
    traj_tree = forest.node_tree[forest.traj_end_node]
    per_tree_traj = np.bincount(traj_tree, minlength=forest.num_trees)
    per_tree_traj_tokens = np.bincount(traj_tree, weights=forest.traj_length, minlength=forest.num_trees)
    ends: dict[int, list[str]] = {}
    for j in np.flatnonzero(traj_tree < count).tolist():
        ends.setdefault(int(forest.traj_end_node[j]), []).append(forest.traj_ids[j])
    node_order = np.argsort(forest.node_tree, kind="stable")  # each tree's nodes, in layout (preorder) order
    node_bounds = np.searchsorted(forest.node_tree[node_order], np.arange(count + 1))
    seq_of_node = replay_of_seq = None
    if seqs is not None:  # the sequence whose own rows hold each node's first compact token
        seq_of_node = np.searchsorted(seqs.seq_own_start, forest.node_start, side="right") - 1
        replay_of_seq = np.diff(seqs.replay_ptr)
    pieces = plan.program.pieces
    cell_of_tree, rides = {}, {}
    if mbs is not None:
        for m in range(mbs.num_microbatches):
            trees = mbs.trees_of(m).tolist()
            host = None if pieces is None else pieces.pieced_tree_among(trees)
            for t in trees:
                cell_of_tree[t] = (int(mbs.mb_rank[m]), int(mbs.mb_slot[m]))
                if host is not None and t != host:
                    first = int(pieces.of_tree(host)[0])
                    rides[t] = f"piece {pieces.rider_piece(host) - first} of tree {forest.tree_ids[host]!r}"
    views = []
    for tree in range(count):
        levels: dict[int, int] = {}
        nodes = []
        for v in node_order[node_bounds[tree]:node_bounds[tree + 1]].tolist():
            parent = int(forest.node_parent[v])
            levels[v] = levels[parent] + 1 if parent >= 0 else 0  # preorder: the parent came first
            start = int(forest.node_position[v])
            round_, replay = None, 0
            if seqs is not None:
                s = int(seq_of_node[v])
                round_ = int(seqs.seq_round[s])
                replay = int(replay_of_seq[s]) if int(seqs.seq_own_start[s]) == int(forest.node_start[v]) else 0
            in_pieces, cuts = _pieces_of_node(pieces, tree, int(forest.node_start[v]), int(forest.node_length[v]))
            nodes.append(NodeView(node=v, level=levels[v], parent=parent, start=start,
                                  end=start + int(forest.node_length[v]), shared=int(forest.node_multiplicity[v]),
                                  children=int(kids[v]), ends=tuple(ends.get(v, ())),
                                  continuation=parent >= 0 and int(forest.node_cont_child[parent]) == v,
                                  round=round_, replay=replay, pieces=in_pieces,
                                  piece_cuts=tuple(start + c for c in cuts)))
        in_tree = seqs.seq_tree == tree if seqs is not None else None
        views.append(TreeView(tree=tree, name=forest.tree_ids[tree], nodes=nodes,
                              trajectories=int(per_tree_traj[tree]), trajectory_tokens=int(per_tree_traj_tokens[tree]),
                              rounds=int(seqs.tree_rounds[tree]) if seqs is not None else None,
                              replay=int(replay_of_seq[in_tree].sum()) if seqs is not None else 0,
                              sequences=int(in_tree.sum()) if seqs is not None else 0,
                              cell=cell_of_tree.get(tree),
                              pieces=int(pieces.of_tree(tree).size) if pieces is not None else 0,
                              rides_with=rides.get(tree, "")))
    return views


def _pieces_of_node(pieces, tree: int, first: int, length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The pieces holding compact tokens [first, first + length) of a tree and the offsets in that range where
    a later piece starts; nothing when the tree runs whole."""
    mine = pieces.of_tree(tree) if pieces is not None else np.empty(0, np.int64)
    if mine.size == 0:
        return (), ()
    starts, ends = pieces.piece_start[mine], pieces.piece_end[mine]
    held = np.flatnonzero((starts < first + length) & (ends > first))
    cuts = tuple(int(starts[k]) - first for k in held[1:])
    return tuple(int(k) for k in held), cuts


def cost_model_of(plan):
    """(CostModel, LayerCounts) the plan's schedule was planned with (its options name them)."""
    from .passes.cost_model import CostModelError, LayerCounts, default_cost_model, load_cost_model

    options = plan.options
    try:
        model = default_cost_model() if options.cost_model == "default" else load_cost_model(options.cost_model)
    except CostModelError as error:
        raise InputError(f"option cost_model: {error}") from None
    return model, LayerCounts.stated(options.linear_layers, options.full_layers)


def describe_cost_model(model) -> str:
    if model.source == "default":
        return "built-in guesses, not a fit"
    return f"{Path(model.source).name}, fitted on {model.device} {model.date}".rstrip()


def cell_loads(plan) -> list[CellLoad]:
    """Every scheduled microbatch's load and predicted fwd+bwd time, ordered by (rank, slot)."""
    from .passes.cost_model import features

    model, layers = cost_model_of(plan)
    return [CellLoad(rank=mb.rank, slot=mb.slot, compact_tokens=mb.compact_tokens, trajectories=mb.trajectories,
                     rounds=mb.rounds, predicted_ms=model.predict(features(mb), layers))
            for mb in plan.microbatches()]


# -- text -------------------------------------------------------------------------------------

def _chunks_text(node: NodeView, chunk: int) -> str:
    """The chunks the node's tokens fall in and the chunk boundaries that cut through it."""
    first, last = node.start // chunk, (node.end - 1) // chunk
    cuts = [b for b in range(first * chunk + chunk, node.end, chunk)]
    text = f"{first}" if first == last else f"{first}-{last}"
    if cuts:
        text += f", cut at {cuts[0]}" if len(cuts) == 1 else f", {len(cuts)} cuts"
    return text


def _sequence_text(node: NodeView) -> str:
    if node.round is None:
        return ""
    if node.continuation:
        return f"round {node.round}, continues"
    return f"round {node.round}, replay {node.replay}"


def _piece_text(node: NodeView) -> str:
    if not node.pieces:
        return ""
    first, last = node.pieces[0], node.pieces[-1]
    text = f"{first}" if first == last else f"{first}-{last}"
    if node.piece_cuts:
        text += f", cut at {node.piece_cuts[0]}" if len(node.piece_cuts) == 1 else f", {len(node.piece_cuts)} cuts"
    return text


def _ends_text(ends: tuple[str, ...], keep: int = 3) -> str:
    if not ends:
        return ""
    shown = ", ".join(ends[:keep])
    return f"ends {shown}" + (f" (+{len(ends) - keep})" if len(ends) > keep else "")


def format_tree(view: TreeView, chunk: int, max_nodes: int) -> str:
    where = f", rank {view.cell[0]} slot {view.cell[1]}" if view.cell is not None else ""
    compression = view.trajectory_tokens / view.compact_tokens if view.compact_tokens else 0.0
    rounds = f", {view.rounds} rounds, {view.sequences} sequences, {view.replay:,} replay tokens" \
        if view.rounds is not None else ""
    in_pieces = f", {view.pieces} pieces" if view.pieces else ""
    in_pieces += f", runs with {view.rides_with}" if view.rides_with else ""
    head = (f"tree {view.name!r}: {view.trajectories:,} trajectories ({view.trajectory_tokens:,} tokens), "
            f"{len(view.nodes):,} nodes, {view.compact_tokens:,} compact tokens ({compression:.2f}x){rounds}"
            f"{in_pieces}{where}")
    shown = view.nodes[:max_nodes]
    labels, last_child = [], {}
    for node in view.nodes:  # the last child of each parent, for the tree drawing
        last_child[node.parent] = node.node
    open_levels: list[bool] = []  # per level above: does a later sibling still follow (draw a bar)
    for node in shown:
        del open_levels[max(node.level - 1, 0):]
        if node.level == 0:
            labels.append(f"{node.node}")
            continue
        is_last = last_child[node.parent] == node.node
        stem = "".join("│ " if more else "  " for more in open_levels)
        labels.append(f"{stem}{'└─' if is_last else '├─'}{node.node}")
        open_levels.append(not is_last)
    width = max([len(label) for label in labels] + [4])
    spans = [f"[{node.start:,}, {node.end:,})" for node in shown]
    span_width = max([len(span) for span in spans] + [9])
    columns = f"  {'node':<{width}}  {'positions':>{span_width}}  {'tokens':>7}  {'shared':>6}  {'branch':>6}  " \
        f"{f'chunks (C={chunk})':<20}  {'linear-attention sequence':<26}  " + \
        (f"{'piece':<14}  " if view.pieces else "") + "trajectories"
    lines = [head, columns]
    for label, span, node in zip(labels, spans, shown):
        branch = str(node.children) if node.children > 1 else ""
        row = (f"  {label:<{width}}  {span:>{span_width}}  {node.tokens:>7,}  {node.shared:>6,}  "
               f"{branch:>6}  {_chunks_text(node, chunk):<20}  {_sequence_text(node):<26}  "
               + (f"{_piece_text(node):<14}  " if view.pieces else "") + _ends_text(node.ends))
        lines.append(row.rstrip())
    if len(view.nodes) > len(shown):
        lines.append(f"  ... {len(view.nodes) - len(shown):,} more nodes (--nodes {len(view.nodes)} shows them)")
    return "\n".join(lines)


def _grid(title: str, values: dict, dp_size: int, slots: int, number: str, last: str, combine) -> list[str]:
    """One rank x slot block: a row per slot (ranks run slots in lockstep), a column per rank, then `last`
    (`combine` of the row: the slot's time is its slowest rank, its tokens their sum) and a total row."""
    rows = [[values.get((r, s)) for r in range(dp_size)] for s in range(slots)]
    totals = [sum(row[r] or 0 for row in rows) for r in range(dp_size)]
    tails = [combine([v for v in row if v is not None]) for row in rows]
    text = [[format(v, number) if v is not None else "-" for v in row] for row in rows]
    width = max([len(f"rank {dp_size - 1}")] + [len(format(v, number)) for v in totals + tails]) + 2
    tail_width = max(width, len(last)) + 2
    lines = [title, f"  {'':<8}" + "".join(f"{f'rank {r}':>{width}}" for r in range(dp_size)) + f"{last:>{tail_width}}"]
    lines += [f"  {f'slot {s}':<8}" + "".join(f"{cell:>{width}}" for cell in text[s])
              + f"{format(tails[s], number):>{tail_width}}" for s in range(slots)]
    lines.append(f"  {'total':<8}" + "".join(f"{format(v, number):>{width}}" for v in totals)
                 + f"{format(sum(tails), number):>{tail_width}}")
    return lines


def format_loads(loads: list[CellLoad], dp_size: int, model_source: str) -> str:
    """The rank x slot tables (predicted ms, compact tokens, trajectories) with totals and imbalance."""
    slots = max(load.slot for load in loads) + 1

    def of(field: str) -> dict:
        return {(load.rank, load.slot): getattr(load, field) for load in loads}

    slot_max = lambda row: max(row, default=0.0)  # noqa: E731  (a slot lasts as long as its slowest rank)
    lines = [f"schedule: {dp_size} ranks x {slots} slots"]
    lines += _grid(f"predicted fwd+bwd ms (cost model: {model_source})", of("predicted_ms"), dp_size, slots,
                   ",.1f", "slot time", slot_max)
    lines += _grid("compact tokens", of("compact_tokens"), dp_size, slots, ",d", "sum", sum)
    lines += _grid("trajectories", of("trajectories"), dp_size, slots, ",d", "sum", sum)
    ms = np.bincount([load.rank for load in loads], weights=[load.predicted_ms for load in loads], minlength=dp_size)
    tokens = np.bincount([load.rank for load in loads], weights=[load.compact_tokens for load in loads],
                         minlength=dp_size)
    step = sum(slot_max([load.predicted_ms for load in loads if load.slot == s]) for s in range(slots))
    balanced = ms.mean()  # the step if every rank had the same work and slots cost nothing to align
    lines.append(f"imbalance: slowest rank {ms.max():,.1f} ms / mean {balanced:,.1f} ms = "
                 f"{ms.max() / balanced if balanced else 1.0:.3f}x; compact tokens max / mean = "
                 f"{tokens.max() / tokens.mean() if tokens.mean() else 1.0:.3f}x; lockstep step (sum of slot times) "
                 f"{step:,.1f} ms = {step / balanced if balanced else 1.0:.3f}x the balanced {balanced:,.1f} ms")
    idle = np.flatnonzero(tokens == 0).tolist()
    if idle:
        lines.append(f"idle ranks: {', '.join(map(str, idle))} (fewer trees or parts than ranks)")
    return "\n".join(lines)


# -- command ----------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:

    parser = argparse.ArgumentParser(prog="harts show", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Compile options (JSONL input only; a plan keeps the options it was "
                                            "compiled with) take CompileOptions' defaults.")
    parser.add_argument("input", help="a saved plan (.hir) or a JSONL batch ('-': standard input)")
    parser.add_argument("--trees", type=int, default=3, metavar="N", help="trees to print and draw, in tree "
                        "order; 0 = all (default: %(default)s)")
    parser.add_argument("--nodes", type=int, default=60, metavar="N",
                        help="nodes printed per tree, in layout order (default: %(default)s)")
    parser.add_argument("--png", metavar="FILE", help="also draw the trees and the schedule into FILE (PNG; needs "
                        "matplotlib: pip install 'harts-compiler[show]')")
    add_compile_options(parser, only_given=True)
    return parser


def load_plan(source: str, given: dict):
    """The plan of a saved `.hir`, or of a JSONL batch compiled with the `given` options."""
    from . import CompileOptions, Plan, TreeBatch, compile
    from .plan import is_saved_plan

    path = Path(source)
    if not is_saved_plan(path):  # TreeBatch.load reads stdin for "-" and names a missing file or a directory
        return compile(TreeBatch.load(source), CompileOptions.checked(**given))
    if given:
        flags = ", ".join(flag for flag, (name, *_) in COMPILE_FLAGS.items() if name in given)
        raise InputError(f"{flags}: a saved plan keeps the options it was compiled with (give the JSONL batch "
                         "to compile with others)")
    plan = Plan.load_input(path)
    if not plan.program.forest.laid_out:
        raise InputError(f"{path}: stage {plan.program.stage}: show needs a laid-out plan (harts compile -o)")
    return plan


def show_main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.trees < 0 or args.nodes < 1:
        raise InputError(f"--trees {args.trees} / --nodes {args.nodes}: need --trees >= 0 (0 = all) and --nodes >= 1")
    if args.png:
        check_output_file(args.png, "--png")  # refused before a long compile, not after it
        try:
            import matplotlib  # noqa: F401  (only to say what is missing before compiling)
        except ImportError:
            raise InputError("--png needs matplotlib: install harts-compiler[show]") from None
    given = given_options(args)
    plan = load_plan(args.input, given)
    forest = plan.program.forest
    count = forest.num_trees if args.trees == 0 else min(args.trees, forest.num_trees)
    views = tree_views(plan, count)
    sequences = plan.program.sequences  # a dump without options still knows the chunk its sequences use
    chunk = sequences.chunk_size if sequences is not None else plan.options.chunk_size
    # from the forest, not Plan.stats: that also hashes the whole plan (its identity), needless work here
    trajectory_tokens = int(forest.traj_length.sum())
    print(f"{forest.num_trajectories:,} trajectories in {forest.num_trees:,} trees, {forest.num_nodes:,} nodes; "
          f"{trajectory_tokens:,} trajectory tokens -> {forest.num_tokens:,} compact "
          f"({trajectory_tokens / max(forest.num_tokens, 1):.2f}x), "
          f"{sequences.replay_tokens if sequences is not None else 0:,} replay tokens, chunk size {chunk}")
    for view in views:
        print()
        print(format_tree(view, chunk, args.nodes))
    if count < forest.num_trees:
        print(f"\n... {forest.num_trees - count:,} more trees not shown (--trees 0 shows all)")
    loads = []
    if plan.program.microbatches is not None:
        loads = cell_loads(plan)
        print()
        print(format_loads(loads, plan.program.microbatches.dp_size, describe_cost_model(cost_model_of(plan)[0])))
    else:
        print("\nnot scheduled: no rank x slot table (the plan stops before the schedule pass)")
    if args.png:
        from .show_png import draw_plan
        try:
            draw_plan(args.png, views, loads, chunk,
                      plan.program.microbatches.dp_size if plan.program.microbatches is not None else 0)
        except OSError as error:  # e.g. a folder without write permission
            raise InputError(f"--png {args.png}: cannot write ({error.strerror or error})") from None
        print(f"\nwrote {args.png}")
    return 0
