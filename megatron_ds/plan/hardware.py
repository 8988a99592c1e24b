"""Known GPUs and GPT model presets: the facts the planner starts from.

GPU memory is the vendor's marketed capacity, treated as GiB; compute capabilities are NVIDIA's
(developer.nvidia.com/cuda-gpus). Model presets are the GPT-3 family of Brown et al. 2020,
"Language Models are Few-Shot Learners", Table 2.1 (layers, width, batch size, learning rate),
with the head counts Megatron-DeepSpeed's GPT-3 example scripts use (hidden size divisible by
heads: 1.3B uses 16 heads, 13B uses width 5120), sequence length 2048 and the GPT-2 BPE
vocabulary of 50257 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ds.config import DataConfig, ModelConfig, padded_vocab_size
from megatron_ds.errors import UserError

GPT2_VOCAB_SIZE = 50257
MAKE_VOCAB_SIZE_DIVISIBLE_BY = DataConfig.make_vocab_size_divisible_by  # pretrain_gpt.py's default


class PlanError(UserError):
    """A planner input that cannot be used; the message names the flag, the value and the fix."""


@dataclass(frozen=True)
class GPU:
    """One GPU model."""

    name: str
    memory_gb: float
    compute_capability: str
    architecture: str

    @property
    def cc(self) -> tuple[int, int]:
        return parse_compute_capability(self.compute_capability, "--gpu")


GPUS = {
    g.name.lower(): g
    for g in (
        GPU("P100-16GB", 16, "6.0", "Pascal"),
        GPU("V100-16GB", 16, "7.0", "Volta"),
        GPU("V100-32GB", 32, "7.0", "Volta"),
        GPU("T4", 16, "7.5", "Turing"),
        GPU("A10", 24, "8.6", "Ampere"),
        GPU("A30", 24, "8.0", "Ampere"),
        GPU("A40", 48, "8.6", "Ampere"),
        GPU("A100-40GB", 40, "8.0", "Ampere"),
        GPU("A100-80GB", 80, "8.0", "Ampere"),
        GPU("RTX-3090", 24, "8.6", "Ampere"),
        GPU("RTX-A6000", 48, "8.6", "Ampere"),
        GPU("RTX-4090", 24, "8.9", "Ada Lovelace"),
        GPU("L4", 24, "8.9", "Ada Lovelace"),
        GPU("L40S", 48, "8.9", "Ada Lovelace"),
        GPU("H100-80GB", 80, "9.0", "Hopper"),
        GPU("H200", 141, "9.0", "Hopper"),
    )
}


def find_gpu(name: str) -> GPU:
    """Case-insensitive exact name, or a unique prefix (`h100` -> H100-80GB)."""
    key = name.lower().replace("_", "-").replace(" ", "-")
    if key in GPUS:
        return GPUS[key]
    hits = [g for k, g in GPUS.items() if k.startswith(key)]
    if len(hits) == 1:
        return hits[0]
    known = ", ".join(g.name for g in GPUS.values())
    if hits:
        raise PlanError(f"--gpu {name!r} matches {', '.join(g.name for g in hits)}; give the full name")
    raise PlanError(
        f"--gpu {name!r} is not in the table ({known}); give --gpu-memory-gb and --compute-capability instead"
    )


def parse_compute_capability(text: str, flag: str = "--compute-capability") -> tuple[int, int]:
    parts = str(text).split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise PlanError(f"{flag} {text!r} is not MAJOR.MINOR (e.g. 8.0 for A100, 9.0 for H100); fix the value")
    return int(parts[0]), int(parts[1])


def architecture_of(cc: tuple[int, int]) -> str:
    """NVIDIA's architecture name for a compute capability."""
    major, minor = cc
    if major >= 10:
        return "Blackwell or newer"
    names = {6: "Pascal", 7: "Turing" if minor >= 5 else "Volta", 9: "Hopper"}
    if major == 8:
        return "Ada Lovelace" if minor >= 9 else "Ampere"
    return names.get(major, "pre-Pascal")


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
