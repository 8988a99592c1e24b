"""Rotary position embeddings (RoPE), Megatron/Llama convention: rotate-half over the head dim.

Frequencies theta_i = base^(-2i/hd) for i in [0, hd/2); position p rotates the pair
(x[i], x[i + hd/2]) by angle p * theta_i. Positions are 0..s-1 of each sample.
"""

from __future__ import annotations

import torch


def rotary_angles(seq_length: int, head_dim: int, device: torch.device, base: float) -> torch.Tensor:
    """Angles (s, hd) in fp32: position p times theta_i, the hd/2 frequencies repeated twice; `base` is
    `ModelConfig.rotary_base` (10000 by default, Llama-3 500000)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    positions = torch.arange(seq_length, dtype=torch.float32, device=device)
    freqs = torch.outer(positions, inv_freq)  # (s, hd/2)
    return torch.cat((freqs, freqs), dim=-1)  # (s, hd)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x (b, heads, s, hd) rotated by `angles` (s, hd); computed in x's dtype, as Megatron."""
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    return x * cos + _rotate_half(x) * sin
