"""Single-process inference: the KV cache changes nothing, sampling options do what they say."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.errors import UserError
from megatron_ds.inference import GPTModel, KVCache, generate, sample_next

GPT = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    seq_length=16,
    max_position_embeddings=40,
    vocab_size=96,
)
INIT = RegularizationConfig(hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.3)
LLAMA = dataclasses.replace(
    GPT,
    normalization="rmsnorm",
    activation="swiglu",
    use_rotary_position_embeddings=True,
    add_position_embedding=False,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    num_key_value_heads=2,
)


def _model(config: ModelConfig) -> GPTModel:
    torch.manual_seed(0)  # layers draw from their own seeded generators; norms/biases: perturb them too
    model = GPTModel(config, INIT)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("config", [GPT, LLAMA], ids=["gpt", "llama_gqa"])
def test_cached_forward_equals_uncached(config: ModelConfig) -> None:
    model = _model(config)
    tokens = torch.randint(0, config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache()
        pieces = [model(tokens[:, :9], cache), model(tokens[:, 9:14], cache)]  # a prefill, then a chunk
        pieces += [model(tokens[:, i : i + 1], cache) for i in range(14, 21)]  # then one token at a time
    assert cache.length == 21
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("config", [GPT, LLAMA], ids=["gpt", "llama_gqa"])
def test_greedy_generation_is_the_same_with_and_without_cache(config: ModelConfig) -> None:
    model = _model(config)
    cached = generate(model, [3, 1, 4], 25, temperature=0.0)
    assert cached == generate(model, [3, 1, 4], 25, temperature=0.0, use_cache=False)
    assert len(set(cached)) > 3  # a real sequence, not one repeated token


def test_sampling_options() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])
    gen = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    assert sample_next(logits, 0.0, 0, 1.0, None).item() == 1
    assert sample_next(logits, 1.0, 1, 1.0, gen()).item() == 1  # top-k 1 is greedy
    assert sample_next(logits, 1.0, 0, 0.01, gen()).item() == 1  # top-p that keeps only the best
    draws = {sample_next(logits, 1.0, 2, 1.0, torch.Generator().manual_seed(s)).item() for s in range(50)}
    assert draws == {1, 2}  # top-k 2 never draws outside the best two
    model = _model(GPT)
    a = generate(model, [5], 10, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    assert a == generate(model, [5], 10, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    assert a != generate(model, [5], 10, temperature=0.8, top_k=20, top_p=0.9, seed=4)


def test_generation_stops_at_eos_and_checks_inputs() -> None:
    model = _model(GPT)
    first = generate(model, [5, 6], 5, temperature=0.0)
    assert generate(model, [5, 6], 5, temperature=0.0, eos_id=first[1]) == first[: first.index(first[1]) + 1]
    with pytest.raises(UserError, match="exceed the 40 learned positions"):
        generate(model, [1] * 30, 11, temperature=0.0)
    with pytest.raises(UserError, match=r"token id 96 is not in the model's vocabulary \[0, 96\)"):
        generate(model, [96], 1)
    with pytest.raises(UserError, match=r"^prompt: empty"):
        generate(model, [], 1)
    with pytest.raises(UserError, match="--top-p 0"):
        generate(model, [1], 1, top_p=0.0)
    for bad in (math.nan, math.inf, -1.0):  # NaN used to reach torch.multinomial
        with pytest.raises(UserError, match=f"--temperature {bad} must be a finite number >= 0"):
            generate(model, [1], 1, temperature=bad)
    with pytest.raises(UserError, match="--max-new-tokens -3 must be >= 1"):
        generate(model, [1], -3)


def test_a_file_given_as_a_checkpoint_is_named_as_one(tmp_path) -> None:
    from megatron_ds.training.checkpoint.directory import CheckpointError
    from megatron_ds.training.checkpoint.reader import open_checkpoint

    (tmp_path / "model.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"model\.pt: a file, not a directory; give a checkpoint directory$"):
        open_checkpoint(str(tmp_path / "model.pt"))
    with pytest.raises(CheckpointError, match=r"absent: no such directory; give a checkpoint directory$"):
        open_checkpoint(str(tmp_path / "absent"))
