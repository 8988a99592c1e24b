"""Tensor-parallel shards, initialization and dropout streams, without a process group.

The layout of the fused QKV shard is checked mathematically: simulating T ranks in one process
(column-parallel QKV and fc1 shards, local heads, row-parallel proj and fc2 partial sums) must
give the T=1 layer's output. The multi-rank tests check the same through megatron-core's layers.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.model import rng
from megatron_ds.model.init import gather_qkv, shard, shard_qkv
from megatron_ds.model.layers import PositionEmbedding
from megatron_ds.model.transformer import TransformerLayer

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    seq_length=8,
    max_position_embeddings=8,
    vocab_size=128,
)
NO_DROPOUT = RegularizationConfig(hidden_dropout=0.0, attention_dropout=0.0)
DROPOUT = RegularizationConfig(hidden_dropout=0.2, attention_dropout=0.2)
SEED = 1234 * 1_000_003 + 3


@pytest.mark.parametrize("t", [1, 2, 4])
def test_qkv_shards_hold_their_heads_and_gather_back(t: int) -> None:
    h, nh = MODEL.hidden_size, MODEL.num_attention_heads
    hd = h // nh
    full = torch.randn(3 * h, h)
    shards = [shard_qkv(full, nh, t, r) for r in range(t)]
    assert torch.equal(gather_qkv(shards, nh), full)
    bias = torch.randn(3 * h)
    assert torch.equal(gather_qkv([shard_qkv(bias, nh, t, r) for r in range(t)], nh), bias)
    for r, s in enumerate(shards):  # shard r = q, k, v rows of heads [r*nh/t, (r+1)*nh/t)
        heads = range(r * nh // t, (r + 1) * nh // t)
        expected = torch.cat(
            [full[part * h + head * hd : part * h + (head + 1) * hd] for part in range(3) for head in heads]
        )
        assert torch.equal(s, expected)


def _simulated_tensor_parallel_forward(layer: TransformerLayer, x: torch.Tensor, t: int, gelu: str) -> torch.Tensor:
    """What T ranks compute with shards of `layer`'s (T=1) weights, summed as the all-reduces would;
    `gelu` is torch's `approximate` argument of the layer's GeLU."""
    b, s, h = x.shape
    nh = MODEL.num_attention_heads
    hd = h // nh
    normed = layer.input_norm(x)
    attn_out = torch.zeros_like(x)
    for r in range(t):
        w, bias = shard_qkv(layer.qkv.weight, nh, t, r), shard_qkv(layer.qkv.bias, nh, t, r)
        qkv = F.linear(normed, w, bias).view(b, s, 3, nh // t, hd)
        q, k, v = (u.transpose(1, 2) for u in qkv.unbind(dim=2))
        local = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h // t)
        attn_out = attn_out + F.linear(local, shard(layer.proj.weight, 1, t, r))
    x = x + attn_out + layer.proj.bias
    normed = layer.post_attention_norm(x)
    mlp = torch.zeros_like(x)
    for r in range(t):
        fc1 = F.linear(normed, shard(layer.fc1.weight, 0, t, r), shard(layer.fc1.bias, 0, t, r))
        inner = F.gelu(fc1, approximate=gelu)
        mlp = mlp + F.linear(inner, shard(layer.fc2.weight, 1, t, r))
    return x + mlp + layer.fc2.bias


@pytest.mark.parametrize("activation,gelu", [("gelu_tanh", "tanh"), ("gelu", "none")])
@pytest.mark.parametrize("t", [2, 4])
@torch.no_grad()
def test_sharded_layer_computes_the_t1_layer(t: int, activation: str, gelu: str) -> None:
    layer = TransformerLayer(dataclasses.replace(MODEL, activation=activation), NO_DROPOUT, SEED).eval()
    for p in layer.parameters():  # non-zero biases and norms, so their sharding is exercised too
        p.add_(0.01 * torch.randn(p.shape))
    x = torch.randn(2, MODEL.seq_length, MODEL.hidden_size)
    torch.testing.assert_close(_simulated_tensor_parallel_forward(layer, x, t, gelu), layer(x), rtol=0, atol=1e-6)


def test_initial_weights_are_a_function_of_the_seed_only() -> None:
    torch.manual_seed(0)
    a = TransformerLayer(MODEL, NO_DROPOUT, SEED)
    torch.manual_seed(1)  # the global generator does not matter (nn.Linear's own init is overwritten)
    b = TransformerLayer(MODEL, NO_DROPOUT, SEED)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(a.qkv.weight, TransformerLayer(MODEL, NO_DROPOUT, SEED + 1).qkv.weight)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--num-attention-heads", "6", "--ffn-hidden-size", "96"], "--num-attention-heads 6 is not divisible by"),
        (["--num-attention-heads", "4", "--ffn-hidden-size", "98"], "--ffn-hidden-size 98 is not divisible by"),
    ],
)
def test_validation_refuses_sizes_tensor_parallelism_cannot_split(flags: list[str], message: str) -> None:
    from megatron_ds.flags.parser import ConfigError, parse_config

    argv = [
        "--num-layers",
        "2",
        "--hidden-size",
        "48",
        "--seq-length",
        "8",
        "--vocab-size",
        "100",
        "--train-iters",
        "1",
        "--lr",
        "1e-3",
        "--tensor-model-parallel-size",
        "4",
        *flags,
    ]
    with pytest.raises(ConfigError, match=message):
        parse_config(argv, world_size=4)
    assert (
        parse_config([*argv[:-4], "--num-attention-heads", "4", "--ffn-hidden-size", "96"], world_size=4)[
            0
        ].model.vocab_size
        == 512
    )  # padded to 128 x T


def _train_step(layer: TransformerLayer, x: torch.Tensor, recompute: bool) -> list[torch.Tensor]:
    from deepspeed.runtime.activation_checkpointing import checkpointing

    layer.zero_grad()
    rng.reset_streams()
    inp = x.clone().requires_grad_(True)
    out = checkpointing.checkpoint(layer, inp) if recompute else layer(inp)
    out.square().sum().backward()
    return [out.detach(), inp.grad] + [p.grad.clone() for p in layer.parameters()]


def test_dropout_masks_replay_under_deepspeed_recompute() -> None:
    """Activation checkpointing restores the dropout streams: the recomputed forward is the same."""
    model = MODEL
    layer = TransformerLayer(model, DROPOUT, SEED).train()
    x = torch.randn(2, model.seq_length, model.hidden_size)
    plain = _train_step(layer, x, recompute=False)
    torch.manual_seed(99)  # what the default generator holds does not matter: the streams are the spec's
    again = _train_step(layer, x, recompute=True)
    for a, b in zip(plain, again):
        assert torch.equal(a, b)
    assert not torch.equal(plain[0], layer.eval()(x))  # dropout was active


def test_replicated_stream_is_independent_of_the_default_generator() -> None:
    rng.reset_streams()
    embed = PositionEmbedding(MODEL, RegularizationConfig(hidden_dropout=0.5), SEED).train()
    x = torch.zeros(2, MODEL.seq_length, MODEL.hidden_size)
    torch.manual_seed(5)
    first = embed(x)
    default_after = torch.get_rng_state()
    rng.reset_streams()
    torch.manual_seed(6)
    assert torch.equal(embed(x), first)
    torch.manual_seed(5)
    assert torch.equal(torch.get_rng_state(), default_after)  # the default generator was not advanced


def test_masks_are_a_function_of_the_global_micro_batch() -> None:
    """Reseeded for micro-batch g, a layer draws the same masks whatever ran before; another g, others."""
    layer = TransformerLayer(MODEL, DROPOUT, SEED).train()
    streams = rng.module_streams(layer)
    assert [s.name for s in streams] == [layer.hidden_stream.name, layer.attention_stream.name]
    x = torch.randn(2, MODEL.seq_length, MODEL.hidden_size)
    rng.seed_streams(streams, 5)
    first = layer(x)
    layer(x)  # advances both streams
    rng.seed_streams(streams, 5)
    assert torch.equal(layer(x), first)
    rng.seed_streams(streams, 6)
    assert not torch.equal(layer(x), first)
    # Micro-batch 1 of data-parallel rank 1 (DP=2) holds the samples of micro-batch 3 at DP=1.
    assert rng.micro_batch_first_sample(48, 1, 2, 2, 1) == rng.micro_batch_first_sample(48, 3, 2, 1, 0) == 54


def test_micro_batch_seeds_differ_in_their_low_32_bits() -> None:
    """The CPU generator keeps the low 32 bits of a seed: neighbouring streams and indices must differ there."""
    low = {rng.micro_batch_seed(seed, g) & 0xFFFFFFFF for seed in range(50) for g in range(200)}
    assert len(low) == 50 * 200
    assert all(0 <= rng.micro_batch_seed(2**62 + s, 10**9) < 2**63 for s in range(10))


def test_a_stream_state_is_the_generator_state_after_manual_seed_and_queues_nothing() -> None:
    """The CPU fast path gives the state `torch.manual_seed(seed)` would, without touching the default
    generator or queueing lazy CUDA seeds (each of which formats a stack trace)."""
    import torch.cuda

    before = torch.get_rng_state()
    for seed in (0, 1, 12345, rng.micro_batch_seed(7, 3), 2**63 - 1):
        state = rng._seeded_state(seed)
        assert torch.equal(torch.get_rng_state(), before)
        torch.manual_seed(seed)
        assert torch.equal(state, torch.get_rng_state())
        torch.set_rng_state(before)
    if not torch.cuda.is_initialized():
        torch.cuda._lazy_seed_tracker.call_order.clear()
        rng._seeded_state(99)
        assert torch.cuda._lazy_seed_tracker.get_calls() == []
