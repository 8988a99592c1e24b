"""The compute model's matmul FLOPs equal torch's FlopCounterMode on our real modules, exactly.

FlopCounterMode counts mm/addmm/bmm (2 FLOPs per MAC; addmm's bias add is not counted, nor is any
element-wise op), so the comparison is with the model's `matmul` terms. Attention runs under
torch's math SDPA backend here: on CPU SDPA otherwise picks its flash kernel, which FlopCounterMode
does not count at all; the math backend computes the full s x s square with bmm, which is what the
model counts by default (`causal_attention=False`). No tolerance: the counts are integers and must
be equal. Element-wise terms are conventions (see compute.py) and are only checked for their size.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.estimate import memory_model
from megatron_ds.estimate.compute import (
    ComputeInputs,
    layer_terms,
    model_flops_per_iteration,
    spec_flops,
    stage_flops,
    stage_flops_for,
)
from megatron_ds.estimate.memory_inputs import MemoryInputs
from megatron_ds.estimate.stage_contents import checkpointed_chunks, recomputed_layers
from megatron_ds.model import naming
from megatron_ds.model.gpt_pipe import build_layer_specs
from megatron_ds.model.layers import cross_entropy_loss
from megatron_ds.model.transformer import TransformerLayer

BASE = ModelConfig(
    num_layers=3,
    hidden_size=64,
    num_attention_heads=8,
    ffn_hidden_size=160,
    seq_length=12,
    max_position_embeddings=16,
    vocab_size=256,
)
NO_DROPOUT = RegularizationConfig(hidden_dropout=0.0, attention_dropout=0.0)
ARCHITECTURES = {
    "gpt": BASE,
    "gqa-swiglu-rotary": dataclasses.replace(
        BASE,
        num_key_value_heads=2,
        activation="swiglu",
        use_rotary_position_embeddings=True,
        add_position_embedding=False,
        add_bias_linear=False,
        normalization="rmsnorm",
        untie_embeddings_and_output_weights=True,
    ),
    "mqa-untied": dataclasses.replace(BASE, num_key_value_heads=1, untie_embeddings_and_output_weights=True),
    "swiglu-bias-dropout": dataclasses.replace(BASE, activation="swiglu"),
}
ARCHITECTURES["kv-channels-qk-norms"] = dataclasses.replace(  # --kv-channels 12 (64 / 8 is 8): Qwen3-0.6B's kind
    ARCHITECTURES["gqa-swiglu-rotary"], kv_channels=12, qk_layernorm=True
)
REGULARIZATION = {"swiglu-bias-dropout": RegularizationConfig(hidden_dropout=0.1, attention_dropout=0.1)}


def counted(fn) -> tuple[int, int]:
    """(forward, backward) FLOPs FlopCounterMode sees for `fn()` (returns a scalar) and its backward."""
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as fwd:
            out = fn()
        with FlopCounterMode(display=False) as bwd:
            out.backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


@pytest.mark.parametrize("name", ARCHITECTURES)
@pytest.mark.parametrize("batch", [1, 3])
def test_transformer_layer_matmuls_match_flop_counter(name: str, batch: int) -> None:
    model = ARCHITECTURES[name]
    layer = TransformerLayer(model, REGULARIZATION.get(name, NO_DROPOUT), init_seed=7).train()
    x = torch.randn(batch, model.seq_length, model.hidden_size, requires_grad=True)  # as a received activation
    fwd, bwd = counted(lambda: layer(x).square().mean())
    spec = next(sp for sp in spec_flops(ComputeInputs(model, batch)) if sp.group == "body")
    assert (spec.matmul_forward, spec.matmul_backward) == (fwd, bwd)
    assert spec.matmul_backward == 2 * spec.matmul_forward


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_whole_model_matmuls_match_flop_counter(name: str) -> None:
    """All specs in order (tied or untied head), then the loss, as one pipeline stage runs them."""
    model, batch = ARCHITECTURES[name], 2
    specs = build_layer_specs(model, REGULARIZATION.get(name, NO_DROPOUT), seed=1234)
    modules = [s.build() if hasattr(s, "build") else s for s in specs]
    tokens = torch.randint(0, model.vocab_size, (batch, model.seq_length))
    labels = (torch.randint(0, model.vocab_size, (batch, model.seq_length)), torch.ones(batch, model.seq_length))

    def run() -> torch.Tensor:
        x = tokens
        for spec, module in zip(specs, modules):
            fn = getattr(spec, "forward_fn", None)
            x = fn(modules[naming.gpt_spec_groups(model).pre.index(naming.WORD_EMBEDDING)], x) if fn else module(x)
        return cross_entropy_loss(x, labels)

    fwd, bwd = counted(run)
    predicted = spec_flops(ComputeInputs(model, batch))
    assert [sp.name for sp in predicted[:-1]] == naming.gpt_spec_groups(model).names
    assert sum(sp.matmul_forward for sp in predicted) == fwd
    assert sum(sp.matmul_backward for sp in predicted) == bwd
    whole = stage_flops_for(ComputeInputs(model, batch), 0, 1, model.num_layers)
    assert (whole.matmul_forward, whole.matmul_backward) == (fwd, bwd)


def test_recomputed_layer_adds_one_forward() -> None:
    """Under DeepSpeed's activation checkpointing (what PipelineModule uses), backward reruns the
    whole forward. (torch's non-reentrant checkpoint would stop early and skip fc2.)"""
    from deepspeed.runtime.activation_checkpointing.checkpointing import checkpoint

    model = ARCHITECTURES["gqa-swiglu-rotary"]
    layer = TransformerLayer(model, NO_DROPOUT, init_seed=7)
    x = torch.randn(2, model.seq_length, model.hidden_size, requires_grad=True)
    fwd, bwd = counted(lambda: checkpoint(layer, x).square().mean())
    spec = next(sp for sp in spec_flops(ComputeInputs(model, 2)) if sp.group == "body")
    assert (fwd, bwd) == (spec.matmul_forward, spec.matmul_backward + spec.matmul_forward)


def test_paper_formula_classic_gpt() -> None:
    """Narayanan et al. 2021 eq. (3): 96 B s l h^2 (1 + s/6h + V/16lh) with recomputation; without it
    the layers take 3 passes instead of 4, i.e. 72 B s l h^2 (1 + s/6h + V/12lh)."""
    for h, heads, s, v, n, batch in ((384, 8, 128, 32000, 48, 4), (512, 8, 128, 32000, 8, 8), (64, 4, 16, 256, 3, 5)):
        m = ModelConfig(n, h, heads, 4 * h, s, s, v)
        eq3 = 96 * batch * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))
        assert model_flops_per_iteration(m, batch, recompute=True) == pytest.approx(eq3, rel=1e-12)
        no_recompute = 72 * batch * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h))
        assert model_flops_per_iteration(m, batch) == pytest.approx(no_recompute, rel=1e-12)


def megatron_lm_flops(m: ModelConfig, batch: int) -> float:
    """Megatron-LM's throughput count (megatron/training/training.py, num_floating_point_operations):
    12 B s L h^2 ((1 + g/a + s/h) q/h + f/h x (3/2 if swiglu) + V/(2Lh)), q = a x kv_channels (its
    query_projection_to_hidden_size_ratio q/h is 1 unless --kv-channels says otherwise)."""
    h, s, n = m.hidden_size, m.seq_length, m.num_layers
    gated = 1.5 if m.gated_mlp else 1.0
    kv_channels = m.kv_channels or h // m.num_attention_heads  # Megatron-LM's args.kv_channels after validate_args
    attention = (1 + m.kv_heads / m.num_attention_heads + s / h) * (m.num_attention_heads * kv_channels / h)
    return 12 * batch * s * n * h * h * (attention + m.ffn_hidden_size / h * gated + m.vocab_size / (2 * n * h))


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_model_flops_equal_megatron_lm_count(name: str) -> None:
    m = ARCHITECTURES[name]
    assert model_flops_per_iteration(m, 6) == pytest.approx(megatron_lm_flops(m, 6), rel=1e-12)


@pytest.mark.parametrize(
    ("name", "t"), [(n, t) for n, m in ARCHITECTURES.items() for t in (2, 4) if m.kv_heads % t == 0]
)
def test_tensor_parallel_ranks_share_the_work(name: str, t: int) -> None:
    """T ranks together do exactly the T=1 matmuls; replicated element-wise work (norms, residual
    adds, embeddings) is repeated on every rank. (Real megatron-core shards: tests/dist.)"""
    m = ARCHITECTURES[name]
    whole, shard = spec_flops(ComputeInputs(m, 2)), spec_flops(ComputeInputs(m, 2, tensor_parallel_size=t))
    for a, b in zip(whole, shard):
        assert b.matmul_forward * t == a.matmul_forward, a.name
        for ta, tb in zip(a.terms, b.terms):
            if ta.name in ("input norm", "post-attention norm", "residual adds", "final norm", "lookup"):
                assert tb == ta


def test_causal_attention_counts_the_triangle() -> None:
    m, b = BASE, 2
    full = {t.name: t for t in spec_flops(ComputeInputs(m, b))[3].terms}
    causal = {t.name: t for t in spec_flops(ComputeInputs(m, b, causal_attention=True))[3].terms}
    s = m.seq_length
    assert causal["scores"].forward * s * s == full["scores"].forward * s * (s + 1) // 2
    assert causal["qkv"] == full["qkv"]


WINDOWED = dataclasses.replace(
    ARCHITECTURES["gqa-swiglu-rotary"],
    seq_length=80,
    max_position_embeddings=80,
    window_size=(5, 0),
    window_attn_skip_freq=(1, 0, 1),
)
"""Sliding windows of 6 keys on layers 1 and 3 (80 tokens: three 32-row chunks), layer 2 attending fully."""


def test_windowed_layers_count_the_chunks_they_compute_and_the_band() -> None:
    """FlopCounterMode on the whole windowed model equals the per-layer counts (the chunks' scores on layers 1 and
    3, the full square on layer 2), and the stage total takes their mean layer; a causal kernel computes the same
    chunks (layer 1), the causal triangle on layer 2."""
    model, batch = WINDOWED, 2
    specs = build_layer_specs(model, NO_DROPOUT, seed=1234)
    modules = [s.build() if hasattr(s, "build") else s for s in specs]
    tokens = torch.randint(0, model.vocab_size, (batch, model.seq_length))
    labels = (torch.randint(0, model.vocab_size, (batch, model.seq_length)), torch.ones(batch, model.seq_length))

    def run() -> torch.Tensor:
        x = tokens
        for module in modules:
            x = module(x)
        return cross_entropy_loss(x, labels)

    fwd, bwd = counted(run)
    predicted = spec_flops(ComputeInputs(model, batch))
    assert (sum(sp.matmul_forward for sp in predicted), sum(sp.matmul_backward for sp in predicted)) == (fwd, bwd)
    body = [sp for sp in predicted if sp.group == "body"]
    assert body[0].matmul_forward == body[2].matmul_forward < body[1].matmul_forward
    whole = stage_flops_for(ComputeInputs(model, batch), 0, 1, model.num_layers)
    assert abs(whole.matmul_forward - fwd) < model.num_layers  # the mean layer's floor, times three
    s, hd, heads = model.seq_length, model.head_dim, model.num_attention_heads
    causal = [sp for sp in spec_flops(ComputeInputs(model, batch, causal_attention=True)) if sp.group == "body"]
    scores = [next(t.forward for t in sp.terms if t.name == "scores") for sp in causal]
    assert scores[0] == next(t.forward for t in body[0].terms if t.name == "scores")
    assert scores[1] == 2 * batch * heads * hd * s * (s + 1) // 2


def test_elementwise_terms_are_small_at_benchmark_sizes() -> None:
    for m in (ModelConfig(48, 384, 8, 1536, 128, 128, 32000), ModelConfig(8, 512, 8, 2048, 128, 128, 32000)):
        for sp in spec_flops(ComputeInputs(m, 1)):
            if sp.matmul_forward:
                assert sp.forward - sp.matmul_forward < 0.02 * sp.matmul_forward, sp


def test_checkpointed_chunks_follow_deepspeeds_chunking_rule() -> None:
    """The closed form against the rule itself: cut the stage's functions into chunks of `interval` from local index
    0; a chunk of transformer layers only is recomputed. Both estimates use it (`recomputed_layers` and the memory
    model's `_recomputed`)."""
    for interval, pre, post, layers in itertools.product(range(0, 7), range(0, 5), range(0, 4), range(0, 40)):
        kinds = [False] * pre + [True] * layers + [False] * post
        chunks = [kinds[i : i + interval] for i in range(0, len(kinds), interval)] if interval else []
        recomputed = [len(c) for c in chunks if all(c)]
        want = (sum(recomputed), max(recomputed, default=0))
        assert checkpointed_chunks(pre, layers, post, interval) == want, (interval, pre, layers, post)
        assert recomputed_layers(pre, layers, post, interval) == want[0]
    m = BASE
    mem = MemoryInputs(m, 1, 4, checkpoint_activations=True, checkpoint_num_layers=2, device="cpu")
    assert memory_model._recomputed(mem, 3, 5, 0) == (1, 2)  # chunks [x x][x t][t t][t t]: 4 layers recomputed


def test_stage_flops_place_pre_post_and_recompute() -> None:
    m = dataclasses.replace(BASE, num_layers=6)
    inputs = ComputeInputs(m, 2, checkpoint_activations=True, checkpoint_num_layers=2)
    stages = stage_flops(inputs, [1, 3, 2])
    specs = spec_flops(inputs)
    layer = next(sp for sp in specs if sp.group == "body")
    head = next(sp for sp in specs if sp.name == naming.TIED_LM_HEAD)
    assert stages[1].forward == 3 * layer.forward
    assert stages[1].recompute == 3 * layer.forward  # chunks [t t][t]: a short last chunk is recomputed too
    assert stages[0].recompute == 0  # chunks [cast emb][pos t]: never all transformer layers
    assert stages[2].recompute == 2 * layer.forward  # [t t][norm head][fp32]
    assert stages[2].forward == 2 * layer.forward + sum(sp.forward for sp in specs if sp.group in ("post", "loss"))
    assert stages[2].matmul_forward == 2 * layer.matmul_forward + head.matmul_forward
    assert stages[0].forward == sum(sp.forward for sp in specs if sp.group == "pre") + layer.forward
    assert stages[0].backward == sum(sp.backward for sp in specs if sp.group == "pre") + layer.backward


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="divisible"):
        ComputeInputs(BASE, 1, tensor_parallel_size=3)
    with pytest.raises(ValueError, match=">= 1"):
        ComputeInputs(BASE, 0)


def test_a_qkv_bias_alone_adds_only_its_rows() -> None:
    """--add-qkv-bias under --disable-bias-linear: the bias adds are the QKV output features', at T=1 and 2."""
    model = dataclasses.replace(ARCHITECTURES["gqa-swiglu-rotary"], add_qkv_bias=True)
    for t in (1, 2):
        terms = {term.name: term for term in layer_terms(ComputeInputs(model, 2, tensor_parallel_size=t))}
        bare = {term.name for term in layer_terms(ComputeInputs(ARCHITECTURES["gqa-swiglu-rotary"], 2))}
        assert "bias adds" in terms and "bias adds" not in bare
        assert terms["bias adds"].forward == 2 * model.seq_length * model.qkv_rows // t


def test_query_and_key_norms_count_their_heads() -> None:
    """--qk-layernorm: RMSNorm's 4 FLOPs per element of this rank's query and key heads, at T=1 and 2."""
    model = dataclasses.replace(ARCHITECTURES["gqa-swiglu-rotary"], normalization="rmsnorm", qk_layernorm=True)
    for t in (1, 2):
        terms = {term.name: term for term in layer_terms(ComputeInputs(model, 2, tensor_parallel_size=t))}
        heads = (model.num_attention_heads + model.kv_heads) // t
        assert terms["query and key norms"].forward == 4 * 2 * model.seq_length * heads * model.head_dim
    bare = layer_terms(ComputeInputs(dataclasses.replace(model, qk_layernorm=False), 2))
    assert "query and key norms" not in {term.name for term in bare}
