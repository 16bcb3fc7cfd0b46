"""`TreeBatch`: the validated input batch (flat trajectories and explicit trees).

Stored as struct-of-arrays: all trajectory tokens concatenated (`tokens`, `offsets`), explicit
trees already expanded into their root-to-node trajectories, so the compiler sees one flat list.
The original explicit-tree records are kept only so that `save()` writes what was loaded.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from pydantic import ValidationError

from harts_compiler.ir.program import INT64_MAX
from harts_compiler.ir.text import is_unicode

from .errors import InputError
from .metadata import check_lengths
from .records import TrajectoryRecord, TreeRecord, check_tree, describe_pydantic_error


@dataclass(frozen=True, eq=False)
class TreeBatch:
    """A batch of trajectories. Trajectory `j` has tokens `tokens[offsets[j]:offsets[j+1]]`.

    groups[j] names the input record (explicit tree id, or the trajectory's own id) it came from;
    lines[j] is its 1-based JSONL line (0 when built in Python).
    """

    tokens: np.ndarray
    offsets: np.ndarray
    ids: tuple[str, ...]
    groups: tuple[str, ...]
    lines: np.ndarray
    # Input records in order: ("traj", j) or ("tree", TreeRecord, first j, count).
    records: tuple = field(default=(), repr=False)
    # metadata[j]: the fields of trajectory j's line besides id/tokens (`harts_compiler.metadata`); () = none
    metadata: tuple = field(default=(), repr=False)

    def __post_init__(self):
        problems = []
        seen: dict[str, int] = {}
        for j, traj_id in enumerate(self.ids):
            if traj_id in seen:
                problems.append(f"{self._where(j)}: field id: duplicate trajectory id {traj_id!r} "
                                f"(first at {self._where(seen[traj_id])})")
            else:
                seen[traj_id] = j
        if problems:
            raise InputError(problems)

    def _where(self, j: int) -> str:
        line = int(self.lines[j]) if len(self.lines) else 0
        where = f"line {line}" if line else f"trajectory #{j}"
        if self.groups[j] != self.ids[j]:
            where += f" (tree {self.groups[j]!r})"
        return where

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_trajectories(cls, token_lists: Sequence[Sequence[int]] | Sequence[np.ndarray],
                          ids: Sequence[str] | None = None) -> "TreeBatch":
        """Flat trajectories; ids default to "0", "1", ... in input order."""
        if ids is None:
            ids = [str(j) for j in range(len(token_lists))]
        ids = list(ids)
        problems = []
        if len(ids) != len(token_lists):
            raise InputError(f"ids: {len(ids)} ids for {len(token_lists)} trajectories")
        if not ids:
            raise InputError("input: no trajectories")
        arrays = []
        for j, tokens in enumerate(token_lists):
            if not isinstance(ids[j], str):
                problems.append(f"trajectory #{j}: field id: must be a string, got {ids[j]!r}")
            array = np.asarray(tokens)
            if array.ndim != 1 or array.size == 0:
                problems.append(f"trajectory {ids[j]!r}: field tokens: empty trajectory"
                                if array.size == 0 else
                                f"trajectory {ids[j]!r}: field tokens: must be a flat list")
                continue
            if array.dtype.kind not in "iu":
                problems.append(f"trajectory {ids[j]!r}: field tokens: non-integer token "
                                f"(dtype {array.dtype})")
                continue
            if array.dtype.kind == "u" and array.max() > INT64_MAX:
                problems.append(f"trajectory {ids[j]!r}: field tokens: token id beyond int64")
                continue
            if array.dtype.kind == "i" and array.min() < 0:
                at = int(np.argmax(array < 0))
                problems.append(f"trajectory {ids[j]!r}: field tokens[{at}]: negative token "
                                f"{int(array[at])}")
                continue
            arrays.append(array.astype(np.int64, copy=False))
        if problems:
            raise InputError(problems)
        return cls._build(arrays, ids, ids, np.zeros(len(ids), np.int64),
                          tuple(("traj", j) for j in range(len(ids))))

    @classmethod
    def _build(cls, arrays, ids, groups, lines, records, metadata=()) -> "TreeBatch":
        lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
        offsets = np.zeros(len(arrays) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
        return cls(tokens=tokens, offsets=offsets, ids=tuple(ids), groups=tuple(groups),
                   lines=np.asarray(lines, np.int64), records=tuple(records),
                   metadata=tuple(metadata) if any(metadata) else ())

    @classmethod
    def load(cls, path: str | Path) -> "TreeBatch":
        """A JSONL file, or standard input for `-`; a missing file, a directory or a saved plan is one InputError
        line."""
        if str(path) == "-":
            return cls.from_jsonl_lines(sys.stdin.buffer)
        path = Path(path)
        if path.is_dir():
            raise InputError(f"{path}: is a directory, not a JSONL file")
        if not path.is_file():
            raise InputError(f"{path}: no such file")
        from .plan import is_saved_plan
        if is_saved_plan(path):
            raise InputError(f"{path}: a saved plan (harts compile -o), not a JSONL batch (harts show and harts "
                             "lower read it)")
        with open(path, "rb") as handle:
            return cls.from_jsonl_lines(handle)

    @classmethod
    def from_jsonl_lines(cls, lines: Iterable[bytes | str]) -> "TreeBatch":
        arrays, ids, groups, line_numbers, records, problems, metadata = [], [], [], [], [], [], []
        for number, raw in enumerate(lines, start=1):
            text = _as_bytes(raw).strip()
            if number == 1 and text.startswith(_UTF8_BOM):
                text = text[len(_UTF8_BOM):].lstrip()  # JSON readers may ignore a byte-order mark (RFC 8259)
            if not text:
                continue
            where = f"line {number}"
            # Plain trajectory lines (nearly all of a big batch) take the fast path; the rest are parsed as
            # JSON first, so what JSON rejects is named with its column, then validated by pydantic.
            fast = None if b'"nodes"' in text else _fast_trajectory(text)
            if fast is not None:
                problems += check_lengths(fast[2], fast[1].size, f"{where} (trajectory {fast[0]!r})")
                records.append(("traj", len(ids)))
                ids.append(fast[0])
                groups.append(fast[0])
                arrays.append(fast[1])
                metadata.append(fast[2])
                line_numbers.append(number)
                continue
            try:
                head = json.loads(decoded := text.decode("utf-8"), parse_constant=_not_json)
            except UnicodeDecodeError as exc:
                problems.append(f"{where}: not UTF-8 text (byte {exc.start + 1} of the line)")
                continue
            except json.JSONDecodeError as exc:
                leading_zero = decoded[exc.pos - 1:exc.pos] == "0" and decoded[exc.pos:exc.pos + 1].isdigit()
                reason = "a number with a leading zero" if leading_zero else exc.msg
                problems.append(f"{where}: invalid JSON: {reason} (column {exc.colno})")
                continue
            except _NotJSON as exc:
                problems.append(f"{where}: invalid JSON: {exc} is not a JSON value")
                continue
            except RecursionError:
                problems.append(f"{where}: invalid JSON: arrays or objects nested too deeply")
                continue
            except ValueError:  # an integer literal longer than Python converts (sys.get_int_max_str_digits())
                problems.append(f"{where}: invalid JSON: a number with more than {sys.get_int_max_str_digits():,} "
                                "digits")
                continue
            if _MAYBE_SURROGATE.search(text):
                bad = _lone_surrogate(head)
                if bad is not None:
                    problems.append(f"{where}: {bad[0]}: string {bad[1]!r} holds a lone UTF-16 surrogate escape "
                                    "(not Unicode text)")
                    continue
            is_tree = isinstance(head, dict) and "nodes" in head
            kind = "trajectory"
            if is_tree:
                kind = f"tree {head['id']!r}" if isinstance(head.get("id"), str) else "tree"
            at = f"{where} ({kind})"  # a tree is named by its id; a trajectory's id is checked below
            if is_tree and "tokens" in head:  # else pydantic reports `nodes` and `tokens` apart, neither the cause
                problems.append(f"{at}: field tokens: a record is a tree (nodes) or a trajectory "
                                "(tokens), not both; a tree's tokens go in its nodes")
                continue
            try:
                if is_tree:
                    tree = TreeRecord.model_validate(head)
                else:
                    record = TrajectoryRecord.model_validate(head)
            except ValidationError as exc:
                problems += describe_pydantic_error(at, exc)
                continue
            if not is_tree:
                problems += check_lengths(record.metadata(), len(record.tokens), f"{where} (trajectory {record.id!r})")
                arrays.append(np.array(record.tokens, dtype=np.int64))
                metadata.append(record.metadata())
                records.append(("traj", len(ids)))
                ids.append(record.id)
                groups.append(record.id)
                line_numbers.append(number)
                continue
            tree_problems = check_tree(tree, at)
            if tree_problems:
                problems += tree_problems
                continue
            traj_ids, traj_tokens = tree_trajectories(tree)
            records.append(("tree", tree, len(ids), len(traj_ids)))
            declared = {t.id: t.metadata() for t in tree.trajectories or ()}
            for traj_id, tokens in zip(traj_ids, traj_tokens):
                arrays.append(tokens)
                fields = declared.get(traj_id, {})
                if fields and "group" not in fields:  # the rollouts of one tree are one GRPO group unless told
                    fields = {**fields, "group": tree.id}
                problems += check_lengths(fields, arrays[-1].size, f"{at}: trajectory {traj_id!r}")
                metadata.append(fields)
                ids.append(traj_id)
                groups.append(tree.id)
                line_numbers.append(number)
        if problems:
            raise InputError(problems)
        if not ids:
            raise InputError("input: no trajectories")
        return cls._build(arrays, ids, groups, line_numbers, records, metadata)

    def save(self, path: str | Path) -> None:
        with open(path, "w") as handle:
            for record in self.records:
                if record[0] == "traj":
                    j = record[1]
                    obj = {"id": self.ids[j], "tokens": self.trajectory(j).tolist(), **self.metadata_of(j)}
                    handle.write(json.dumps(obj, separators=(",", ":")) + "\n")
                else:
                    handle.write(record[1].model_dump_json(exclude_unset=True) + "\n")

    # -- access -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.ids)

    def metadata_of(self, j: int) -> dict:
        """Trajectory j's metadata fields (reward, advantage, ...; `harts_compiler.metadata`), {} when none."""
        return self.metadata[j] if self.metadata else {}

    def trajectory(self, j: int) -> np.ndarray:
        return self.tokens[self.offsets[j]:self.offsets[j + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def check_vocab(self, vocab_size: int) -> None:
        """InputError naming the first trajectory (and its first token) >= vocab_size, in one line: a batch
        made for another vocabulary has such ids in nearly every trajectory, and one example says it all."""
        bad = np.flatnonzero(self.tokens >= vocab_size)
        if bad.size == 0:
            return
        trajs = np.unique(np.searchsorted(self.offsets, bad, side="right") - 1)
        first, j = int(bad[0]), int(trajs[0])
        more = f" (and {trajs.size - 1} more trajectories with ids outside the vocabulary)" if trajs.size > 1 else ""
        problems = [f"{self._where(j)}: trajectory {self.ids[j]!r}: field tokens[{first - self.offsets[j]}]: token "
                    f"{int(self.tokens[first])} >= vocab_size {vocab_size}{more}"]
        raise InputError(problems)


_UTF8_BOM = b"\xef\xbb\xbf"
# a JSON list body of non-negative integers: no leading zeros, no trailing comma, commas between numbers
_JSON_INTS = re.compile(rb"[ \t\r\n]*(?:0|[1-9][0-9]*)(?:[ \t\r\n]*,[ \t\r\n]*(?:0|[1-9][0-9]*))*[ \t\r\n]*")


def _fast_trajectory(line: bytes):
    """(id, tokens) of a plain valid trajectory line, parsed 4x faster than pydantic; None when
    anything is unusual (the caller then validates with pydantic, which explains the problem).

    The token list is parsed by numpy; the rest of the line (with the list replaced by [0]) is
    validated by the same pydantic record, and must give exactly tokens == [0] — so the slice
    really was the `tokens` list. The list must be JSON integers (`_JSON_INTS`: what JSON rejects, such as
    leading zeros or a trailing comma, goes to pydantic, which names it with its column), and a line that may
    hold NaN or Infinity (pydantic's JSON reader takes them) goes to the slow path, which rejects them."""
    key = line.find(b'"tokens"')
    left = line.find(b"[", key)
    right = line.find(b"]", left)
    if key < 0 or left < 0 or right < 0:
        return None
    body = line[left + 1:right]
    if not _JSON_INTS.fullmatch(body):
        return None
    try:
        tokens = np.fromstring(body, dtype=np.int64, sep=",")
    except ValueError:
        return None
    if tokens.size != body.count(b",") + 1 or tokens.max() >= INT64_MAX:  # numpy saturates there: ambiguous
        return None
    rest = line[:left + 1] + b"0" + line[right:]
    if b"NaN" in rest or b"Infinity" in rest:
        return None
    try:
        envelope = TrajectoryRecord.model_validate_json(rest)
    except ValidationError:
        return None
    return (envelope.id, tokens, envelope.metadata()) if envelope.tokens == [0] else None


class _NotJSON(ValueError):
    pass


def tree_trajectories(tree: TreeRecord) -> tuple[list[str], list[np.ndarray]]:
    """(trajectory ids, token arrays) of a tree that passed `check_tree`: a trajectory holds the tokens of the nodes
    on its root-to-end path. Without `trajectories` every leaf is one trajectory, named "<tree id>/<node id>";
    nodes on no trajectory's path carry no training signal and are dropped by the compiler.

    The root-to-node array of a node where paths part or end is formed once, from the nearest such ancestor's, and
    shared by the trajectories below it: time and memory linear in the tokens of those arrays, at most twice the
    trajectories' (a chain with a trajectory ending at every node is no longer a walk per trajectory)."""
    by_id = {node.id: node for node in tree.nodes}
    if tree.trajectories is None:
        has_child = {node.parent for node in tree.nodes if node.parent is not None}
        ends = [(f"{tree.id}/{node.id}", node.id) for node in tree.nodes if node.id not in has_child]
    else:
        ends = [(traj.id, traj.node) for traj in tree.trajectories]
    on_path, path_children = set(), {}
    for _, end in ends:
        node_id = end
        while node_id is not None and node_id not in on_path:
            on_path.add(node_id)
            node_id = by_id[node_id].parent
            if node_id is not None:
                path_children[node_id] = path_children.get(node_id, 0) + 1
    kept = {end for _, end in ends} | {node_id for node_id, count in path_children.items() if count > 1}
    formed: dict = {}
    for _, end in ends:
        chain, node_id = [], end
        while node_id is not None and node_id not in formed:
            chain.append(node_id)
            node_id = by_id[node_id].parent
        pieces = [] if node_id is None else [formed[node_id]]
        for node_id in reversed(chain):
            pieces.append(np.array(by_id[node_id].tokens, dtype=np.int64))
            if node_id in kept:
                formed[node_id] = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
                pieces = [formed[node_id]]
    return [traj_id for traj_id, _ in ends], [formed[end] for _, end in ends]


# `\ud800`-`\udfff` escapes: JSON text may hold them, but one without its pair is no character (Python's json reads
# it into a str that cannot be printed or encoded); only lines with such an escape are searched for one
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate(value):
    """(where, string) of the first string or field name in `value` with a lone surrogate, else None."""
    stack = [("", "", value)]
    while stack:  # iterative: json.loads nests as deep as Python's recursion limit allows
        kind, loc, item = stack.pop()
        if isinstance(item, str):
            if not is_unicode(item):
                return f"{kind}{loc or 'the record'}", item
        elif isinstance(item, dict):
            for key, v in reversed(item.items()):  # each name is looked at just before its value
                stack += [("field ", f"{loc}.{key}" if loc else key, v), ("a field name in ", loc, key)]
        elif isinstance(item, list):
            stack.extend(("field ", f"{loc}[{k}]", v) for k, v in reversed(list(enumerate(item))))
    return None


def _not_json(constant: str):
    """json.loads' hook for NaN, Infinity and -Infinity, which Python accepts and JSON does not."""
    raise _NotJSON(constant)


def _as_bytes(text) -> bytes:
    return text if isinstance(text, bytes) else text.encode()
