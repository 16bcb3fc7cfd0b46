"""Host plans -> device plans in one copy.

Launch plans are frozen dataclasses whose arrays are numpy on the host (built and verified there). `to_device`
packs every array of a plan (nested dataclasses, tuples, lists and dict values included) into one byte
buffer, copies it to the device once (pinned and asynchronous on CUDA, so the host never waits and the
stream stays free of synchronisation), and rebuilds the same dataclasses with tensor views of that buffer.
Everything that is not an array (ints, tuples of ints, configs) is kept as it is.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

_ALIGN = 16  # bytes: every view starts aligned for any element type (and for vectorised loads)

_TORCH_DTYPE = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.bool_): torch.bool,
                np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
                np.dtype(np.uint8): torch.uint8, np.dtype(np.int8): torch.int8}


def _arrays(value, found: list) -> None:
    """Every array reachable from `value`, depth first, in a fixed order: numpy arrays, and the tensors of a plan
    already uploaded (moving it to another device reads them back once)."""
    if isinstance(value, (np.ndarray, torch.Tensor)):
        found.append(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _arrays(getattr(value, field.name), found)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _arrays(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _arrays(item, found)


def _rebuild(value, views: dict):
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return views[id(value)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _rebuild(getattr(value, f.name), views) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    if isinstance(value, tuple):
        return tuple(_rebuild(item, views) for item in value)
    if isinstance(value, list):
        return [_rebuild(item, views) for item in value]
    if isinstance(value, dict):
        return {key: _rebuild(item, views) for key, item in value.items()}
    return value


def to_device(plan, device):
    """`plan` with every numpy array replaced by a tensor on `device`, all of them views of one buffer that
    is copied once (O(total bytes))."""
    device = torch.device(device)
    found: list = []
    _arrays(plan, found)
    originals = list({id(a): a for a in found}.values())
    unique = [a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else a for a in originals]
    for array in unique:
        if array.dtype not in _TORCH_DTYPE:
            raise TypeError(f"to_device: arrays of dtype {array.dtype} are not supported")
    offsets, total = [], 0
    for array in unique:
        offsets.append(total)
        total += -(-array.nbytes // _ALIGN) * _ALIGN
    pinned = device.type == "cuda"
    host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=pinned)
    flat = host.numpy()
    for array, offset in zip(unique, offsets):
        flat[offset:offset + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    buffer = host.to(device, non_blocking=pinned) if device.type != "cpu" else host
    views = {}
    for original, array, offset in zip(originals, unique, offsets):
        raw = buffer[offset:offset + array.nbytes]
        views[id(original)] = raw.view(_TORCH_DTYPE[array.dtype]).view(array.shape)
    return _rebuild(plan, views)
