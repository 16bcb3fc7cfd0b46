"""What Triton's CPU interpreter can run (every kernel folder).

16-bit dots: under ``TRITON_INTERPRET=1`` (triton 3.6) ``tl.dot`` of bf16/fp16 operands returns garbage
(it multiplies raw bit patterns: a 16x16 bf16 dot is off by 2.5e10, while a bf16 -> fp32 cast
round-trips exactly). Kernels with dots therefore run 16-bit inputs in fp32 there
(`interpreter_needs_fp32`) and cast the results back; the GPU compiles 16-bit dots correctly.

16-bit stores: the interpreter rounds fp32 -> bf16 by truncation (about half of random values land one ulp
off round-to-nearest-even, which torch and the compiled kernels use), so kernels whose results are rounded
to 16 bits once (segment_add) run on an fp32 copy there and torch rounds it (`interpreter_needs_fp32`).

Loops with data-dependent bounds:
Under ``TRITON_INTERPRET=1`` (triton 3.6) every scalar is a 1-element numpy array, and
``range(lo, hi)`` on loaded bounds calls ``int()`` on it, which numpy >= 2.4 rejects ("only
0-dimensional arrays can be converted to Python scalars"). The kernels therefore take an
``INTERPRET`` constexpr: the interpreter runs a ``while`` loop (whose test goes through
``__bool__``, which the interpreter supports), compiled code keeps the ``for`` loop that Triton
software-pipelines. The branch is resolved at compile time, so the GPU code is unchanged.
"""
import os

import torch


def interpreting() -> bool:
    """Whether Triton kernels run under the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def interpreter_needs_fp32(t: torch.Tensor) -> bool:
    """A CPU tensor of 16-bit floats under the interpreter: its dots must run in fp32 (see above)."""
    return not t.is_cuda and interpreting() and t.dtype in (torch.bfloat16, torch.float16)
