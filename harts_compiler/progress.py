"""Progress bars for long commands: tqdm on stderr, shown only to a person at a terminal.

Every command that runs for more than a few seconds (gen, compile of big batches, verify, demo,
bench) wraps its loop in `progress(...)`. The bar is off when stderr is not a TTY (pipes, CI, log
files stay clean) or when the user passed `--quiet`.
"""
from __future__ import annotations

import sys
from typing import Iterable, TypeVar

from tqdm import tqdm

T = TypeVar("T")


def progress_enabled(quiet: bool = False) -> bool:
    return not quiet and sys.stderr.isatty()


def progress(items: Iterable[T], *, desc: str, total: int | None = None, unit: str = "it",
             quiet: bool = False) -> Iterable[T]:
    """`items` wrapped in a stderr bar when a person is watching, else `items` unchanged."""
    if not progress_enabled(quiet):
        return items
    return tqdm(items, desc=desc, total=total, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True)


def add_quiet_argument(parser) -> None:
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bars (they are also off when "
                        "stderr is not a terminal)")
