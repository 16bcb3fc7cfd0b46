"""Test configuration.

Without CUDA, Triton kernels run under Triton's CPU interpreter; the variable must be set before
any kernel module is imported, so it is set here, the one place tests read it.

The fixtures that tests share with the benchmarks (`tree_layouts`, `two_level`) live in tools/,
outside the installed package; tools/ goes on sys.path here, before any test module is imported.
"""
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TOOLS = str(Path(__file__).resolve().parent.parent / "tools")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (tiny fp64 tensors: more threads only add contention, and
    spawned workers use one too); modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
