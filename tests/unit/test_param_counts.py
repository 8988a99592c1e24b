"""The parameter counts of `megatron_ds.model.shapes` (per module and per spec) equal the real
modules' `numel()`, spec by spec, for several architectures, at T=1 and (megatron-core's real
tensor-parallel layers, built in one process on a fake process group) T=2."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.model import naming, shapes
from megatron_ds.model.gpt_pipe import build_layer_specs
from megatron_ds.model.tensor_parallel import NO_TENSOR_PARALLEL, TensorParallel

GPT = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    seq_length=8,
    max_position_embeddings=12,
    vocab_size=256,
)
LLAMA_GQA = dataclasses.replace(
    GPT,
    num_key_value_heads=2,
    activation="swiglu",
    use_rotary_position_embeddings=True,
    add_position_embedding=False,
    add_bias_linear=False,
    normalization="rmsnorm",
    untie_embeddings_and_output_weights=True,
)
ARCHITECTURES = {
    "gpt": GPT,
    "llama_gqa": LLAMA_GQA,
    "qkv_bias": dataclasses.replace(LLAMA_GQA, add_qkv_bias=True),  # Qwen2's layout: a bias on QKV alone
    "qwen3": dataclasses.replace(LLAMA_GQA, qk_layernorm=True),  # RMSNorm weights on q and k heads
    "qk_layernorm": dataclasses.replace(GPT, qk_layernorm=True),  # LayerNorm weights and biases on q and k heads
    "untied": dataclasses.replace(GPT, untie_embeddings_and_output_weights=True),
    "no_bias": dataclasses.replace(GPT, add_bias_linear=False),
    "rotary_no_table": dataclasses.replace(GPT, use_rotary_position_embeddings=True, add_position_embedding=False),
    "mqa_swiglu": dataclasses.replace(GPT, num_key_value_heads=2, activation="swiglu"),
    # --kv-channels other than hidden / heads: QKV (heads + 2 kv) x 12 rows, proj 48 -> 32, q/k norms over 12
    "kv_channels": dataclasses.replace(LLAMA_GQA, qk_layernorm=True, kv_channels=12),
}
REG = RegularizationConfig(hidden_dropout=0.0, attention_dropout=0.0)


def spec_modules(model: ModelConfig, tp: TensorParallel) -> list[torch.nn.Module | None]:
    """The built module of every spec (None for a plain function), as GPTModelPipe builds them."""
    return [s.build() if isinstance(s, LayerSpec) else None for s in build_layer_specs(model, REG, 1234, tp)]


def numel(module: torch.nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


@pytest.fixture(scope="module")
def two_tensor_ranks():
    """Rank 0 of a T=2 group on torch's fake backend: megatron-core cuts real shards, no peer runs."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_ds.model.tensor_parallel_layers import share_rng_tracker

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    share_rng_tracker()
    try:
        yield TensorParallel(size=2, rank=0, group=dist.new_group([0, 1]))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_spec_counts_equal_the_modules_at_t1(name: str) -> None:
    model = ARCHITECTURES[name]
    modules = spec_modules(model, NO_TENSOR_PARALLEL)
    assert [s.num_params for s in shapes.gpt_spec_params(model)] == [numel(m) for m in modules]
    assert shapes.gpt_spec_param_counts(model) == [numel(m) for m in modules]
    layer = next(m for m in modules if type(m).__name__ == "TransformerLayer")
    assert (shapes.layer_params(model).total, shapes.layer_params(model).largest) == (
        numel(layer),
        max(numel(c) for c in layer.children()),
    )
    # Unique parameters: the tied head (a second copy of the word embedding) is not counted again.
    names = naming.gpt_spec_groups(model).names
    unique = sum(numel(m) for n, m in zip(names, modules) if n != naming.TIED_LM_HEAD)
    assert shapes.total_params(model) == unique
    largest = max(numel(c) for m in modules if m is not None for c in [m, *m.children()] if not list(c.children()))
    assert shapes.largest_layer_params(model) == largest


@pytest.mark.parametrize(
    "name", ["gpt", "llama_gqa", "untied", "no_bias", "qkv_bias", "qwen3", "qk_layernorm", "kv_channels"]
)
def test_spec_counts_equal_the_shards_at_t2(name: str, two_tensor_ranks: TensorParallel) -> None:
    model = ARCHITECTURES[name]
    modules = spec_modules(model, two_tensor_ranks)
    assert [s.num_params for s in shapes.gpt_spec_params(model, 2)] == [numel(m) for m in modules]
    layer = modules[3]
    assert shapes.layer_params(model, 2).modules == tuple((n, numel(c)) for n, c in layer.named_children())
    no_decay = sum(p.numel() for n, p in layer.named_parameters() if n.endswith("bias") or "norm" in n)
    assert shapes.layer_params(model, 2).no_decay == no_decay


def test_a_model_without_a_position_table_counts_none() -> None:
    rotary = ARCHITECTURES["rotary_no_table"]
    assert shapes.total_params(GPT) - shapes.total_params(rotary) == GPT.max_position_embeddings * GPT.hidden_size
    assert shapes.position_embedding_params(rotary) == 0


def test_a_qkv_bias_alone_is_zero_and_split_with_its_rows(two_tensor_ranks: TensorParallel) -> None:
    """--add-qkv-bias under --disable-bias-linear: QKV alone has a bias, zero at init as Megatron's, and a
    tensor rank keeps its heads' rows of it (megatron-core's ColumnParallelLinear)."""
    model = ARCHITECTURES["qkv_bias"]
    for tp, rows in ((NO_TENSOR_PARALLEL, model.qkv_rows), (two_tensor_ranks, model.qkv_rows // 2)):
        layer = spec_modules(model, tp)[3]
        assert [n for n, _ in layer.named_parameters() if n.endswith("bias")] == ["qkv.bias"]
        assert layer.qkv.bias.shape == (rows,) and not layer.qkv.bias.any()
