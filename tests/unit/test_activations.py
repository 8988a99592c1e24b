"""The MLP activation registry, Megatron's GeLU flags, the rotary base flag, and old checkpoints."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from megatron_ds.config import Config
from megatron_ds.errors import ConfigError
from megatron_ds.estimate.compute import ComputeInputs, layer_terms
from megatron_ds.flags.parser import parse_config
from megatron_ds.model import activations
from megatron_ds.testing.scenario import tiny_config
from megatron_ds.training.checkpoint.rules import architecture_mismatch

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
BASE += ["--vocab-size", "128", "--train-iters", "1", "--lr", "1e-3"]
ROTARY = ["--use-rotary-position-embeddings"]


def model(*argv: str):
    return parse_config([*BASE, *argv], world_size=1)[0].model


def test_tanh_gelu_is_megatrons_fused_bias_gelu_forward_and_backward() -> None:
    """megatron-core's `bias_gelu_impl` (Megatron-DeepSpeed's is the same code) against our default, in
    float64 so that only its rounded constants (0.79788456 for sqrt(2/pi)) separate the two."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(16, dtype=torch.float64, generator=gen, requires_grad=True)
    theirs, ours = bias_gelu_impl(x, bias), activations.find("gelu_tanh").function(x + bias)  # eager: conftest.py
    grad = torch.randn(theirs.shape, dtype=torch.float64, generator=gen)
    for a, b in zip(torch.autograd.grad(theirs, (x, bias), grad), torch.autograd.grad(ours, (x, bias), grad)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(theirs, ours, rtol=1e-8, atol=1e-8)
    exact = activations.find("gelu").function(x + bias)
    torch.testing.assert_close(exact, torch.nn.functional.gelu(x + bias), rtol=0, atol=0)
    assert (exact - ours).abs().max() > 1e-4  # the two GeLUs are different functions


def test_hugging_face_names_compute_the_same_function() -> None:
    transformers = pytest.importorskip("transformers")
    x = torch.randn(4096)
    for entry in activations.REGISTRY.values():
        ours = entry.function(torch.cat([x, x], -1) if entry.gated else x)
        for name in entry.hf_names:
            act = transformers.activations.ACT2FN[name]
            theirs = act(x) * x if entry.gated else act(x)  # Llama: act(gate) * up
            torch.testing.assert_close(
                ours, theirs, rtol=1e-6, atol=1e-6, msg=f"{entry.name} vs {name}"
            )  # rounding only


@pytest.mark.parametrize(
    "flags,activation",
    [
        ([], "gelu_tanh"),  # Megatron-DeepSpeed's default: the fused bias-GeLU, a tanh GeLU
        (["--no-bias-gelu-fusion"], "gelu"),
        (["--disable-bias-linear"], "gelu"),  # Megatron turns the fusion off without biases
        (["--openai-gelu"], "gelu_tanh"),
        (["--openai-gelu", "--no-bias-gelu-fusion"], "gelu_tanh"),
        (["--openai-gelu", "--disable-bias-linear"], "gelu_tanh"),
        (["--swiglu", "--ffn-hidden-size", "48"], "swiglu"),
        (["--swiglu", "--ffn-hidden-size", "48", "--no-bias-gelu-fusion"], "swiglu"),
        (["--squared-relu"], "squared_relu"),  # as Megatron-DeepSpeed's ParallelMLP: torch.pow(F.relu(x), 2)
        (["--squared-relu", "--disable-bias-linear", "--no-bias-gelu-fusion"], "squared_relu"),
    ],
)
def test_megatron_flags_select_the_activation(flags: list[str], activation: str) -> None:
    assert model(*flags).activation == activation


@pytest.mark.parametrize("hidden,swiglu_ffn", [(32, 64), (4096, 10880), (5120, 13632), (8192, 21824)])
def test_swiglu_without_ffn_hidden_size_takes_upstreams_width(hidden: int, swiglu_ffn: int) -> None:
    """Megatron-DeepSpeed's and Megatron-LM's arguments.py: with --swiglu and no --ffn-hidden-size,
    int((4 * h * 2 / 3) / 64) * 64 (the figures here written out by hand); 4h otherwise. It was 4h with
    --swiglu too: a launch line without the flag trained a 1.5x wider MLP than upstream's."""
    sizes = ["--hidden-size", str(hidden), "--num-attention-heads", "4"]
    assert model(*sizes, "--swiglu").ffn_hidden_size == swiglu_ffn
    assert model(*sizes).ffn_hidden_size == 4 * hidden
    assert model(*sizes, "--swiglu", "--ffn-hidden-size", "96").ffn_hidden_size == 96


def test_megatron_lms_norm_epsilon_is_the_layernorm_epsilon() -> None:
    """megatron-core's TransformerConfig exposes `layernorm_epsilon` as --norm-epsilon (arg_names)."""
    assert model("--norm-epsilon", "1e-6").layernorm_epsilon == 1e-6
    assert model("--layernorm-epsilon", "1e-6").layernorm_epsilon == 1e-6
    assert model().layernorm_epsilon == 1e-5


def test_openai_gelu_with_swiglu_is_refused() -> None:
    with pytest.raises(ConfigError, match=re.escape("--openai-gelu and --swiglu were both given")):
        model("--openai-gelu", "--swiglu")


@pytest.mark.parametrize("other", ["--swiglu", "--openai-gelu"])
def test_squared_relu_with_another_activation_is_refused(other: str) -> None:
    """Megatron-DeepSpeed would silently take the other one, Megatron-LM asserts: one line naming both."""
    with pytest.raises(ConfigError, match=re.escape(f"--squared-relu and {other} were both given")):
        model("--squared-relu", other)


def test_squared_relu_is_upstreams_function_forward_and_backward() -> None:
    """Megatron-DeepSpeed's torch.pow(F.relu(x), 2) and transformers' relu2 (ReLUSquaredActivation)."""
    x = torch.randn(4000, dtype=torch.float64, requires_grad=True)
    ours = activations.find("squared_relu").function(x)
    theirs = torch.pow(torch.nn.functional.relu(x), 2)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    (g_ours,) = torch.autograd.grad(ours.sum(), x)
    (g_theirs,) = torch.autograd.grad(theirs.sum(), x)
    torch.testing.assert_close(g_ours, g_theirs, rtol=0, atol=0)


def test_rotary_base_flag_and_its_megatron_deepspeed_name(capsys: pytest.CaptureFixture) -> None:
    assert model(*ROTARY).rotary_base == 10000.0
    assert model(*ROTARY, "--rotary-base", "500000").rotary_base == 500000.0
    assert model(*ROTARY, "--rotary-position-embeddings-theta", "1000000").rotary_base == 1e6
    assert model("--rotary-base", "500000").rotary_base == 10000.0  # no rotary embeddings: the same model
    assert "--rotary-base 500000 only applies with --use-rotary-position-embeddings" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--rotary-base -1.0 must be > 0"):
        model(*ROTARY, "--rotary-base", "-1")


def test_checkpoints_record_the_activation_and_a_resume_names_a_different_one() -> None:
    now = tiny_config(model__use_rotary_position_embeddings=True, model__rotary_base=500000.0)
    assert Config.from_dict(now.to_dict()) == now
    old = now.to_dict()
    old["model"].update(activation="gelu", rotary_base=10000.0)
    assert Config.from_dict(old).model.activation == "gelu"
    # Resuming a checkpoint of the exact GeLU with today's default (tanh GeLU) names the difference.
    # (another rotary base shapes no weight: a resume prints it, rules.weight_free_notice)
    assert architecture_mismatch({"config": old}, now) == ["activation 'gelu' (checkpoint) vs 'gelu_tanh' (now)"]


def test_compute_model_draws_the_activation_from_the_registry() -> None:
    def elementwise(activation: str) -> dict[str, int]:
        m = tiny_config(model__activation=activation).model
        return {t.name: t.forward for t in layer_terms(ComputeInputs(m, micro_batch_size=2))}

    n, f = 2 * 16, 64  # tokens, ffn features of tiny_config
    assert elementwise("gelu")["gelu"] == elementwise("gelu_tanh")["gelu_tanh"] == n * f
    assert elementwise("swiglu")["swiglu"] == 2 * n * f  # silu and the product
    assert elementwise("swiglu")["fc1"] == 2 * elementwise("gelu")["fc1"]


def test_activation_flags_select_their_activation_whatever_else_is_given() -> None:
    """What the Hugging Face import writes (`ACTIVATION_FLAGS`) holds against any other GeLU flag."""
    import argparse
    import itertools

    from megatron_ds.flags.to_model_config import ACTIVATION_FLAGS, model_activation

    dests = ("swiglu", "squared_relu", "openai_gelu", "bias_gelu_fusion", "add_bias_linear")
    assert set(ACTIVATION_FLAGS) == set(activations.REGISTRY)
    for name, fixed in ACTIVATION_FLAGS.items():
        for values in itertools.product((False, True), repeat=len(dests)):
            args = argparse.Namespace(**{**dict(zip(dests, values)), **fixed})
            assert model_activation(args) == name, (name, args)
