"""How much memory `harts verify` needs, estimated before any compute, and the refusal when it cannot fit.

Both modes run one microbatch at a time, backward right after forward, so the peak is

    resident   model parameters + their gradient + one accumulated gradient per mode (4 copies)
               + the per-trajectory rows kept for the comparison (log-probs and entropies, both modes)
    transient  the activations autograd keeps for the largest microbatch (tree mode or trajectory-wise)

and a 16-bit run adds its float64 reference: a float64 copy of the parameters, its gradient and accumulated
gradient, its rows, and the float64 activations of the largest trajectory-wise pack.

The activation model counts two kinds of rows a microbatch carries (both read off its MicrobatchIndex):
compact tokens, which every layer sees, and linear-attention rows (`rounds[*].row_src`, the tokens of the
sequences each linear-attention round runs, replays included), which only the linear-attention layers see.
Per linear-attention row the plain-torch chunked delta rule keeps O(chunk) and O(chunk^2) values per value
head (the intra-chunk matrices and the row-by-row triangular solve). The constants were fitted once by
least squares to the peak RSS growth (resource.getrusage) of forward + backward on tiny-qwen3-next
(fp64, CPU, 1.3k-8k tokens, chunk sizes 16-128, both modes; the fit was within 8% of every run) and then
raised by 10%, so the estimate errs on the safe side. They describe the CPU reference path; the Triton
path on a GPU keeps less.
"""
from __future__ import annotations

import dataclasses
import os
import re

import torch

from .errors import InputError

# values kept per compact token per layer, in units of the hidden size (fit: 41)
_PER_TOKEN_PER_LAYER_HIDDEN = 45
# values kept per linear-attention row per linear layer: 24 * hidden + value_heads * (5.5 * C + 0.8 * C^2)
# (fit: 21, 4.9, 0.69)
_PER_ROW_HIDDEN, _PER_ROW_CHUNK, _PER_ROW_CHUNK_SQUARED = 24, 5.5, 0.8
_LOGIT_CHUNK_TOKENS = 4096  # token_logprobs keeps [4096, vocab] fp32 logits live at once
# torch, the model and the plan's host tables (~310 MB measured before any forward), plus what the allocator
# holds on to between microbatches (the 47k- and 118k-token swe batches peaked 0.1-0.3 GB above the rest)
_INTERPRETER_BYTES = 768 << 20


@dataclasses.dataclass(frozen=True)
class Footprint:
    """What a microbatch's activations scale with."""

    tokens: int  # compact tokens (trajectory-wise: trajectory tokens)
    linear_rows: int  # rows of all linear-attention rounds


def footprint(index) -> Footprint:
    """The footprint of a MicrobatchIndex (tree mode or `trajectory_index`), or of a `PieceChain`: all its pieces'
    graphs are alive until the backward, so their sizes add up."""
    pieces = getattr(index, "indices", [index])
    rows = sum(len(round_.row_src) for piece in pieces for round_ in piece.rounds)
    return Footprint(tokens=sum(len(piece.token_ids) for piece in pieces), linear_rows=int(rows))


def activation_bytes(config, dtype_bytes: int, chunk_size: int, size: Footprint, *, checkpointing: bool) -> int:
    """Bytes autograd keeps for one microbatch of `size` (forward + backward peak)."""
    layers = config.num_hidden_layers
    linear_layers = sum(kind == "linear_attention" for kind in config.layer_types)
    value_heads = getattr(config, "linear_num_value_heads", None) or getattr(config, "linear_num_heads", 1)
    hidden = config.hidden_size
    per_layer_tokens = _PER_TOKEN_PER_LAYER_HIDDEN * hidden * size.tokens
    per_linear_layer_rows = size.linear_rows * (_PER_ROW_HIDDEN * hidden + value_heads * (
        _PER_ROW_CHUNK * chunk_size + _PER_ROW_CHUNK_SQUARED * chunk_size ** 2))
    if checkpointing:  # every layer keeps its input; one layer's activations are alive at a time
        values = layers * hidden * size.tokens + per_layer_tokens + (per_linear_layer_rows if linear_layers else 0)
    else:
        values = layers * per_layer_tokens + linear_layers * per_linear_layer_rows
    logits = 2 * min(size.tokens, _LOGIT_CHUNK_TOKENS) * config.vocab_size * max(dtype_bytes, 4)
    return int(values * dtype_bytes + logits)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    resident: int  # parameters, gradients, kept rows, interpreter (and a float64 reference's copy)
    tree_peak: int  # largest tree-mode microbatch
    trajectory_peak: int  # largest trajectory-wise pack (the float64 reference's, when it runs one)
    largest_tree: Footprint
    largest_pack: Footprint

    @property
    def total(self) -> int:
        return self.resident + max(self.tree_peak, self.trajectory_peak)


def estimate_memory(model, chunk_size: int, tree_sizes: list[Footprint], pack_sizes: list[Footprint], *,
                    trajectories: int, max_length: int, checkpointing: bool,
                    reference_dtype: torch.dtype | None = None) -> MemoryEstimate:
    """`reference_dtype`: a copy of the model in that dtype also runs the trajectory-wise packs (16-bit runs'
    float64 reference), while the model and both modes' gradients stay alive."""
    weight = model.lm_head.weight
    dtype_bytes = weight.element_size()
    count = sum(p.numel() for p in model.parameters())
    params = count * dtype_bytes
    rows = 2 * 2 * 2 * trajectories * max_length * dtype_bytes  # (log-prob, entropy) x modes x assembled copy
    largest_tree = max(tree_sizes, key=lambda s: (s.linear_rows, s.tokens), default=Footprint(0, 0))
    largest_pack = max(pack_sizes, key=lambda s: (s.linear_rows, s.tokens), default=Footprint(0, 0))
    peak = lambda size, nbytes: activation_bytes(model.config, nbytes, chunk_size, size,  # noqa: E731
                                                 checkpointing=checkpointing)
    resident = 4 * params + rows + _INTERPRETER_BYTES
    trajectory_peak = peak(largest_pack, dtype_bytes)
    if reference_dtype is not None:  # its parameters and gradient, the mode's accumulated gradient, its rows
        reference_bytes = torch.empty((), dtype=reference_dtype).element_size()
        resident += 3 * count * reference_bytes + 2 * trajectories * max_length * reference_bytes
        trajectory_peak = max(trajectory_peak, peak(largest_pack, reference_bytes))
    return MemoryEstimate(resident=resident, tree_peak=peak(largest_tree, dtype_bytes),
                          trajectory_peak=trajectory_peak, largest_tree=largest_tree, largest_pack=largest_pack)


def available_memory(device=None) -> int:
    """Bytes a new allocation can get on `device`: on a GPU what the driver reports free, on the CPU what the
    kernel says (MemAvailable), else physical memory."""
    if device is not None and torch.device(device).type == "cuda":
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def parse_memory_size(text: str) -> int:
    """'24G', '512M', '1.5GiB', '1000000' (bytes) -> bytes; InputError otherwise."""
    match = _SIZE.match(text)
    if not match or float(match.group(1)) <= 0:
        raise InputError(f"--memory-limit {text!r}: expected a positive size such as 8G, 512M or 1.5GiB")
    return int(float(match.group(1)) * 1024 ** " kmgt".index(match.group(2).lower() or " "))


def gigabytes(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def check_fits(estimate: MemoryEstimate, limit: int, *, microbatch_tokens: int, limit_source: str,
               float64: bool = True) -> None:
    """Raise a one-line InputError when `estimate` is over `limit`, naming what dominates and the flags that lower
    it (`float64`: the run is in float64, so float32 would halve it)."""
    if estimate.total <= limit:
        return
    if estimate.tree_peak >= estimate.trajectory_peak:
        big = (f"largest tree-mode microbatch {estimate.largest_tree.tokens:,} compact tokens "
               f"({estimate.largest_tree.linear_rows:,} linear-attention rows): {gigabytes(estimate.tree_peak)}")
    else:
        big = (f"largest trajectory-wise pack {estimate.largest_pack.tokens:,} tokens: "
               f"{gigabytes(estimate.trajectory_peak)}")
    raise InputError(f"needs about {gigabytes(estimate.total)} ({big}; parameters, gradients and rows "
                     f"{gigabytes(estimate.resident)}) but {limit_source} is {gigabytes(limit)}: lower "
                     f"--microbatch-tokens (now {microbatch_tokens:,}), or add --checkpointing"
                     + (" or --dtype float32" if float64 else ""))
