"""Rotary position embeddings (RoPE), Megatron/Llama convention: rotate-half over the rotary dim.

With r rotary channels (the head dim, or int(head dim x `--rotary-percent`) for Megatron's partial
rotary), frequencies theta_i = base^(-2i/r) for i in [0, r/2); position p rotates the pair
(x[i], x[i + r/2]) by angle p * theta_i; channels r.. of the head pass through unchanged.
Positions are 0..s-1 of each sample. Llama 3.x's RoPE scaling (`--use-rope-scaling`) then lowers the
frequencies of long wavelengths (`llama3_scaled`).
"""

from __future__ import annotations

import math

import torch

from megatron_ds.config.model import LLAMA3_ROPE_SCALING


def llama3_scaled(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3.x's scaled frequencies (megatron-core's `_apply_scaling`, transformers' `llama3` rope type): a
    wavelength 2 pi / theta longer than original context / low_freq_factor is stretched by `factor`, one shorter
    than original context / high_freq_factor kept, and between the two theta blends theta / factor into theta
    linearly in original context / wavelength."""
    low, high = LLAMA3_ROPE_SCALING["low_freq_factor"], LLAMA3_ROPE_SCALING["high_freq_factor"]
    context = LLAMA3_ROPE_SCALING["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(between, blended, scaled)


def inverse_frequencies(
    rotary_dim: int, device: torch.device, base: float, scaling_factor: float | None = None
) -> torch.Tensor:
    """The r/2 frequencies theta_i = base^(-2i/r) in fp32, Llama 3.x-scaled by `scaling_factor` when given."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
    return inv_freq if scaling_factor is None else llama3_scaled(inv_freq, scaling_factor)


def rotary_angles(
    seq_length: int, rotary_dim: int, device: torch.device, base: float, scaling_factor: float | None = None
) -> torch.Tensor:
    """Angles (s, r) in fp32: position p times theta_i, the r/2 frequencies repeated twice; r is
    `ModelConfig.rotary_dim`, `base` is `ModelConfig.rotary_base` (10000 by default, Llama-3 500000),
    `scaling_factor` the Llama 3.x scaling's (`ModelConfig.rope_scaling_factor`) or None."""
    inv_freq = inverse_frequencies(rotary_dim, device, base, scaling_factor)
    positions = torch.arange(seq_length, dtype=torch.float32, device=device)
    freqs = torch.outer(positions, inv_freq)  # (s, hd/2)
    return torch.cat((freqs, freqs), dim=-1)  # (s, hd)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x (b, heads, s, hd): its first r channels rotated by `angles` (s, r), the rest passed through;
    computed in x's dtype, as Megatron."""
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    r = angles.shape[-1]
    if r == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rotated, passed = x[..., :r], x[..., r:]
    return torch.cat((rotated * cos + _rotate_half(rotated) * sin, passed), dim=-1)
