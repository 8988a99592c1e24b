"""Model configurations the tests share."""

from __future__ import annotations

from megatron_ds.config import ModelConfig

GPT_1_3B = ModelConfig(
    num_layers=24,
    hidden_size=2048,
    num_attention_heads=16,
    ffn_hidden_size=8192,
    seq_length=2048,
    max_position_embeddings=2048,
    vocab_size=50304,
)
"""A 1.3B GPT (GPT-2's vocabulary padded to 50304, as Megatron pads it): the memory tests' paper-scale model."""
