"""Architecture options (GQA, RoPE, SwiGLU, no linear biases, no position embedding), no process group.

Each option is checked against a direct formula, and its tensor-parallel layout is checked by
simulating T ranks in one process (as `test_tensor_parallel_init.py` does for the default layer).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.flags.parser import ConfigError, parse_config
from megatron_ds.model import naming, norms, shapes
from megatron_ds.model.init import gather_fused, gather_qkv, shard, shard_fused, shard_qkv
from megatron_ds.model.layers import EmbeddingDropout, FinalNorm, LMHead, PositionEmbedding, WordEmbedding
from megatron_ds.model.rotary import apply_rotary, rotary_angles
from megatron_ds.model.transformer import TransformerLayer
from megatron_ds.training.optimizer import add_group_placeholders, param_groups

BASE = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    seq_length=8,
    max_position_embeddings=8,
    vocab_size=128,
)
NO_DROPOUT = RegularizationConfig(hidden_dropout=0.0, attention_dropout=0.0)
LLAMA = dataclasses.replace(
    BASE,
    num_key_value_heads=2,
    activation="swiglu",
    use_rotary_position_embeddings=True,
    add_position_embedding=False,
    add_bias_linear=False,
    normalization="rmsnorm",
    untie_embeddings_and_output_weights=True,
)
SEED = 1234 * 1_000_003 + 3


def model(**changes) -> ModelConfig:
    return dataclasses.replace(BASE, **changes)


def perturbed(layer: TransformerLayer) -> TransformerLayer:
    """Non-zero biases and norm weights, so their handling is exercised too."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    return layer.eval()


# --- RoPE ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_rotary_matches_the_direct_formula(base: float) -> None:
    b, heads, s, hd = 2, 3, 7, 8
    x = torch.randn(b, heads, s, hd, dtype=torch.float64)
    got = apply_rotary(x, rotary_angles(s, hd, x.device, base).double())
    want = torch.empty_like(x)
    for pos in range(s):
        for i in range(hd // 2):
            angle = pos * base ** (-2.0 * i / hd)
            a, c = x[..., pos, i], x[..., pos, i + hd // 2]  # the rotated pair (rotate-half convention)
            want[..., pos, i] = a * math.cos(angle) - c * math.sin(angle)
            want[..., pos, i + hd // 2] = c * math.cos(angle) + a * math.sin(angle)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # angles are computed in fp32


def test_rotary_scores_depend_on_relative_position_only() -> None:
    hd = 8
    q, k = torch.randn(hd), torch.randn(hd)
    angles = rotary_angles(12, hd, torch.device("cpu"), 10000.0)
    rq = apply_rotary(q.expand(1, 1, 12, hd), angles)[0, 0]
    rk = apply_rotary(k.expand(1, 1, 12, hd), angles)[0, 0]
    torch.testing.assert_close(rq[5] @ rk[3], rq[9] @ rk[7], rtol=0, atol=1e-5)
    torch.testing.assert_close(rq[0], q)  # position 0 is not rotated


def test_rotary_changes_the_layer_and_position_embedding_goes() -> None:
    x = torch.randn(2, BASE.seq_length, BASE.hidden_size)
    plain, rope = (
        TransformerLayer(BASE, NO_DROPOUT, SEED).eval(),
        TransformerLayer(model(use_rotary_position_embeddings=True), NO_DROPOUT, SEED).eval(),
    )
    assert not torch.allclose(plain(x), rope(x))
    llama3 = TransformerLayer(model(use_rotary_position_embeddings=True, rotary_base=500000.0), NO_DROPOUT, SEED)
    assert not torch.allclose(rope(x), llama3.eval()(x))  # the base reaches the attention
    groups = naming.gpt_spec_groups(model(use_rotary_position_embeddings=True, add_position_embedding=False))
    assert groups.pre == (naming.CAST_INPUTS, naming.WORD_EMBEDDING, naming.EMBEDDING_DROPOUT)
    assert groups.num_specs == naming.gpt_spec_groups(BASE).num_specs  # one checkpoint file per spec index
    dropout = EmbeddingDropout(BASE, RegularizationConfig(hidden_dropout=0.5), SEED)
    assert list(dropout.parameters()) == [] and torch.equal(dropout.eval()(x), x)


# --- GQA -------------------------------------------------------------------------------------------


@torch.no_grad()
def test_gqa_with_one_kv_head_per_query_head_is_multi_head_attention() -> None:
    mha, gqa = (
        TransformerLayer(BASE, NO_DROPOUT, SEED),
        TransformerLayer(model(num_key_value_heads=4), NO_DROPOUT, SEED),
    )
    for (name, p), q in zip(mha.named_parameters(), gqa.parameters()):
        assert torch.equal(p, q), name
    x = torch.randn(2, BASE.seq_length, BASE.hidden_size)
    assert torch.equal(mha.eval()(x), gqa.eval()(x))


@torch.no_grad()
def test_gqa_equals_multi_head_attention_with_kv_heads_repeated_per_group() -> None:
    cfg = model(num_key_value_heads=2, use_rotary_position_embeddings=True)
    gqa = perturbed(TransformerLayer(cfg, NO_DROPOUT, SEED))
    h, nh, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads
    hd = h // nh
    assert gqa.qkv.weight.shape == ((nh + 2 * kv) * hd, h)
    mha = TransformerLayer(model(use_rotary_position_embeddings=True), NO_DROPOUT, SEED).eval()
    mha.load_state_dict(
        {
            **gqa.state_dict(),
            "qkv.weight": _repeat_kv(gqa.qkv.weight, nh, kv, hd),
            "qkv.bias": _repeat_kv(gqa.qkv.bias, nh, kv, hd),
        }
    )
    x = torch.randn(2, cfg.seq_length, h)
    torch.testing.assert_close(gqa(x), mha(x), rtol=0, atol=1e-6)


def _repeat_kv(fused: torch.Tensor, nh: int, kv: int, hd: int) -> torch.Tensor:
    q, k, v = fused.split([nh * hd, kv * hd, kv * hd])
    # query head i reads kv head i // (nh / kv): repeat each kv head nh / kv times in place
    return torch.cat(
        [
            q,
            *(
                t.reshape(kv, hd, *t.shape[1:]).repeat_interleave(nh // kv, 0).reshape(nh * hd, *t.shape[1:])
                for t in (k, v)
            ),
        ]
    )


# --- SwiGLU and biases -----------------------------------------------------------------------------


@torch.no_grad()
def test_swiglu_shapes_and_formula() -> None:
    cfg = model(activation="swiglu")
    layer = perturbed(TransformerLayer(cfg, NO_DROPOUT, SEED))
    f, h = cfg.ffn_hidden_size, cfg.hidden_size
    assert layer.fc1.weight.shape == (2 * f, h) and layer.fc1.bias.shape == (2 * f,)
    assert layer.fc2.weight.shape == (h, f)
    x = torch.randn(2, cfg.seq_length, h)
    inner = layer.fc1(x)
    torch.testing.assert_close(layer.activation(inner), F.silu(inner[..., :f]) * inner[..., f:], rtol=0, atol=0)
    assert layer(x).shape == x.shape


@pytest.mark.parametrize("norm", norms.REGISTRY)
def test_no_linear_biases_keeps_norm_biases_and_the_no_decay_group(norm: str) -> None:
    layer = TransformerLayer(model(add_bias_linear=False, normalization=norm), NO_DROPOUT, SEED)
    for linear in (layer.qkv, layer.proj, layer.fc1, layer.fc2):
        assert linear.bias is None
    assert add_group_placeholders(layer) == []  # norm weights keep no_decay non-empty
    groups = {g["name"]: g["params"] for g in param_groups(layer, 0.1)}
    no_decay = 2 * len(norms.find(norm).stored_keys)  # two norms' weights (and biases: 4 with LayerNorm)
    assert len(groups["no_decay"]) == no_decay and len(groups["decay"]) == 4


@pytest.mark.parametrize(
    "cfg",
    [
        BASE,
        model(activation="swiglu"),
        model(num_key_value_heads=2),
        model(num_key_value_heads=1),
        model(add_bias_linear=False),
        model(add_position_embedding=False),
        *(model(normalization=norm) for norm in norms.REGISTRY),
        LLAMA,
    ],
)
def test_param_counts_match_the_modules(cfg: ModelConfig) -> None:
    reg = NO_DROPOUT
    position = PositionEmbedding(cfg, reg, 2) if cfg.add_position_embedding else EmbeddingDropout(cfg, reg, 2)
    head = LMHead(cfg, reg, 9) if cfg.untie_embeddings_and_output_weights else WordEmbedding(cfg, reg, 1)
    modules = [
        None,
        WordEmbedding(cfg, reg, 1),
        position,
        *[TransformerLayer(cfg, reg, 3 + i) for i in range(cfg.num_layers)],
        FinalNorm(cfg, 8),
        head,
        None,
    ]
    expected = [0 if m is None else sum(p.numel() for p in m.parameters()) for m in modules]
    assert shapes.gpt_spec_param_counts(cfg) == expected


def test_default_counts_unchanged() -> None:
    h, f = BASE.hidden_size, BASE.ffn_hidden_size
    layer = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
    assert shapes.layer_params(BASE).total == layer


# --- tensor-parallel layouts -----------------------------------------------------------------------


@pytest.mark.parametrize("t,kv", [(1, 1), (1, 2), (2, 2), (2, 4), (4, 4)])
def test_qkv_shards_hold_their_heads_and_groups(t: int, kv: int) -> None:
    nh, hd, h = 4, 8, 32
    full = torch.randn((nh + 2 * kv) * hd, h)
    shards = [shard_qkv(full, nh, t, r, num_kv_heads=kv) for r in range(t)]
    assert torch.equal(gather_qkv(shards, nh, num_kv_heads=kv), full)
    q_rows, kv_rows = nh * hd, kv * hd
    for r, s in enumerate(shards):
        q_heads = range(r * nh // t, (r + 1) * nh // t)
        kv_heads = range(r * kv // t, (r + 1) * kv // t)
        assert {i // (nh // kv) for i in q_heads} == set(kv_heads)  # the rank holds its groups' kv heads
        expected = torch.cat(
            [full[i * hd : (i + 1) * hd] for i in q_heads]
            + [full[q_rows + i * hd : q_rows + (i + 1) * hd] for i in kv_heads]
            + [full[q_rows + kv_rows + i * hd : q_rows + kv_rows + (i + 1) * hd] for i in kv_heads]
        )
        assert torch.equal(s, expected)


def test_swiglu_fc1_shards_hold_matching_halves() -> None:
    f, h, t = 8, 4, 2
    full = torch.arange(2 * f * h, dtype=torch.float32).reshape(2 * f, h)
    shards = [shard_fused(full, (f, f), t, r) for r in range(t)]
    assert torch.equal(shards[1], torch.cat([full[f // 2 : f], full[f + f // 2 :]]))
    assert torch.equal(gather_fused(shards, (f, f)), full)


def _simulated_forward(layer: TransformerLayer, cfg: ModelConfig, x: torch.Tensor, t: int) -> torch.Tensor:
    """What T ranks compute from shards of `layer`'s (T=1) weights, summed as the all-reduces would."""

    def bias_of(linear, cut):
        return None if linear.bias is None else cut(linear.bias)

    f = cfg.ffn_hidden_size
    normed = layer.input_norm(x)
    attn = sum(_rank_attention(layer, cfg, normed, t, r) for r in range(t))
    x = x + attn + (0 if layer.proj.bias is None else layer.proj.bias)
    normed = layer.post_attention_norm(x)
    fused = (f, f) if cfg.gated_mlp else (f,)
    mlp = 0
    for r in range(t):
        inner = F.linear(
            normed,
            shard_fused(layer.fc1.weight, fused, t, r),
            bias_of(layer.fc1, lambda b: shard_fused(b, fused, t, r)),  # noqa: B023 - called at once
        )
        mlp = mlp + F.linear(layer.activation(inner), shard(layer.fc2.weight, 1, t, r))
    return x + mlp + (0 if layer.fc2.bias is None else layer.fc2.bias)


def _rank_attention(layer: TransformerLayer, cfg: ModelConfig, normed: torch.Tensor, t: int, r: int) -> torch.Tensor:
    from megatron_ds.model.tensor_parallel import TensorParallel

    nh, kv = cfg.num_attention_heads, cfg.kv_heads
    local = TransformerLayer(cfg, NO_DROPOUT, SEED, TensorParallel(size=1)).eval()  # reuse the forward with local sizes
    local.num_local_heads, local.num_local_kv_heads = nh // t, kv // t
    local.qkv = torch.nn.Linear(cfg.hidden_size, 1, bias=layer.qkv.bias is not None)
    local.qkv.weight = torch.nn.Parameter(shard_qkv(layer.qkv.weight, nh, t, r, num_kv_heads=kv))
    if layer.qkv.bias is not None:
        local.qkv.bias = torch.nn.Parameter(shard_qkv(layer.qkv.bias, nh, t, r, num_kv_heads=kv))
    local.proj = torch.nn.Linear(1, cfg.hidden_size, bias=False)
    local.proj.weight = torch.nn.Parameter(shard(layer.proj.weight, 1, t, r))
    return local._attention(normed)


@pytest.mark.parametrize(
    "cfg",
    [
        model(num_key_value_heads=2),
        model(activation="swiglu"),
        model(add_bias_linear=False),
        model(use_rotary_position_embeddings=True),
        LLAMA,
        dataclasses.replace(LLAMA, add_qkv_bias=True),
    ],
    ids=["gqa", "swiglu", "no_bias", "rope", "llama", "qkv_bias"],
)
@pytest.mark.parametrize("t", [2])
@torch.no_grad()
def test_sharded_layer_computes_the_t1_layer(cfg: ModelConfig, t: int) -> None:
    layer = perturbed(TransformerLayer(cfg, NO_DROPOUT, SEED))
    x = torch.randn(2, cfg.seq_length, cfg.hidden_size)
    torch.testing.assert_close(_simulated_forward(layer, cfg, x, t), layer(x), rtol=0, atol=1e-6)


# --- validation ------------------------------------------------------------------------------------


def test_tensor_parallel_size_must_divide_kv_heads() -> None:
    argv = [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--vocab-size",
        "1000",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--train-iters",
        "10",
        "--lr",
        "1e-3",
        "--num-key-value-heads",
        "2",
    ]
    with pytest.raises(ConfigError, match="--num-key-value-heads 2 is not divisible by --tensor-model-parallel-size 4"):
        parse_config([*argv, "--tensor-model-parallel-size", "4"], world_size=4)
    assert parse_config([*argv, "--tensor-model-parallel-size", "2"], world_size=2)[0].model.kv_heads == 2
