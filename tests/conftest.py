"""Test configuration.

Without CUDA, Triton kernels run under Triton's CPU interpreter; the variable must be set before
any kernel module is imported, so it is set here, the one place tests read it.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
