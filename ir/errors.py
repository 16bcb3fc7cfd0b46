"""Errors raised by IR checks: a broken invariant is a compiler bug, not bad user input."""


class IRError(ValueError):
    """An IR invariant does not hold; the message names the structure and the invariant."""
