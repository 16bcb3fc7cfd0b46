"""The one error type users see for bad input or an impossible compile request."""
from __future__ import annotations

from contextlib import contextmanager


class InputError(ValueError):
    """Bad input. ``problems`` holds one line per problem, each naming line/tree/node/field.

    The CLI prints ``str(error)`` (the problems, one per line) and exits with code 2; nothing
    deeper in the compiler should ever see input that did not pass the checks raising this.
    """

    def __init__(self, problems: list[str] | str):
        if isinstance(problems, str):
            problems = [problems]
        self.problems: list[str] = list(problems)
        super().__init__("\n".join(self.problems))


def check_output_file(path, flag: str = "-o") -> None:
    """InputError unless `path` can be written as a file: not a directory, its folder exists."""
    from pathlib import Path

    path = Path(path)
    if path.is_dir():
        raise InputError(f"{flag} {path}: is a directory; give a file name")
    if not path.parent.is_dir():
        what = "is a file, not a folder" if path.parent.exists() else "does not exist"
        raise InputError(f"{flag} {path}: folder {path.parent} {what}")


@contextmanager
def cannot_write(flag: str, path):
    """An OSError while writing `path` (a folder without write permission, a read-only file system, a full disk)
    becomes one InputError line naming the flag and the path."""
    try:
        yield
    except OSError as error:
        if path is None:
            raise
        raise InputError(f"{flag} {path}: cannot write ({error.strerror or error})") from None
