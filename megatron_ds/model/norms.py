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

Beside the registry, `L2_NORM` is `--qk-l2-norm`'s weightless norm over each query and key head (megatron-core's
L2Norm; not a `--normalization` choice), and `head_norm` says which norm a model's query and key heads get.

Importing this module loads no torch (the factories import it when called): the memory and compute
models and the planner read the registry without torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_ds.config.model import NORMALIZATIONS

if TYPE_CHECKING:
    import torch
    from torch import nn

    from megatron_ds.config import ModelConfig


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
    `activation_kernels.SavedWidths.stat` bytes (float32 on CUDA): LayerNorm its mean and rstd, a fused
    RMSNorm its rstd. (torch's CPU RMSNorm is composite and saves more: `activation_kernels.SavedWidths`
    counts that.)"""
    forward_flops: int
    """Forward FLOPs per element, DeepSpeed flops-profiler convention (layer_norm with weights 5;
    rmsnorm 4, as layer_norm without the mean); backward is assumed 2x (`estimate/compute.py`)."""
    hf_model_types: tuple[str, ...]
    """Hugging Face `model_type`s built with this norm (GPT-2's `nn.LayerNorm`, Llama's
    `LlamaRMSNorm`): a model exports to, and a `config.json` of that type imports as, this norm."""
    megatron_lm: str
    """Megatron-LM's `--normalization` spelling of the norm's family (`LayerNorm`, `RMSNorm`)."""
    zero_centered_gamma: bool = False
    """The weight is stored as gamma - 1 and starts at 0 (Megatron's `--apply-layernorm-1p`,
    megatron-core's `layernorm_zero_centered_gamma`): the same function, another parametrisation."""

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


@functools.cache
def _zero_centered(rms: bool) -> type:
    """torch's LayerNorm or RMSNorm computing with weight + 1 (one class each, built on first use so
    that importing this module loads no torch)."""
    import torch.nn.functional as F
    from torch import nn

    base = nn.RMSNorm if rms else nn.LayerNorm

    class ZeroCenteredGamma(base):  # type: ignore[misc, valid-type]
        __doc__ = f"{base.__name__} whose weight holds gamma - 1 (Megatron's 1p form); starts at 0."

        def reset_parameters(self) -> None:
            super().reset_parameters()
            nn.init.zeros_(self.weight)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            gamma = self.weight + 1
            if rms:
                return F.rms_norm(x, self.normalized_shape, gamma, self.eps)
            return F.layer_norm(x, self.normalized_shape, gamma, self.bias, self.eps)

    ZeroCenteredGamma.__name__ = f"{base.__name__}1P"
    return ZeroCenteredGamma


def _layernorm1p(hidden_size: int, eps: float) -> nn.Module:
    return _zero_centered(False)(hidden_size, eps=eps)


def _rmsnorm1p(hidden_size: int, eps: float) -> nn.Module:
    return _zero_centered(True)(hidden_size, eps=eps)


@functools.cache
def _l2_norm_class() -> type:
    """megatron-core's L2Norm (its `torch_norm.L2Norm`), one class built on first use (no torch on import)."""
    import torch
    from torch import nn

    class L2Norm(nn.Module):
        """x * rsqrt(mean(x^2) + eps) over the last dimension, computed in float32 and cast back; no weights."""

        def __init__(self, hidden_size: int, eps: float) -> None:
            super().__init__()
            self.hidden_size, self.eps = hidden_size, eps

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x32 = x.float()
            return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)

        def extra_repr(self) -> str:
            return f"{self.hidden_size}, eps={self.eps}"

    return L2Norm


def _l2norm(hidden_size: int, eps: float) -> nn.Module:
    return _l2_norm_class()(hidden_size, eps)


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
            megatron_lm="LayerNorm",
        ),
        Norm(
            "rmsnorm",
            "RMSNorm",
            "x / sqrt(mean(x^2) + eps) * weight, no bias (--normalization rmsnorm): Llama's",
            _rmsnorm,
            stored_keys=("weight",),
            saved_statistics=1,
            forward_flops=4,
            hf_model_types=("llama", "qwen2", "qwen3", "mistral", "phi3"),
            megatron_lm="RMSNorm",
        ),
        Norm(
            "layernorm1p",
            "LayerNorm1P",
            "LayerNorm computing with (1 + weight), the weight starting at 0 (--apply-layernorm-1p): Megatron's "
            "zero-centred gamma",
            _layernorm1p,
            stored_keys=("weight", "bias"),
            saved_statistics=2,
            forward_flops=5,
            hf_model_types=(),
            megatron_lm="LayerNorm",
            zero_centered_gamma=True,
        ),
        Norm(
            "rmsnorm1p",
            "RMSNorm1P",
            "RMSNorm computing with (1 + weight), the weight starting at 0 (--normalization RMSNorm "
            "--apply-layernorm-1p): megatron-core's zero-centred gamma with Transformer Engine's RMSNorm",
            _rmsnorm1p,
            stored_keys=("weight",),
            saved_statistics=1,
            forward_flops=4,
            hf_model_types=(),
            megatron_lm="RMSNorm",
            zero_centered_gamma=True,
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


L2_NORM = Norm(
    "l2norm",
    "L2Norm",
    "x * rsqrt(mean(x^2) + eps) in float32, no weights (--qk-l2-norm): Llama 4's query and key norm",
    _l2norm,
    stored_keys=(),
    saved_statistics=1,  # rsqrt's output; the input is saved as float32 (a copy of a bf16 one)
    forward_flops=3,  # rmsnorm's without the weight (DeepSpeed's layer_norm without affine, 4, less the mean)
    hf_model_types=(),  # Llama 4's weightless norm follows rotary on its rotary layers only: not this model
    megatron_lm="L2Norm",
)
"""The norm over each query and key head of `--qk-l2-norm` (megatron-core's L2Norm); not a `--normalization`
choice, so not in `REGISTRY`."""


def head_norm(model: ModelConfig) -> Norm | None:
    """The norm over each query and key head: `--qk-l2-norm`'s L2Norm, `--qk-layernorm`'s the model's norm, or None."""
    if model.qk_l2_norm:
        return L2_NORM
    return find(model.normalization) if model.qk_layernorm else None


FLAG_SPELLINGS: tuple[str, ...] = (*REGISTRY, *dict.fromkeys(n.megatron_lm for n in REGISTRY.values()))
"""What `--normalization` accepts: our names (Megatron-DeepSpeed's lower-case spellings) and
Megatron-LM's (`LayerNorm`, `RMSNorm`)."""


def from_flags(spelling: str, apply_1p: bool) -> tuple[Norm, str | None]:
    """The norm `--normalization spelling [--apply-layernorm-1p]` builds, and a warning when the 1p
    flag is ignored. Megatron-LM zero-centres either family (`LayerNorm`, `RMSNorm`: megatron-core's
    layernorm_zero_centered_gamma); Megatron-DeepSpeed (`layernorm`, `rmsnorm`) only its LayerNorm,
    its RMSNorm ignores the flag, and so does this mapping then."""
    norm = REGISTRY.get(spelling) or next(
        n for n in REGISTRY.values() if n.megatron_lm == spelling and not n.zero_centered_gamma
    )
    if not apply_1p or norm.zero_centered_gamma:
        return norm, None
    if spelling == "rmsnorm":
        return norm, (
            "--apply-layernorm-1p with --normalization rmsnorm: Megatron-DeepSpeed zero-centres LayerNorm only and "
            "builds a plain RMSNorm, as here (Megatron-LM's --normalization RMSNorm zero-centres it); ignored"
        )
    return next(n for n in REGISTRY.values() if n.megatron_lm == norm.megatron_lm and n.zero_centered_gamma), None
