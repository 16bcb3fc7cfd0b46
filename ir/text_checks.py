"""Checks of `.hir` records before anything is derived from them: known record kinds and fields of the right
types, header counts, every index in range, node positions that continue from their parents (so the parent
links cannot form a cycle), tokens that exist. `parse_hir` runs these first, so a hand-edited or damaged file
is refused with its line number instead of looping or allocating without bound in `ir.derive`; what they
leave to `Program.verify()` are the semantic invariants (canonical nodes, preorder tables, rounds).

Each check is O(records) with numpy; nothing is allocated from a number read in the file.
"""
from __future__ import annotations

import numpy as np

from .errors import IRError
from .program import MAX_DP_SIZE

INT, FLOAT, STR, LIST, PAIR, TOKENS = "an integer", "a number", "a string", "a list", "a pair a:b", "a token list"

# kind -> {field: (type, required)}
SCHEMA: dict[str, dict[str, tuple[str, bool]]] = {
    "pass": {"name": (STR, True), "ms": (FLOAT, False)},
    "note": {"pass": (STR, True), "json": (STR, True)},
    "trajectories": {"count": (INT, True)},
    "traj": {"id": (STR, True), "group": (STR, True), "tokens": (TOKENS, True)},
    "forest": {"laid_out": (INT, True), "conv_width": (INT, True), "nodes": (INT, True), "trees": (INT, True),
               "trajectories": (INT, True)},
    "tree": {"id": (STR, True)},
    "node": {"parent": (INT, True), "tree": (INT, True), "pos": (INT, True), "len": (INT, True),
             "start": (INT, True), "mult": (INT, True), "cont": (INT, False), "subtree_end": (INT, False),
             "tokens": (TOKENS, True)},
    "end": {"id": (STR, True), "node": (INT, True)},
    "sequences": {"chunk_size": (INT, True), "count": (INT, True), "tree_rounds": (LIST, True)},
    "seq": {"tree": (INT, True), "round": (INT, True), "sigma": (INT, True), "own": (PAIR, True),
            "init": (PAIR, True), "replay": (LIST, True), "exports": (LIST, True)},
    "pieces": {"budget": (INT, True), "count": (INT, True)},
    "piece": {"tree": (INT, True), "own": (PAIR, True), "context": (INT, True), "replay": (INT, True)},
    "microbatches": {"dp_size": (INT, True), "microbatch_tokens": (INT, True), "count": (INT, True)},
    "mb": {"rank": (INT, True), "slot": (INT, True), "trees": (LIST, True)},
}
HEADERS = {"traj": "trajectories", "tree": "forest", "node": "forest", "end": "forest", "seq": "sequences",
           "mb": "microbatches", "piece": "pieces"}


def _is(value, kind: str) -> bool:
    if kind == INT:
        return isinstance(value, int)
    if kind == FLOAT:
        return isinstance(value, (int, float))
    if kind == STR:
        return isinstance(value, str)
    if kind == LIST:
        return isinstance(value, np.ndarray)
    if kind == PAIR:
        return isinstance(value, tuple)
    return isinstance(value, np.ndarray) or value == "@"


def check_fields(kind: str, fields: dict, line: int) -> None:
    """One record: a known kind, no unknown field, every required field present with its type."""
    schema = SCHEMA.get(kind)
    if schema is None:
        raise IRError(f".hir line {line}: unknown record {kind!r} (known: {', '.join(SCHEMA)})")
    for name, value in fields.items():
        if name not in schema:
            raise IRError(f".hir line {line}: {kind} record has an unknown field {name!r}")
        if not _is(value, schema[name][0]):
            raise IRError(f".hir line {line}: {kind} field {name} must be {schema[name][0]}")
    for name, (_, required) in schema.items():
        if required and name not in fields:
            raise IRError(f".hir line {line}: {kind} record lacks field {name!r}")


def check_records(records: dict[str, list[dict]], arrays: dict) -> None:
    """Counts, ranges and parent links of the parsed records (each record carries its line as `_line`)."""
    for kind, header in HEADERS.items():
        if records.get(kind) and header not in records:
            raise IRError(f".hir line {records[kind][0]['_line']}: {kind} record without a '{header}' header")
    for header in set(HEADERS.values()):
        if len(records.get(header, [])) > 1:
            raise IRError(f".hir line {records[header][1]['_line']}: a second '{header}' header")
    _check_count(records, "trajectories", "count", "traj")
    _check_tokens(records.get("traj", []), arrays.get("trajectories.tokens"), "traj")
    if "forest" in records:
        _check_forest(records, arrays)
    if "sequences" in records:
        _check_count(records, "sequences", "count", "seq")
        _check_sequences(records)
    if "pieces" in records:
        _check_count(records, "pieces", "count", "piece")
        _in_range(records["pieces"][0], "budget", 0, None)
        trees = _num_trees(records)
        for piece in records.get("piece", []):
            _in_range(piece, "tree", 0, trees)
    if "microbatches" in records:
        _check_count(records, "microbatches", "count", "mb")
        head, mbs = records["microbatches"][0], records.get("mb", [])
        _in_range(head, "dp_size", 1, MAX_DP_SIZE + 1)
        trees = _num_trees(records)
        for mb in mbs:
            _in_range(mb, "rank", 0, head["dp_size"])
            _in_range(mb, "slot", 0, len(mbs))  # slots are numbered densely: never more of them than microbatches
            _all_in_range(mb, "trees", 0, trees)


def _check_forest(records: dict, arrays: dict) -> None:
    head, nodes, ends = records["forest"][0], records.get("node", []), records.get("end", [])
    _check_count(records, "forest", "nodes", "node")
    _check_count(records, "forest", "trees", "tree")
    _check_count(records, "forest", "trajectories", "end")
    _in_range(head, "conv_width", 0, None)  # 0 until layout sets it
    laid_out = head["laid_out"]
    if laid_out not in (0, 1):
        raise IRError(f".hir line {head['_line']}: forest field laid_out must be 0 or 1")
    n = len(nodes)
    tokens = _check_tokens(nodes, arrays.get("forest.token_ids"), "node")
    for v, node in enumerate(nodes):
        _in_range(node, "parent", -1, n)
        _in_range(node, "tree", 0, len(records.get("tree", [])))
        _in_range(node, "len", 1, None)
        _in_range(node, "pos", 0, None)
        if laid_out:
            for name in ("cont", "subtree_end"):
                if name not in node:
                    raise IRError(f".hir line {node['_line']}: node of a laid-out forest lacks field {name!r}")
            _in_range(node, "cont", -1, n)
            _in_range(node, "subtree_end", 0, tokens + 1)
        if node["parent"] == v:
            raise IRError(f".hir line {node['_line']}: node {v} is its own parent")
        if laid_out and node["parent"] > v:
            raise IRError(f".hir line {node['_line']}: node {v} has parent {node['parent']} (a laid-out forest "
                          "lists parents before children)")
    if n:
        parent = np.asarray([r["parent"] for r in nodes])
        length = np.asarray([r["len"] for r in nodes])
        position = np.asarray([r["pos"] for r in nodes])
        start = np.asarray([r["start"] for r in nodes])
        expected_start = np.concatenate([[0], np.cumsum(length)[:-1]])
        bad = np.flatnonzero(start != expected_start)
        if bad.size:
            raise IRError(f".hir line {nodes[bad[0]]['_line']}: node {bad[0]} starts at {start[bad[0]]}, not "
                          f"{expected_start[bad[0]]} (nodes are stored back to back)")
        if int(length.sum()) != tokens:
            raise IRError(f".hir line {head['_line']}: node lengths sum to {int(length.sum())}, the forest has "
                          f"{tokens} tokens")
        # A node starts where its parent ends and every node has >= 1 token, so positions grow strictly along
        # parent links: no chain of them can close into a cycle.
        root = parent < 0
        safe = np.where(root, 0, parent)
        bad = np.flatnonzero(np.where(root, position != 0, position != position[safe] + length[safe]))
        if bad.size:
            v = int(bad[0])
            raise IRError(f".hir line {nodes[v]['_line']}: node {v} at position {position[v]} does not start where "
                          f"its parent {parent[v]} ends" if parent[v] >= 0 else
                          f".hir line {nodes[v]['_line']}: root node {v} is at position {position[v]}, not 0")
    for end in ends:
        _in_range(end, "node", 0, n)


def _check_sequences(records: dict) -> None:
    head, seqs = records["sequences"][0], records.get("seq", [])
    _positive(head, "chunk_size")
    trees = _num_trees(records)
    tokens = sum(r["len"] for r in records.get("node", []))
    if head["tree_rounds"].size != trees:
        raise IRError(f".hir line {head['_line']}: tree_rounds has {head['tree_rounds'].size} entries for {trees} "
                      "trees")
    for seq in seqs:
        _in_range(seq, "tree", 0, trees)
        _in_range(seq, "round", 0, None)
        _in_range(seq, "sigma", 0, None)
        a, b = seq["own"]
        if not 0 <= a <= b <= tokens:
            raise IRError(f".hir line {seq['_line']}: seq own range {a}:{b} is outside the forest's {tokens} tokens")
        source, offset = seq["init"]
        if not -1 <= source < len(seqs) or offset < 0:
            raise IRError(f".hir line {seq['_line']}: seq init {source}@{offset} names no sequence")
        _all_in_range(seq, "replay", 0, tokens)
        _all_in_range(seq, "exports", 0, None)


def _num_trees(records: dict) -> int:
    return len(records.get("tree", []))


def _check_count(records: dict, header: str, field: str, kind: str) -> None:
    head = records[header][0] if records.get(header) else None
    if head is not None and head[field] != len(records.get(kind, [])):
        raise IRError(f".hir line {head['_line']}: {header} {field}={head[field]} but {len(records.get(kind, []))} "
                      f"{kind} records follow")


def _check_tokens(rows: list[dict], external, kind: str) -> int:
    """Token count of `rows`, whose tokens are inline lists or `@` (then the arrays file holds them)."""
    inline = [r for r in rows if not isinstance(r["tokens"], str)]
    if inline and len(inline) != len(rows):
        raise IRError(f".hir line {rows[0]['_line']}: {kind} records mix inline tokens and '@'")
    if rows and not inline:
        if external is None:
            raise IRError(f".hir line {rows[0]['_line']}: {kind} tokens are '@' but no arrays file holds them")
        count = int(external.size)
    else:
        count = sum(int(r["tokens"].size) for r in rows)
        for r in rows:
            if r["tokens"].size and int(r["tokens"].min()) < 0:
                raise IRError(f".hir line {r['_line']}: negative token id")
    if kind == "node" and inline:
        for r in rows:
            if r["tokens"].size != r["len"]:
                raise IRError(f".hir line {r['_line']}: node has len={r['len']} but {r['tokens'].size} tokens")
    return count


def _positive(record: dict, field: str) -> None:
    _in_range(record, field, 1, None)


def _in_range(record: dict, field: str, low: int, high: int | None) -> None:
    value = record[field]
    if value < low or (high is not None and value >= high):
        bound = f">= {low}" if high is None else f"in [{low}, {high})"
        raise IRError(f".hir line {record['_line']}: field {field}={value} must be {bound}")


def _all_in_range(record: dict, field: str, low: int, high: int | None) -> None:
    values = record[field]
    if values.size and (values.min() < low or (high is not None and values.max() >= high)):
        bound = f">= {low}" if high is None else f"in [{low}, {high})"
        raise IRError(f".hir line {record['_line']}: every entry of {field} must be {bound}")
