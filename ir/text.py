"""`.hir`: the text form of a Program. `write_hir`/`read_hir` round-trip to a structurally equal
Program (`structural_diff(read_hir(p), program) is None`).

One record per line, `kind key=value ...`; values are integers, JSON strings ("..."), `a:b`
ranges, `s@o` state sources or `[1 2 3]` lists. Token lists longer than `inline_limit` in total go
to an arrays file beside the text (`arrays "NAME.npz" sha256=...` header, `tokens=@` in the records;
`ir.artifact` writes and checks the pair). Only the node-level facts are stored; per-token tables
(predecessors, conv table, targets, gather runs) are rebuilt by `ir.derive`, the same code the passes use.

    hir 2
    pass name="prefix-compress" ms=0.41
    note pass="schedule" json="{\"status\": \"OPTIMAL\"}"
    trajectories count=2
    traj id="a" group="a" tokens=[5 6 7]
    forest laid_out=1 conv_width=4 nodes=3 trees=1 trajectories=2
    tree id="a"
    node parent=-1 tree=0 pos=0 len=2 start=0 mult=2 cont=1 subtree_end=4 tokens=[5 6]
    end id="a" node=1
    sequences chunk_size=64 count=2 tree_rounds=[1]
    seq tree=0 round=0 sigma=0 own=0:3 init=-1@0 replay=[] exports=[]
    microbatches dp_size=1 microbatch_tokens=0 count=1
    mb rank=0 slot=0 trees=[0]

A tree larger than the budget runs as pieces (`cut-pieces`), one record each, before the microbatches:

    pieces budget=4096 count=2
    piece tree=0 own=0:4096 context=0 replay=0
    piece tree=0 own=4096:7000 context=812 replay=44
"""
from __future__ import annotations

import hashlib
import json
import re

import numpy as np

from . import derive
from .errors import IRError
from .forest import Forest
from .program import INT64_MAX, Microbatches, Pieces, Program, Sequences, Trajectories
from .text_checks import check_fields, check_records

VERSION = 2  # 2: piece records carry context= and replay=
_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\[[^\]]*\]|\S+)')


def _ints(values) -> str:
    return "[" + " ".join(map(str, np.asarray(values).tolist())) + "]"


def arrays_digest(arrays: dict[str, np.ndarray]) -> str:
    """sha256 of the arrays' names, dtypes, shapes and bytes (not of the .npz file, whose zip headers
    carry dates): the value an arrays header records and a reader checks."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def is_wall_clock(key: str) -> bool:
    """Note fields that measure time (`wall_time_s`, `solver_time_s`, ...): kept in a saved plan, left
    out of its identity."""
    return key.endswith(("_s", "_ms"))


def format_program(program: Program, arrays_name: str | None = None,
                   inline_limit: int = 4096, *, timings: bool = True) -> tuple[str, dict]:
    """Text of the program, and the arrays that go to the arrays file (empty when all inline). With
    `timings=False` the pass times and the notes' wall-clock fields are left out (a plan's identity)."""
    lines = [f"hir {VERSION}"]
    arrays: dict[str, np.ndarray] = {}
    sizes = [program.trajectories.num_tokens if program.trajectories else 0,
             program.forest.num_tokens if program.forest else 0]
    external = arrays_name is not None and max(sizes) > inline_limit
    for name, ms in program.provenance:
        lines.append(f"pass name={json.dumps(name)}" + (f" ms={ms!r}" if timings else ""))
    for name, text in program.notes:
        if not timings:
            fields = json.loads(text)
            text = json.dumps({k: v for k, v in fields.items() if not is_wall_clock(k)}
                              if isinstance(fields, dict) else fields)
        lines.append(f"note pass={json.dumps(name)} json={json.dumps(text)}")
    batch = program.trajectories
    if batch is not None:
        lines.append(f"trajectories count={len(batch.ids)}")
        if external:
            arrays["trajectories.tokens"] = batch.tokens
            arrays["trajectories.offsets"] = batch.offsets
        for j, (tid, group) in enumerate(zip(batch.ids, batch.groups)):
            tokens = "@" if external else _ints(batch.tokens[batch.offsets[j]:batch.offsets[j + 1]])
            lines.append(f"traj id={json.dumps(tid)} group={json.dumps(group)} tokens={tokens}")
    f = program.forest
    if f is not None:
        lines.append(f"forest laid_out={int(f.laid_out)} conv_width={f.conv_width} "
                     f"nodes={f.num_nodes} trees={f.num_trees} trajectories={f.num_trajectories}")
        for t, tid in enumerate(f.tree_ids):
            lines.append(f"tree id={json.dumps(tid)}")
        if external:
            arrays["forest.token_ids"] = f.token_ids
        for v in range(f.num_nodes):
            s, n = int(f.node_start[v]), int(f.node_length[v])
            extra = (f" cont={int(f.node_cont_child[v])} subtree_end={int(f.node_subtree_end[v])}"
                     if f.laid_out else "")
            tokens = "@" if external else _ints(f.token_ids[s:s + n])
            lines.append(f"node parent={int(f.node_parent[v])} tree={int(f.node_tree[v])} "
                         f"pos={int(f.node_position[v])} len={n} start={s} "
                         f"mult={int(f.node_multiplicity[v])}{extra} tokens={tokens}")
        for tid, end in zip(f.traj_ids, f.traj_end_node.tolist()):
            lines.append(f"end id={json.dumps(tid)} node={end}")
    q = program.sequences
    if q is not None:
        lines.append(f"sequences chunk_size={q.chunk_size} count={q.num_sequences} "
                     f"tree_rounds={_ints(q.tree_rounds)}")
        for s in range(q.num_sequences):
            lines.append(f"seq tree={int(q.seq_tree[s])} round={int(q.seq_round[s])} "
                         f"sigma={int(q.seq_start_position[s])} "
                         f"own={int(q.seq_own_start[s])}:{int(q.seq_own_end[s])} "
                         f"init={int(q.seq_init_seq[s])}@{int(q.seq_init_offset[s])} "
                         f"replay={_ints(q.replay_of(s))} exports={_ints(q.exports_of(s))}")
    pc = program.pieces
    if pc is not None:
        lines.append(f"pieces budget={pc.budget} count={pc.num_pieces}")
        for p in range(pc.num_pieces):
            lines.append(f"piece tree={int(pc.piece_tree[p])} own={int(pc.piece_start[p])}:{int(pc.piece_end[p])} "
                         f"context={int(pc.piece_context[p])} replay={int(pc.piece_replay[p])}")
    m = program.microbatches
    if m is not None:
        lines.append(f"microbatches dp_size={m.dp_size} microbatch_tokens={m.microbatch_tokens} "
                     f"count={m.num_microbatches}")
        for k in range(m.num_microbatches):
            lines.append(f"mb rank={int(m.mb_rank[k])} slot={int(m.mb_slot[k])} "
                         f"trees={_ints(m.trees_of(k))}")
    if external:
        lines.insert(1, f"arrays {json.dumps(arrays_name)} sha256={arrays_digest(arrays)}")
    return "\n".join(lines) + "\n", arrays


def _int(raw: str) -> int:
    return _int64(int(raw), raw)


def _int64(value: int, raw: str) -> int:
    """Every number of the IR is an int64: a larger one is refused here (ValueError), not overflowed later."""
    if not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise ValueError(f"{raw} does not fit in 64 bits")
    return value


def _value(raw: str):
    if raw.startswith('"'):
        text = json.loads(raw)
        if isinstance(text, str) and not is_unicode(text):
            raise ValueError(f"{raw[:40]} holds a lone UTF-16 surrogate escape (not Unicode text)")
        return text
    if raw.startswith("["):
        inner = raw[1:-1].split()
        return np.asarray([_int(x) for x in inner], dtype=np.int64)
    if raw == "@":
        return raw
    if ":" in raw or "@" in raw:
        a, b = re.split(r"[:@]", raw)
        return _int(a), _int(b)
    try:
        value = int(raw)
    except ValueError:
        return float(raw)
    return _int64(value, raw)


def is_unicode(text: str) -> bool:
    """False where `text` holds a lone UTF-16 surrogate (JSON's "\\ud800" escape without its pair): no character,
    so it cannot be printed or encoded."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_hir(text: str, arrays: dict | None = None) -> Program:
    """Program of `.hir` text; every record is checked (`ir.text_checks`) before anything is derived from it."""
    records: dict[str, list[dict]] = {}
    header = None
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        kind, _, rest = line.partition(" ")
        if kind == "hir":
            if header is not None or not rest.isdigit():
                raise IRError(f".hir line {number}: the header 'hir {VERSION}' must come once, first")
            header = int(rest)
            if header != VERSION:
                raise IRError(f".hir line {number}: format version {header}, this harts reads version {VERSION} "
                              "(compile the batch again)")
            continue
        if header != VERSION:
            raise IRError(f".hir line {number}: missing or unsupported header (want 'hir {VERSION}' first)")
        if kind == "arrays":
            continue
        try:
            fields = {k: _value(v) for k, v in _FIELD.findall(rest)}
        except (ValueError, json.JSONDecodeError) as exc:
            raise IRError(f".hir line {number}: cannot parse {line[:80]!r}: {exc}") from None
        check_fields(kind, fields, number)
        fields["_line"] = number
        records.setdefault(kind, []).append(fields)
    if header != VERSION:
        raise IRError(f".hir: missing or unsupported header 'hir {VERSION}'")
    check_records(records, arrays or {})
    try:
        return _build(records, arrays)
    except (KeyError, IndexError, TypeError) as exc:
        raise IRError(f".hir: malformed record ({type(exc).__name__}: {exc})") from None


def _tokens(record_list, external):
    if external is not None:
        return external
    parts = [r["tokens"] for r in record_list]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _col(records, key) -> np.ndarray:
    return np.asarray([r[key] for r in records], dtype=np.int64)


def _build(records: dict, arrays: dict | None) -> Program:
    arrays = arrays or {}
    provenance = tuple((r["name"], float(r.get("ms", 0.0))) for r in records.get("pass", []))
    notes = tuple((r["pass"], r["json"]) for r in records.get("note", []))
    batch = None
    if "trajectories" in records:
        trajs = records.get("traj", [])
        if "trajectories.offsets" in arrays:
            offsets = arrays["trajectories.offsets"]
        else:
            offsets = np.zeros(len(trajs) + 1, np.int64)
            np.cumsum([r["tokens"].size for r in trajs], out=offsets[1:])
        batch = Trajectories(tokens=_tokens(trajs, arrays.get("trajectories.tokens")),
                             offsets=offsets, ids=[r["id"] for r in trajs],
                             groups=[r["group"] for r in trajs])
    forest = _build_forest(records, arrays) if "forest" in records else None
    sequences = _build_sequences(records) if "sequences" in records else None
    pieces = None
    if "pieces" in records:
        rows = records.get("piece", [])
        pieces = Pieces(budget=records["pieces"][0]["budget"], piece_tree=_col(rows, "tree"),
                        piece_start=np.asarray([r["own"][0] for r in rows], np.int64),
                        piece_end=np.asarray([r["own"][1] for r in rows], np.int64),
                        piece_context=_col(rows, "context"), piece_replay=_col(rows, "replay"))
    microbatches = None
    if "microbatches" in records:
        head, mbs = records["microbatches"][0], records.get("mb", [])
        ptr = np.zeros(len(mbs) + 1, np.int64)
        np.cumsum([r["trees"].size for r in mbs], out=ptr[1:])
        microbatches = Microbatches(
            dp_size=head["dp_size"], microbatch_tokens=head["microbatch_tokens"],
            mb_rank=_col(mbs, "rank"), mb_slot=_col(mbs, "slot"), mb_tree_ptr=ptr,
            mb_trees=np.concatenate([r["trees"] for r in mbs]) if mbs else np.zeros(0, np.int64))
    return Program(trajectories=batch, forest=forest, sequences=sequences, pieces=pieces,
                   microbatches=microbatches, provenance=provenance, notes=notes)


def _build_forest(records: dict, arrays: dict) -> Forest:
    head = records["forest"][0]
    nodes, ends = records.get("node", []), records.get("end", [])
    token_ids = _tokens(nodes, arrays.get("forest.token_ids"))
    parent, tree = _col(nodes, "parent"), _col(nodes, "tree")
    start, length, position = _col(nodes, "start"), _col(nodes, "len"), _col(nodes, "pos")
    end_node = _col(ends, "node")
    trees = records.get("tree", [])
    tree_ids = [r["id"] for r in trees]
    common = dict(token_ids=token_ids, node_parent=parent, node_tree=tree, node_start=start,
                  node_length=length, node_position=position,
                  node_multiplicity=_col(nodes, "mult"), tree_ids=tree_ids,
                  traj_ids=[r["id"] for r in ends], traj_end_node=end_node,
                  traj_length=position[end_node] + length[end_node] if ends else
                  np.zeros(0, np.int64), conv_width=head["conv_width"],
)
    if not head["laid_out"]:
        token_node, token_position = derive.token_node_and_position(start, length, position)
        return Forest(token_node=token_node, token_position=token_position, laid_out=False,
                      **common)
    cont = _col(nodes, "cont")
    tables = derive.layout_tables(parent, tree, start, length, position, cont, end_node,
                                  len(tree_ids))
    # Node-level facts come from the text (verify() then checks them against the derivation).
    tables["node_subtree_end"] = _col(nodes, "subtree_end")
    tables.pop("node_multiplicity")
    return Forest(laid_out=True, node_cont_child=cont, **common, **tables)


def _build_sequences(records: dict) -> Sequences:
    head, seqs = records["sequences"][0], records.get("seq", [])

    def ptr_and_values(key):
        ptr = np.zeros(len(seqs) + 1, np.int64)
        np.cumsum([r[key].size for r in seqs], out=ptr[1:])
        values = np.concatenate([r[key] for r in seqs]) if seqs else np.zeros(0, np.int64)
        return ptr, values.astype(np.int64)

    replay_ptr, replay = ptr_and_values("replay")
    export_ptr, export_offset = ptr_and_values("exports")
    return Sequences(
        chunk_size=head["chunk_size"], seq_tree=_col(seqs, "tree"), seq_round=_col(seqs, "round"),
        seq_start_position=_col(seqs, "sigma"),
        seq_own_start=np.asarray([r["own"][0] for r in seqs], np.int64),
        seq_own_end=np.asarray([r["own"][1] for r in seqs], np.int64),
        seq_init_seq=np.asarray([r["init"][0] for r in seqs], np.int64),
        seq_init_offset=np.asarray([r["init"][1] for r in seqs], np.int64),
        replay_ptr=replay_ptr, replay=replay, export_ptr=export_ptr,
        export_offset=export_offset, tree_rounds=head["tree_rounds"])
