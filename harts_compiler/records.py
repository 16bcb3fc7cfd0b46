"""Pydantic records for one JSONL input line, and the structural checks of explicit trees.

Pydantic lives only here, at the edge; everything behind `TreeBatch` is numpy.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from harts_compiler.ir.program import INT64_MAX

NodeId = Union[StrictInt, StrictStr]
Token = Annotated[int, Field(ge=0, le=INT64_MAX)]
TokenList = Annotated[list[Token], Field(min_length=1)]


class TrajectoryFields(BaseModel):
    """What a rollout file carries per trajectory besides its tokens. The typed fields feed the loss
    (`harts_compiler.metadata`): `reward` (GRPO advantages over `group`), or `advantage` (a number or one per
    position), `old_logprobs` / `ref_logprobs` / `response_mask` (one per position; entry 0 predicts nothing
    and is ignored). Any other field (task id, finish reason, ...) is kept as it is and written back. The typed
    numbers must be finite: JSON has no NaN or Infinity, and a literal such as 1e400 overflows to infinity."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    reward: float | None = None
    group: StrictStr | None = None
    advantage: float | list[float] | None = None
    old_logprobs: list[float] | None = None
    ref_logprobs: list[float] | None = None
    response_mask: list[Union[StrictBool, Literal[0, 1]]] | None = None

    def metadata(self) -> dict:
        """The fields the line set (typed ones and extras), without id/tokens/node."""
        return self.model_dump(exclude_unset=True, exclude={"id", "tokens", "node"})


class TrajectoryRecord(TrajectoryFields):
    """`{"id": "<str>", "tokens": [<int>, ...], ...metadata}`"""

    id: StrictStr
    tokens: TokenList


class NodeRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: NodeId
    parent: NodeId | None
    tokens: TokenList


class TreeTrajectoryRecord(TrajectoryFields):
    id: StrictStr
    node: NodeId


class TreeRecord(BaseModel):
    """`{"id": "<str>", "nodes": [...], "trajectories": [...]}` (trajectories: default every leaf)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: StrictStr
    nodes: Annotated[list[NodeRecord], Field(min_length=1)]
    trajectories: Annotated[list[TreeTrajectoryRecord], Field(min_length=1)] | None = None


def describe_pydantic_error(where: str, exc) -> list[str]:
    """One line per top-level field of the record that failed: `<where>: field <loc>: <message>`, the field's
    first error, with a count of the others (a list of 5,000 floats gives one line, not 5,000)."""
    by_field: dict = {}
    for err in exc.errors():
        loc = err.get("loc", ())
        by_field.setdefault(loc[0] if loc else None, []).append(err)
    lines = []
    for errors in by_field.values():
        first = errors[0]
        loc = _format_loc(first.get("loc", ()))
        msg = first.get("msg", "invalid")
        if first.get("type") == "too_short" and loc.endswith("tokens"):
            msg = "empty token list (a trajectory/node needs at least one token)"
        more = f" (and {len(errors) - 1:,} more in this field)" if len(errors) > 1 else ""
        lines.append(f"{where}: field {loc or '<record>'}: {msg}{more}")
    return lines


def _format_loc(loc) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def check_tree(tree: TreeRecord, where: str) -> list[str]:
    """Structural problems of an explicit tree, one line each (empty list = fine)."""
    problems = []
    seen: dict = {}
    for index, node in enumerate(tree.nodes):
        if node.id in seen:
            first = tree.nodes[seen[node.id]]
            if first.parent != node.parent:
                problems.append(f"{where}: field nodes[{index}].parent: node {node.id!r} has several parents "
                                f"({first.parent!r} and {node.parent!r}; also listed as nodes[{seen[node.id]}])")
            else:
                problems.append(f"{where}: field nodes[{index}].id: duplicate node id {node.id!r} (first as "
                                f"nodes[{seen[node.id]}])")
        else:
            seen[node.id] = index
    by_id = {node.id: node for node in tree.nodes}
    orphans: dict = {}  # unknown parent -> indices of the nodes naming it: one line per missing node
    for index, node in enumerate(tree.nodes):
        if node.parent is not None and node.parent not in by_id:
            orphans.setdefault(node.parent, []).append(index)
    for parent, indices in orphans.items():
        more = len(indices) - 1
        others = f" (as do {more:,} more node{'s' if more > 1 else ''})" if more else ""
        problems.append(f"{where}: field nodes[{indices[0]}].parent: node {tree.nodes[indices[0]].id!r} names "
                        f"unknown parent {parent!r}{others}")
    if problems:
        return problems
    # Cycle check: walk up from every node; colouring keeps it linear.
    state: dict = {}
    for node in tree.nodes:
        trail = []
        node_id = node.id
        while node_id is not None and node_id not in state:
            state[node_id] = "open"
            trail.append(node_id)
            node_id = by_id[node_id].parent
        if node_id is not None and state[node_id] == "open":
            problems.append(f"{where}: node {node_id!r} lies on a parent cycle")
            break
        for visited in trail:
            state[visited] = "done"
    if tree.trajectories is not None:
        for index, traj in enumerate(tree.trajectories):
            if traj.node not in by_id:
                problems.append(f"{where}: field trajectories[{index}].node: trajectory "
                                f"{traj.id!r} names unknown node {traj.node!r}")
    return problems
