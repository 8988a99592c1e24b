"""The norm registry: every entry against the real modules (parameters, stored keys, Hugging Face's own
norm) and every reader drawn from it (the files adding a norm touches: tests/unit/test_where_to_change.py)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ds.config import NORMALIZATIONS, ModelConfig, RegularizationConfig
from megatron_ds.estimate import activation_memory
from megatron_ds.estimate.activation_kernels import kernels
from megatron_ds.estimate.compute import ComputeInputs, layer_terms, spec_flops
from megatron_ds.flags.parser import parse_config
from megatron_ds.flags.registry import BY_NAME
from megatron_ds.model import naming, norms, shapes, sharding
from megatron_ds.model.layers import FinalNorm, make_norm
from megatron_ds.model.transformer import TransformerLayer

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_ds"

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    seq_length=8,
    max_position_embeddings=8,
    vocab_size=128,
)
NAMES = list(norms.REGISTRY)


def test_the_registry_is_the_configs_names_and_loads_no_torch() -> None:
    assert tuple(norms.REGISTRY) == NORMALIZATIONS
    code = "import sys, megatron_ds.model.norms; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- each entry against its module -----------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_entry_describes_its_module(name: str) -> None:
    norm, h = norms.find(name), MODEL.hidden_size
    module = norm.module(h, 1e-3)
    state = module.state_dict()
    assert tuple(state) == norm.stored_keys
    assert all(t.shape == (h,) for t in state.values())
    assert sum(p.numel() for p in module.parameters()) == norm.params_per_hidden * h
    assert module.eps == 1e-3
    x = torch.randn(2, 3, h)
    assert module(x).shape == x.shape
    # Weights start at 1 (0 when stored zero-centred) and biases at 0 (FinalNorm draws nothing from its seed).
    one = torch.zeros(h) if norm.zero_centered_gamma else torch.ones(h)
    assert all(torch.equal(t, one if k == "weight" else torch.zeros(h)) for k, t in state.items())


@pytest.mark.parametrize("name", NAMES)
def test_flops_follow_deepspeeds_profiler(name: str) -> None:
    from deepspeed.profiling.flops_profiler.profiler import _layer_norm_flops_compute

    norm, h = norms.find(name), MODEL.hidden_size
    module, x = norm.module(h, 1e-5), torch.randn(2, 3, h)
    per_element = _layer_norm_flops_compute(x, [h], module.weight)[0] // x.numel()
    if isinstance(module, torch.nn.LayerNorm):
        assert norm.forward_flops == per_element
    elif isinstance(module, torch.nn.RMSNorm):  # DeepSpeed counts no rms_norm: layer_norm's without the mean
        assert norm.forward_flops == per_element - 1


@pytest.mark.parametrize("name", NAMES)
def test_saved_statistics_are_what_the_kernel_keeps(name: str) -> None:
    """Per-token tensors the norm keeps for backward besides its input: measured with autograd's
    saved-tensor hooks for LayerNorm; for RMSNorm the fused kernel's (`aten._fused_rms_norm` returns
    the output and rstd, and its backward reads input, rstd and weight), because torch's CPU
    RMSNorm runs a composite form that keeps more (the memory model counts the fused one)."""
    norm, (b, s, h) = norms.find(name), (3, 5, MODEL.hidden_size)
    module, x = norm.module(h, 1e-5), torch.randn(b, s, h, requires_grad=True)
    if isinstance(module, torch.nn.RMSNorm):
        stats = list(torch.ops.aten._fused_rms_norm(x, [h], module.weight, 1e-5)[1:])
    else:
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            module(x)
        stats = [t for t in saved if t.shape != x.shape and t.dim() == x.dim()]  # not the input, not the weights
    assert len(stats) == norm.saved_statistics and all(t.shape == (b, s, 1) for t in stats)


@pytest.mark.parametrize("name", NAMES)
def test_hugging_face_norm_computes_ours(name: str) -> None:
    transformers = pytest.importorskip("transformers")
    norm, h = norms.find(name), MODEL.hidden_size
    for model_type in norm.hf_model_types:
        config = transformers.AutoConfig.for_model(
            model_type,
            hidden_size=h,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=64,
            vocab_size=64,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
        hf_model = transformers.AutoModelForCausalLM.from_config(config)
        norms_of = [m for m in hf_model.modules() if type(m).__name__.endswith("Norm")]
        theirs = [m for m in norms_of if m.weight.shape == (h,)]  # Qwen3's q/k norms over its head_dim aside
        assert len({type(m) for m in theirs}) == 1 and len(theirs) == 3, (model_type, theirs)  # 2 per block + final
        hf_norm = theirs[0]
        with torch.no_grad():
            for p in hf_norm.parameters():
                p.add_(0.1 * torch.randn(p.shape))
        ours = norm.module(h, getattr(hf_norm, "eps", None) or hf_norm.variance_epsilon)
        ours.load_state_dict(hf_norm.state_dict())  # strict: the same keys and shapes
        x = torch.randn(2, 5, h)
        torch.testing.assert_close(ours(x), hf_norm(x), rtol=1e-6, atol=1e-6, msg=f"{name} vs {model_type}")


# --- every reader follows the entry ----------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_readers_follow_the_entry(name: str) -> None:
    model, norm = dataclasses.replace(MODEL, normalization=name), norms.find(name)
    h, n = model.hidden_size, 3 * model.seq_length  # n tokens of a micro-batch of 3
    assert shapes.norm_params(model) == sum(p.numel() for p in make_norm(model).parameters())
    assert isinstance(make_norm(model), type(norm.module(h, 1e-5)))
    layer = TransformerLayer(model, RegularizationConfig(), 1)
    assert layer.input_norm.eps == model.layernorm_epsilon
    norm_keys = {f"{m}.{k}" for m in ("input_norm", "post_attention_norm") for k in norm.stored_keys}
    assert {k for k in layer.state_dict() if "norm" in k} == norm_keys
    assert {k for k in sharding.spec_tensors(model, naming.TRANSFORMER_LAYER) if "norm" in k} == norm_keys
    final_keys = set(FinalNorm(model, 0).state_dict())
    assert final_keys == set(sharding.spec_tensors(model, naming.FINAL_NORM)) == {f"norm.{k}" for k in norm.stored_keys}
    terms = {t.name: t for t in layer_terms(ComputeInputs(model, 3))}
    assert terms["input norm"].forward == terms["post-attention norm"].forward == norm.forward_flops * n * h
    final = next(s for s in spec_flops(ComputeInputs(model, 3)) if s.name == naming.FINAL_NORM)
    assert sum(t.forward for t in final.terms) == norm.forward_flops * n * h
    k = kernels("bf16", "cuda", 0.0)
    saved = activation_memory.transformer_layer_terms(model, 3, k, regularization=RegularizationConfig())
    assert saved["norm statistics"] == 2 * norm.saved_statistics * n * k.stat


@pytest.mark.parametrize("name", NAMES)
def test_every_norm_is_a_flag_choice(name: str) -> None:
    flag = BY_NAME["--normalization"]
    assert flag.choices == norms.FLAG_SPELLINGS and set(norms.REGISTRY) <= set(flag.choices)
    assert f"`{name}`" in flag.help
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
    argv += ["--vocab-size", "128", "--train-iters", "1", "--lr", "1e-3", "--normalization", name]
    assert parse_config(argv, world_size=1)[0].model.normalization == name
