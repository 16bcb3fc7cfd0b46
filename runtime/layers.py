"""Token-local building blocks shared by all layers: norms, RoPE tables, dense MLP.

These act on compact tokens [T, ...] one token at a time, so tree mode and trajectory-wise mode
run literally the same arithmetic on them. The norms run `codegen/kernels/rmsnorm` (one Triton pass
for 16-bit CUDA tensors, its plain-torch reference otherwise); the rest follows transformers'
Qwen3-Next code line by line, with one deliberate change: where transformers casts to float32 we cast to
`compute_dtype(x)` = the wider of x's dtype and float32, so float64 runs stay float64 end to end
(float32 and bfloat16 runs are unchanged).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harts_compiler.codegen.kernels.rmsnorm import compute_dtype, rms_norm


class ZeroCentredRMSNorm(nn.Module):
    """Qwen3NextRMSNorm: normalise in fp32, multiply by (1 + w), w initialised to 0."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, "offset")


class GatedRMSNorm(nn.Module):
    """Qwen3NextRMSNormGated: w * rmsnorm(x) * silu(z), plain weight initialised to 1."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon, "gated_silu", gate)


class RMSNorm(nn.Module):
    """KimiLinearRMSNorm: normalise in fp32 (wider for fp64), back to the input dtype, times w (initialised to 1)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon, "scale")


class SigmoidGatedRMSNorm(nn.Module):
    """KimiLinearRMSNormGated: w * rmsnorm(x) * sigmoid(gate), all in fp32 (wider for fp64), then the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon, "gated_sigmoid", gate)


class DenseMLP(nn.Module):
    """SwiGLU MLP (Qwen3NextMLP); also the shared expert of the MoE block."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_tables(positions: torch.Tensor, head_dim: int, partial_rotary_factor: float, theta: float,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rotary_dim] for token positions, exactly as Qwen3NextRotaryEmbedding.

    The frequencies are computed in float32 and cast to the model dtype, as transformers does (fp64 runs
    multiply positions by them in fp64, where transformers' position_ids.float() would round)
    (Qwen3.5's multimodal RoPE reduces to this for text, where all three position axes agree).
    """
    dim = int(head_dim * partial_rotary_factor)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=positions.device) / dim))
    wide = compute_dtype(dtype)  # the angles in fp32 as transformers, in fp64 for fp64 runs
    freqs = positions[:, None].to(wide) * inv_freq[None, :].to(wide)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first cos.shape[-1] dims of x [T, H, D]; cos/sin [T, rot]."""
    rot = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([x_rot * cos + _rotate_half(x_rot) * sin, x_pass], dim=-1)


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's RoPE on interleaved pairs (x0, x1), (x2, x3), ... of x [T, H, D], returned de-interleaved
    (rotated evens, then rotated odds), as transformers' apply_rotary_pos_emb_interleave; cos/sin [T, D] as
    rope_tables gives them (cat(freqs, freqs))."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
