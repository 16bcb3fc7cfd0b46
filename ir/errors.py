"""Errors raised by IR checks: a broken invariant is a compiler bug, not bad user input."""


class IRError(ValueError):
    """An IR invariant does not hold; the message names the structure and the invariant."""


class ArtifactError(ValueError):
    """A saved plan cannot be written or read back as one artifact (a missing or replaced arrays file, a
    path of another kind): the user's files, named in the message, not a compiler bug."""
