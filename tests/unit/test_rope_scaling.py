"""Llama 3.x's RoPE scaling (`--use-rope-scaling`): the frequencies equal megatron-core's `RotaryEmbedding` and
transformers' `llama3` rope type. Import, export and the logits against transformers: tests/unit/test_hf_interop.py."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_ds.model.rotary import inverse_frequencies, rotary_angles

HEAD_DIM, THETA = 128, 500000.0  # Llama 3's


def _megatron_core(factor: float) -> torch.Tensor:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(
        HEAD_DIM, 1.0, rotary_base=THETA, rope_scaling=True, rope_scaling_factor=factor, use_cpu_initialization=True
    )
    return rope.inv_freq


def _transformers(factor: float) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        max_position_embeddings=131072,
        rope_theta=THETA,
        rope_scaling={
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    assert attention_factor == 1.0  # cos and sin are not rescaled
    return inv_freq


@pytest.mark.parametrize("factor", [8.0, 32.0])  # Llama 3.1 / 3.3 and Llama 3.2
def test_frequencies_equal_megatron_core_and_transformers(factor: float) -> None:
    ours = inverse_frequencies(HEAD_DIM, torch.device("cpu"), THETA, factor)
    assert torch.equal(ours, _megatron_core(factor))
    torch.testing.assert_close(ours, _transformers(factor).float(), rtol=1e-6, atol=0.0)
    plain = inverse_frequencies(HEAD_DIM, torch.device("cpu"), THETA)
    wavelength = 2 * math.pi / plain
    kept, stretched = wavelength < 8192 / 4, wavelength > 8192 / 1
    between = ~kept & ~stretched
    assert kept.sum() > 0 and stretched.sum() > 0 and between.sum() > 0  # all three bands at Llama 3's sizes
    assert torch.equal(ours[kept], plain[kept])
    torch.testing.assert_close(ours[stretched], plain[stretched] / factor, rtol=1e-6, atol=0.0)
    assert ((ours[between] < plain[between]) & (ours[between] > plain[between] / factor)).all()


def test_angles_use_the_scaled_frequencies() -> None:
    cpu = torch.device("cpu")
    angles = rotary_angles(5, HEAD_DIM, cpu, THETA, 8.0)
    expected = torch.outer(torch.arange(5.0), inverse_frequencies(HEAD_DIM, cpu, THETA, 8.0))
    assert torch.equal(angles, torch.cat((expected, expected), dim=-1))
    assert not torch.equal(angles, rotary_angles(5, HEAD_DIM, cpu, THETA))
