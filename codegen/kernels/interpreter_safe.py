"""Loops with data-dependent bounds under Triton's CPU interpreter (every kernel folder).

Under ``TRITON_INTERPRET=1`` (triton 3.6) every scalar is a 1-element numpy array, and
``range(lo, hi)`` on loaded bounds calls ``int()`` on it, which numpy >= 2.4 rejects ("only
0-dimensional arrays can be converted to Python scalars"). The kernels therefore take an
``INTERPRET`` constexpr: the interpreter runs a ``while`` loop (whose test goes through
``__bool__``, which the interpreter supports), compiled code keeps the ``for`` loop that Triton
software-pipelines. The branch is resolved at compile time, so the GPU code is unchanged.
"""
import os


def interpreting() -> bool:
    """Whether Triton kernels run under the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
