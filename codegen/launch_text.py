"""A readable text dump of a LaunchPlan (host or device): what each kernel launch of the microbatch reads.

Deterministic (the same plan prints the same text) and line-oriented, so two plans diff well:

    launch-plan tokens=T trajectories=N chunk=64 conv-width=4
    target vocab=V gdn=triton conv=triton attention=triton 128x64 logprobs=triton lanes<=8
    gdn sequences=S chunks=C slots=B replayed-rows=R layout=maps launches=L lanes=K
      launch 0 round-seqs=6 seqs=[0,6) chunks=[0,312) longest=64 lane=0 start=zero:6
      seq 0 rows=[0,4096) chunks=[0,64) shift=0 exports=64:s0
    conv successors=... max-degree=3
    attention tile=128x64 query-blocks=... visits=... full=...
    logprobs predicting=... targets=... chunks=...
"""
from __future__ import annotations

import numpy as np


def _ints(x) -> np.ndarray:
    return np.asarray(x.cpu() if hasattr(x, "cpu") else x)


def _starts(init_host, num_slots: int) -> str:
    kinds = {"zero": 0, "bank": 0, "given": 0}
    for row in init_host:
        kinds["zero" if row == 0 else "bank" if row - 1 < num_slots else "given"] += 1
    return ",".join(f"{k}:{v}" for k, v in kinds.items() if v)


def _gdn_lines(gdn, sequences: bool) -> list[str]:
    index = gdn.index
    layout = "identity" if gdn.identity_layout else "maps"
    replays = 0 if gdn.rows is None else gdn.rows.num_replays
    lines = [f"gdn sequences={index.num_seqs} chunks={index.num_chunks} slots={index.num_slots} "
             f"replayed-rows={replays} layout={layout} launches={len(gdn.launches)} lanes={gdn.num_lanes}"]
    for i, launch in enumerate(gdn.launches):
        lines.append(f"  launch {i} round-seqs={launch.round_seqs} seqs=[{launch.first_seq},"
                     f"{launch.first_seq + launch.num_seqs}) chunks=[{launch.chunks[0]},{launch.chunks[1]}) "
                     f"longest={launch.longest_chunks} lane={launch.lane} "
                     f"start={_starts(launch.init_host, index.num_slots)}")
    if not sequences:
        return lines
    bounds = np.concatenate([[0], np.cumsum(index.seq_lengths)]).astype(np.int64)
    chunk_start = _ints(index.seq_chunk_start)
    shifts = None if gdn.rows is None else _ints(gdn.rows.seq_shift)
    exports: dict[int, list[str]] = {}
    for seq, offset, slot in zip(index.export_seq, index.export_offset, index.export_slot_host):
        exports.setdefault(seq, []).append(f"{offset}:s{slot}")
    for n in range(index.num_seqs):
        shift = "" if shifts is None else f" shift={int(shifts[n])}"
        out = ",".join(dict.fromkeys(exports.get(n, []))) or "-"
        lines.append(f"  seq {n} rows=[{bounds[n]},{bounds[n + 1]}) chunks=[{chunk_start[n]},{chunk_start[n + 1]})"
                     f"{shift} exports={out}")
    return lines


def format_launch_plan(plan, *, sequences: bool = True) -> str:
    """The dump of `plan` (codegen.lower.LaunchPlan); `sequences=False` leaves out the per-sequence lines."""
    target = plan.target
    attention = "torch" if not target.attention_tiles else "triton " + ",".join(
        f"{m}x{n}" for m, n in target.attention_tiles)
    lines = [f"launch-plan tokens={plan.num_tokens} trajectories={len(plan.trajectory_ids)} chunk={plan.chunk_size} "
             f"conv-width={plan.conv_width}",
             f"target vocab={target.vocab_size} gdn={'triton' if target.gdn_triton else 'torch'} "
             f"conv={'triton' if target.conv_triton else 'torch'} attention={attention} "
             f"logprobs={'triton' if target.logprobs_triton else 'torch'} lanes<={target.gdn_config.tree_scan_lanes}"]
    lines += _gdn_lines(plan.gdn, sequences)
    if plan.conv is not None:
        lines.append(f"conv successors={int(_ints(plan.conv.succ_ptr)[-1])} max-degree={plan.conv.max_degree}")
    if plan.attention is not None:
        for tile, lists in [((plan.attention.block_m, plan.attention.block_n), plan.attention),
                            *plan.attention.tiles.items()]:
            full = int(_ints(lists.q_full).sum())
            lines.append(f"attention tile={tile[0]}x{tile[1]} query-blocks={lists.num_query_blocks} "
                         f"visits={lists.num_visits} full={full}")
    else:
        lines.append(f"attention windows={len(plan.windows)}")
    targets = plan.targets
    lines.append(f"logprobs predicting={int(targets.needed.shape[0])} targets={int(targets.target_token.shape[0])} "
                 f"chunks={len(targets.token_bounds) - 1}")
    return "\n".join(lines) + "\n"
