"""A saved Program on disk: one `.hir` text file, plus one arrays file beside it when its token lists are long.

The two are one artifact. The arrays file is named after the whole text file name (`run.hir` ->
`run.hir.npz`), so two plans never share one, and the text records the sha256 of the arrays it was
written with (`arrays "run.hir.npz" sha256=...`); a reader recomputes it and refuses a pair that does
not belong together, naming both files. The text stays readable and diffable; the arrays are checked,
never trusted. Writing never replaces a file of another kind, and each half is written to a temporary
name and renamed, arrays first: an interrupted save leaves the old text, whose hash then refuses the
new arrays.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from .errors import ArtifactError
from .program import INT64_MAX, Program
from .text import arrays_digest, format_program, parse_hir

ARRAYS_SUFFIX = ".npz"
ARRAY_NAMES = ("trajectories.tokens", "trajectories.offsets", "forest.token_ids")  # what `format_program` writes
_ARRAYS_HEADER = re.compile(r'^arrays ("(?:[^"\\]|\\.)*")(?: sha256=(\S+))?$', re.M)
_ZIP_MAGIC = b"PK\x03\x04"


def arrays_path(path: str | Path) -> Path:
    """Where the arrays of the `.hir` at `path` live: the full name plus `.npz`."""
    path = Path(path)
    return path.with_name(path.name + ARRAYS_SUFFIX)


def write_hir(program: Program, path: str | Path, inline_limit: int = 4096, *, header: str = "") -> Path:
    """Writes `program` to `path` (and its arrays file when the token lists exceed `inline_limit`), `header`
    (comment lines) first. Refuses a reserved suffix, a directory, a missing folder, or a file that is not a
    saved plan."""
    path = Path(path)
    _check_writable(path, "plan", _is_hir)
    side = arrays_path(path)
    text, arrays = format_program(program, side.name, inline_limit)
    if arrays:
        _check_writable(side, "arrays file", _is_zip)
        _replace(side, lambda handle: np.savez(handle, **arrays))
    _replace(path, lambda handle: handle.write((header + text).encode()))
    if not arrays and side.is_file() and _is_zip(side):
        side.unlink()  # the arrays of an earlier, larger plan saved under this name: no longer its other half
    return path


def check_plan_path(path: str | Path) -> None:
    """Raises ArtifactError if `write_hir(..., path)` would refuse `path` (so a CLI can say so before compiling)."""
    path = Path(path)
    _check_writable(path, "plan", _is_hir)
    side = arrays_path(path)
    if side.exists():
        _check_writable(side, "arrays file", _is_zip)


def read_hir_text(path: str | Path) -> str:
    """The text of a saved plan, with one clear error for what is not one."""
    path = Path(path)
    if path.is_dir():
        raise ArtifactError(f"{path}: is a directory, not a .hir file")
    if not path.is_file():
        raise ArtifactError(f"{path}: no such file")
    raw = path.read_bytes()
    if raw.startswith(_ZIP_MAGIC):
        raise ArtifactError(f"{path}: is an arrays file, not a .hir (give the .hir; its arrays are read from "
                            "beside it)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ArtifactError(f"{path}: not a .hir text file (byte {exc.start} is not UTF-8)") from None


def read_hir(path: str | Path) -> Program:
    return load_hir(path)[0]


def load_hir(path: str | Path) -> tuple[Program, str]:
    """(Program, text) of the saved plan at `path`; its arrays file is checked against the recorded hash."""
    text = read_hir_text(path)
    return parse_hir(text, _read_arrays(Path(path), text)), text


def _read_arrays(path: Path, text: str) -> dict | None:
    match = _ARRAYS_HEADER.search(text)
    if match is None:
        return None
    name, expected = json.loads(match.group(1)), match.group(2)
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
        raise ArtifactError(f"{path}: arrays header names {name!r}, which is not a file name beside it")
    if expected is None:
        raise ArtifactError(f"{path}: its arrays header records no sha256, so {name} cannot be checked "
                            "(save the plan again)")
    side = path.parent / name
    if not side.is_file():
        raise ArtifactError(f"{path}: its arrays file {side} is missing (a saved plan is the .hir and its "
                            f"{ARRAYS_SUFFIX} together)")
    if not _is_zip(side):  # np.load would try it as a pickle and say so
        raise ArtifactError(f"{side}: not a readable arrays file (not an .npz zip archive)")
    try:
        with np.load(side, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise ArtifactError(f"{side}: not a readable arrays file ({exc})") from None
    found = arrays_digest(arrays)
    if found != expected:
        raise ArtifactError(f"{path} and {side} do not belong together: the .hir was saved with arrays "
                            f"sha256 {expected[:16]}..., the file holds {found[:16]}... (was one of them "
                            "replaced? save the plan again)")
    for key, array in arrays.items():  # the hash says the pair belongs together, not that the arrays are a plan's
        if key not in ARRAY_NAMES:
            raise ArtifactError(f"{side}: array {key!r} is not one of a plan's ({', '.join(ARRAY_NAMES)})")
        if array.ndim != 1 or array.dtype.kind not in "iu" or (array.size and array.max() > INT64_MAX):
            raise ArtifactError(f"{side}: array {key!r} is {array.dtype} of shape {array.shape}, not a list of "
                                "int64 token ids or offsets")
    return {key: array.astype(np.int64, copy=False) for key, array in arrays.items()}


def _check_writable(path: Path, what: str, same_kind) -> None:
    if path.name.endswith(ARRAYS_SUFFIX) and what == "plan":
        raise ArtifactError(f"{path}: {ARRAYS_SUFFIX} is reserved for a plan's arrays file; name the plan "
                            "e.g. run.hir")
    if path.is_dir():
        raise ArtifactError(f"{path}: is a directory; give a file name for the {what}")
    if not path.parent.is_dir():
        raise ArtifactError(f"{path}: folder {path.parent} does not exist")
    if path.exists() and not same_kind(path):
        raise ArtifactError(f"{path}: exists and is not a saved {what}; not overwriting it")


def _is_hir(path: Path) -> bool:
    with open(path, "rb") as handle:
        head = handle.read(4096)
    first = next((line for line in head.splitlines() if line.strip() and not line.startswith(b"#")), b"")
    return first.startswith(b"hir ") or (not first and (not head or head.startswith(b"#")))


def _is_zip(path: Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(4) == _ZIP_MAGIC


def _replace(path: Path, write) -> None:
    """Writes through a temporary file in the same folder, then renames it over `path` (atomic on POSIX)."""
    handle = tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False)
    try:
        with handle:
            write(handle)
        os.replace(handle.name, path)
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise
