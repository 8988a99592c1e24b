"""The norms: one registry entry each (`REGISTRY`), read by the layers, the parameter counts, the
memory and compute models, the checkpoint sharding table and the Hugging Face mapping.

`ModelConfig.normalization` names an entry (`--normalization`; its choices and help text are the
names). The names are repeated in `megatron_ds.config.model.NORMALIZATIONS` (the config layer sits
below torch and the model layer and needs them for its check); this module checks on import that
the two agree.

To add a norm: its name in `config.model.NORMALIZATIONS` and one `Norm` here; nothing else spells
a norm's name (tests/unit/test_norms.py derives those two files from the registry, checks that
docs/architecture.md lists them, and checks each entry's parameters, stored keys and Hugging Face
counterpart against the real modules).

Importing this module loads no torch (the factories import it when called): the memory and compute
models and the planner read the registry without torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_ds.config.model import NORMALIZATIONS

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class Norm:
    """One norm over the hidden dimension, applied before attention, before the MLP and before the head."""

    name: str
    title: str
    """How prose and messages spell it (`LayerNorm`)."""
    summary: str
    module: Callable[[int, float], nn.Module]
    """(hidden size h, epsilon) -> the module normalising the last dimension of (..., h); weights
    start at 1 and biases at 0 (no seeded draw)."""
    stored_keys: tuple[str, ...]
    """The module's state-dict keys, each an (h,) vector replicated over tensor ranks
    (`model/sharding.py`); biases and weights alike go to the no-weight-decay group."""
    saved_statistics: int
    """Statistics per token that autograd saves for backward besides the input, one element each of
    `activation_memory.Kernels.stat` bytes (float32 on CUDA): LayerNorm its mean and rstd, a fused
    RMSNorm its rstd. (torch's CPU RMSNorm is composite and saves more; the memory model does not
    count that.)"""
    forward_flops: int
    """Forward FLOPs per element, DeepSpeed flops-profiler convention (layer_norm with weights 5;
    rmsnorm 4, as layer_norm without the mean); backward is assumed 2x (`estimate/compute.py`)."""
    hf_model_types: tuple[str, ...]
    """Hugging Face `model_type`s built with this norm (GPT-2's `nn.LayerNorm`, Llama's
    `LlamaRMSNorm`): a model exports to, and a `config.json` of that type imports as, this norm."""

    @property
    def params_per_hidden(self) -> int:
        """Parameters per hidden unit: one per stored (h,) vector."""
        return len(self.stored_keys)


def _layernorm(hidden_size: int, eps: float) -> nn.Module:
    from torch import nn

    return nn.LayerNorm(hidden_size, eps=eps)  # torch's own; no apex import


def _rmsnorm(hidden_size: int, eps: float) -> nn.Module:
    from torch import nn

    return nn.RMSNorm(hidden_size, eps=eps)


REGISTRY: dict[str, Norm] = {
    n.name: n
    for n in (
        Norm(
            "layernorm",
            "LayerNorm",
            "(x - mean) / sqrt(var + eps) * weight + bias over the hidden dimension: GPT-2's and Megatron's default",
            _layernorm,
            stored_keys=("weight", "bias"),
            saved_statistics=2,
            forward_flops=5,
            hf_model_types=("gpt2",),
        ),
        Norm(
            "rmsnorm",
            "RMSNorm",
            "x / sqrt(mean(x^2) + eps) * weight, no bias (--normalization rmsnorm): Llama's",
            _rmsnorm,
            stored_keys=("weight",),
            saved_statistics=1,
            forward_flops=4,
            hf_model_types=("llama",),
        ),
    )
}
assert tuple(REGISTRY) == NORMALIZATIONS, "config.model.NORMALIZATIONS must list the registry's names"


def find(name: str) -> Norm:
    """The registry entry of `name` (a ModelConfig has only registered names)."""
    return REGISTRY[name]


def for_hf_model_type(model_type: str) -> Norm:
    """The norm of Hugging Face's `model_type` (each supported type names exactly one)."""
    (norm,) = (n for n in REGISTRY.values() if model_type in n.hf_model_types)
    return norm
