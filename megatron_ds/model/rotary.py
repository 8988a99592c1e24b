"""Rotary position embeddings (RoPE), Megatron/Llama convention: rotate-half over the rotary dim.

With r rotary channels (the head dim, or int(head dim x `--rotary-percent`) for Megatron's partial
rotary), frequencies theta_i = base^(-2i/r) for i in [0, r/2); position p rotates the pair
(x[i], x[i + r/2]) by angle p * theta_i; channels r.. of the head pass through unchanged.
Positions are 0..s-1 of each sample.
"""

from __future__ import annotations

import torch


def rotary_angles(seq_length: int, rotary_dim: int, device: torch.device, base: float) -> torch.Tensor:
    """Angles (s, r) in fp32: position p times theta_i, the r/2 frequencies repeated twice; r is
    `ModelConfig.rotary_dim`, `base` is `ModelConfig.rotary_base` (10000 by default, Llama-3 500000)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
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
