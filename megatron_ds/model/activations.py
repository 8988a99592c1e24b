"""The MLP activations: one registry entry each (`REGISTRY`), read by the layer, the memory and
compute models and the Hugging Face mapping.

`ModelConfig.activation` names an entry; `megatron_ds.flags.to_model_config.model_activation` maps Megatron's
flags onto it (`--swiglu`, `--openai-gelu`, `--no-bias-gelu-fusion`, `--disable-bias-linear`).
The names and the gated entries are repeated in `megatron_ds.config.model` (ACTIVATIONS,
GATED_ACTIVATIONS: the config layer sits below torch and needs them for its checks and weight
shapes); this module checks on import that the two agree.

To add an activation: its name in `config.model.ACTIVATIONS` (and GATED_ACTIVATIONS if fc1 is
gate + up), one `Activation` here, the flag that selects it in `flags.to_model_config.model_activation` and
`ACTIVATION_FLAGS`; its saved elements are checked against autograd by tests/unit/test_memory_model.py.

Importing this module loads no torch (the functions import it when called): the memory and compute
models and the planner read the registry without torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_ds.config.model import ACTIVATIONS, GATED_ACTIVATIONS

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Activation:
    """One MLP activation: act(fc1 output) feeds fc2."""

    name: str
    summary: str
    function: Callable[[torch.Tensor], torch.Tensor]
    """(..., fc1 features) -> (..., ffn features); a gated one halves the last dimension."""
    gated: bool
    """fc1 produces a gate and an up half (2 x ffn features), each tensor rank its block of both."""
    hf_names: tuple[str, ...]
    """Hugging Face's names for the same function (GPT-2's `activation_function`, Llama's `hidden_act`
    for the gate); the first is written on export, any is read on import."""
    elementwise_flops: int
    """Forward FLOPs per token and ffn feature, DeepSpeed flops-profiler convention (gelu, silu, mul: 1
    per element; the tanh form counts as gelu does there)."""
    saved_features: int
    """Elements per token and ffn feature that autograd saves for backward: GeLU its input; SwiGLU the
    fc1 output (gate and up, 2) and silu's output (1). Measured on CPU (tests/unit/test_memory_model.py)."""


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    from torch.nn import functional as F

    return F.gelu(x, approximate="tanh")


def _gelu(x: torch.Tensor) -> torch.Tensor:
    from torch.nn import functional as F

    return F.gelu(x)


def _swiglu(x: torch.Tensor) -> torch.Tensor:
    from torch.nn import functional as F

    gate, up = x.chunk(2, dim=-1)  # this rank's blocks of the gate and the up half
    return F.silu(gate) * up


def _squared_relu(x: torch.Tensor) -> torch.Tensor:
    from torch.nn import functional as F

    return F.relu(x).square()  # relu saves its output and square its input: one tensor, saved once


REGISTRY: dict[str, Activation] = {
    a.name: a
    for a in (
        Activation(
            "gelu_tanh",
            "GeLU, tanh approximation 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))): Megatron's fused bias-GeLU "
            "(its default) and --openai-gelu; GPT-2's own activation",
            _gelu_tanh,
            gated=False,
            hf_names=("gelu_new", "gelu_pytorch_tanh", "gelu_fast"),
            elementwise_flops=1,
            saved_features=1,
        ),
        Activation(
            "gelu",
            "exact GeLU x Phi(x) (erf): Megatron without the fused bias-GeLU (--no-bias-gelu-fusion)",
            _gelu,
            gated=False,
            hf_names=("gelu", "gelu_python"),
            elementwise_flops=1,
            saved_features=1,
        ),
        Activation(
            "swiglu",
            "silu(gate) * up (--swiglu)",
            _swiglu,
            gated=True,
            hf_names=("silu",),
            elementwise_flops=2,
            saved_features=3,
        ),
        Activation(
            "squared_relu",
            "relu(x)^2 (--squared-relu; Primer's, Nemotron's)",
            _squared_relu,
            gated=False,
            hf_names=("relu2",),
            elementwise_flops=2,
            saved_features=1,
        ),
    )
}
assert tuple(REGISTRY) == ACTIVATIONS, "config.model.ACTIVATIONS must list the registry's names"
assert tuple(n for n, a in REGISTRY.items() if a.gated) == GATED_ACTIVATIONS, "GATED_ACTIVATIONS disagrees"


def find(name: str) -> Activation:
    """The registry entry of `name` (a ModelConfig has only registered names)."""
    return REGISTRY[name]
