"""The JSONL reader accepts exactly what JSON accepts: its fast path for `{"id", "tokens"}` lines and the
strict pydantic path agree on every line, and what JSON rejects is named with its line and column."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_compiler import TreeBatch
from harts_compiler.batch import _fast_trajectory
from harts_compiler.errors import InputError
from harts_compiler.records import TrajectoryRecord

NUMBERS = ["0", "1", "7", "12", "9223372036854775807", "9223372036854775808", "01", "007", "-0", "-3", "1.5",
           "1e3", "1E0", "NaN", "Infinity", "-Infinity", "true", "null", '"4"', "0x10", "+1", ""]
SEPARATORS = [",", ", ", " ,", ",,", " ", ",\n", "\t,\t"]
SPACES = ["", " ", "  ", "\t"]


@st.composite
def token_lines(draw) -> bytes:
    items = draw(st.lists(st.sampled_from(NUMBERS), max_size=6))
    body = draw(st.sampled_from(SPACES))
    for k, item in enumerate(items):
        body += item + (draw(st.sampled_from(SEPARATORS)) if k + 1 < len(items) else "")
    body += draw(st.sampled_from(["", ",", " ", ", "]))
    ident = draw(st.sampled_from(['"a"', '"line \\"q\\""', '7', '"t"']))
    order = draw(st.booleans())
    fields = [f'"id": {ident}', f'"tokens": [{body}]']
    return ("{" + ", ".join(fields if order else fields[::-1]) + "}").encode()


def strict_tokens(line: bytes):
    """What the strict path makes of a line: its tokens, or None when pydantic refuses it."""
    try:
        return TrajectoryRecord.model_validate_json(line).tokens
    except ValueError:
        return None


@settings(max_examples=600, deadline=None)
@given(token_lines())
def test_fast_path_agrees_with_the_strict_path(line):
    fast, strict = _fast_trajectory(line), strict_tokens(line)
    if fast is not None:  # the fast path may decline a line, but what it accepts the strict path accepts too
        assert strict is not None and fast[1].tolist() == list(strict)
    try:
        batch = TreeBatch.from_jsonl_lines([line])
    except InputError:
        assert strict is None
    else:
        assert strict is not None and batch.tokens.tolist() == list(strict)
    if strict is not None:  # and nothing is accepted that JSON itself rejects
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} accepted"))


@pytest.mark.parametrize("line, column", [
    (b'{"id": "a", "tokens": [01, 2]}', 25),
    (b'{"id": "a", "tokens": [1, 2,]}', 29),
    (b'{"id": "a", "tokens": [1 2]}', 26),
    (b'{"id": "a", "tokens": [NaN]}', None),
    (b'{"id": "a", "nodes": [], "x": NaN}', None),
    (b'{"id": "a", "tokens": [1, 2], "advantage": NaN}', None),  # a plain line: the fast path must not take it
    (b'{"id": "a", "tokens": [1, 2], "reward": -Infinity}', None),
    (b'{"id": "a", "tokens": [1, 2], "score": [1, Infinity]}', None),
    pytest.param(b'{"id": "a", "tokens": [1], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None,
                 id="deeply-nested-field"),
    pytest.param(b"[" * 100_000 + b"]" * 100_000, None, id="deeply-nested-line"),
    (b'{"id": "a", "nodes": [{"id": 1, "parent": null, "tokens": [00]}]}', None),
])
def test_what_json_rejects_is_named_with_line_and_column(line, column):
    with pytest.raises(InputError) as caught:
        TreeBatch.from_jsonl_lines([b"", line])
    (problem,) = caught.value.problems
    assert problem.startswith("line 2: invalid JSON")
    if column is not None:
        assert f"column {column}" in problem


def test_leading_zero_byte_order_mark_and_encoding_are_named():
    with pytest.raises(InputError, match="line 1: invalid JSON: a number with a leading zero"):
        TreeBatch.from_jsonl_lines([b'{"id": "a", "tokens": [1, 002]}'])
    with pytest.raises(InputError, match="line 2: not UTF-8 text"):
        TreeBatch.from_jsonl_lines([b'{"id": "a", "tokens": [1]}', b'{"id": "\xff", "tokens": [1]}'])
    batch = TreeBatch.from_jsonl_lines([b'\xef\xbb\xbf{"id": "a", "tokens": [1, 2]}'])  # a BOM is ignored
    assert batch.tokens.tolist() == [1, 2]


def test_valid_lines_still_take_the_fast_path():
    line = b'{"id": "a", "tokens": [0, 10, 4611686018427387904]}'
    assert _fast_trajectory(line)[1].tolist() == [0, 10, 2**62]
    batch = TreeBatch.from_jsonl_lines([b'{"id": "a", "tokens": [1], "note": "NaN and Infinity in text"}'])
    assert batch.metadata[0] == {"note": "NaN and Infinity in text"}
