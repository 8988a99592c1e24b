"""The facts the planner starts from: the `--gpu` lookup in the GPU table (`estimate/devices.py`)
and the GPT model presets.

Model presets are the GPT-3 family of Brown et al. 2020,
"Language Models are Few-Shot Learners", Table 2.1 (layers, width, batch size, learning rate),
with the head counts Megatron-DeepSpeed's GPT-3 example scripts use (hidden size divisible by
heads: 1.3B uses 16 heads, 13B uses width 5120), sequence length 2048 and the GPT-2 BPE
vocabulary of 50257 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ds.config import DataConfig, ModelConfig, padded_vocab_size
from megatron_ds.errors import UserError
from megatron_ds.estimate.devices import DEVICES, Device, find_named

GPT2_VOCAB_SIZE = 50257
MAKE_VOCAB_SIZE_DIVISIBLE_BY = DataConfig.make_vocab_size_divisible_by  # pretrain_gpt.py's default


class PlanError(UserError):
    """A planner input that cannot be used; the message names the flag, the value and the fix."""


def find_gpu(name: str) -> Device:
    """The `--gpu` device (`estimate/devices.py`): a case-insensitive name or alias, or a unique prefix
    (`h100-8` -> H100-80GB)."""
    hits = find_named(name)
    if len(hits) == 1:
        return hits[0]
    if hits:
        raise PlanError(f"--gpu {name!r} matches {', '.join(d.name for d in hits)}; give the full name")
    known = ", ".join(d.name for d in DEVICES)
    raise PlanError(
        f"--gpu {name!r} is not in the table ({known}); give --gpu-memory-gb and --compute-capability instead"
    )


def parse_compute_capability(text: str, flag: str = "--compute-capability") -> tuple[int, int]:
    parts = str(text).split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise PlanError(f"{flag} {text!r} is not MAJOR.MINOR (e.g. 8.0 for A100, 9.0 for H100); fix the value")
    return int(parts[0]), int(parts[1])


@dataclass(frozen=True)
class Preset:
    """A GPT size from the GPT-3 paper's Table 2.1."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    global_batch_size: int
    lr: float


PRESETS = {
    p.name: p
    for p in (
        Preset("gpt3-125m", 12, 768, 12, 256, 6.0e-4),
        Preset("gpt3-350m", 24, 1024, 16, 256, 3.0e-4),
        Preset("gpt3-760m", 24, 1536, 16, 256, 2.5e-4),
        Preset("gpt3-1.3b", 24, 2048, 16, 512, 2.0e-4),
        Preset("gpt3-2.7b", 32, 2560, 32, 512, 1.6e-4),
        Preset("gpt3-6.7b", 32, 4096, 32, 1024, 1.2e-4),
        Preset("gpt3-13b", 40, 5120, 40, 1024, 1.0e-4),
        Preset("gpt3-175b", 96, 12288, 96, 1536, 0.6e-4),
    )
}
PRESET_SEQ_LENGTH = 2048


def find_preset(name: str) -> Preset:
    """`gpt3-1.3b`, `1.3b`, `1.3B` and `175b` all work."""
    key = name.lower()
    if not key.startswith("gpt3-"):
        key = "gpt3-" + key
    if key in PRESETS:
        return PRESETS[key]
    raise PlanError(
        f"--model {name!r} is not a preset; use one of {', '.join(PRESETS)} or give "
        f"--num-layers --hidden-size --num-attention-heads --seq-length --vocab-size"
    )


def model_config(
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    seq_length: int,
    vocab_size: int,
    ffn_hidden_size: int | None = None,
    tensor_parallel_size: int = 1,
) -> ModelConfig:
    """The ModelConfig pretrain_gpt.py builds for these flags: the vocabulary padded by the same
    `megatron_ds.config.padded_vocab_size`, the same checks (a ConfigError naming the flag)."""
    return ModelConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        ffn_hidden_size=ffn_hidden_size or 4 * hidden_size,
        seq_length=seq_length,
        max_position_embeddings=seq_length,
        vocab_size=padded_vocab_size(vocab_size, MAKE_VOCAB_SIZE_DIVISIBLE_BY, tensor_parallel_size),
    )
