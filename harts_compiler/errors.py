"""The one error type users see for bad input or an impossible compile request."""
from __future__ import annotations


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
