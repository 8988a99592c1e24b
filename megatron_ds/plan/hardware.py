"""The facts the planner starts from: the `--gpu` lookup in the GPU table (`estimate/devices.py`)
and the GPT model presets.

Model presets: the GPT-3 family of Brown et al. 2020, "Language Models are Few-Shot Learners",
Table 2.1 (layers, width, batch size, learning rate), with the head counts Megatron-DeepSpeed's GPT-3
example scripts use (hidden size divisible by heads: 1.3B uses 16 heads, 13B uses width 5120), sequence
length 2048 and the GPT-2 BPE vocabulary of 50257 tokens; and Llama 2 (7B, 13B, 70B), Llama 3
(8B, 70B, 405B), Llama 3.1 (8B, 70B; RoPE scaling), Llama 3.2 (1B, 3B; tied), Qwen2.5 (7B, 72B), Qwen3 (0.6B-32B dense; q/k norms,
128-channel heads), Mistral 7B and Mixtral 8x7B and 8x22B (8 experts, top-2) with their architecture
as pretrain_gpt.py's flags (each preset's `source`). A preset's model is built by pretrain_gpt.py's own
flag rules (`flags.parser.model_config`), so its parameter count is what pretrain_gpt.py builds
(tests/unit/test_plan_models.py checks the published counts).
"""

from __future__ import annotations

import contextlib
import functools
import io
import sys
from dataclasses import dataclass

from megatron_ds.config import DataConfig, ModelConfig
from megatron_ds.errors import UserError
from megatron_ds.estimate.devices import DEVICES, Device, find_named
from megatron_ds.flags import parser

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
    if not 1 <= int(parts[0]) <= 15:  # CUDA's are 1.0 (2006) to 12.x (Blackwell), with room for what comes
        raise PlanError(
            f"{flag} {text!r} is no CUDA compute capability; give the GPU's (7.0 V100, 8.0 A100, 9.0 H100, 10.0 B200)"
        )
    return int(parts[0]), int(parts[1])


@dataclass(frozen=True)
class Preset:
    """A published model: its sizes, architecture flags, batch and learning rate."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    global_batch_size: int
    lr: float | None
    ffn_hidden_size: int | None = None
    """None: pretrain_gpt.py's default (`config.model.default_ffn_hidden_size`: 4 x hidden, less with --swiglu)."""
    seq_length: int = 2048
    vocab_size: int = 50257
    architecture: tuple[str, ...] = ()
    """pretrain_gpt.py's flags for everything a GPT-3 model does not have (SwiGLU, RMSNorm, GQA, ...)."""
    source: str = "Brown et al. 2020, Table 2.1"
    aliases: tuple[str, ...] = ()


_LLAMA = (
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--use-rotary-position-embeddings",
    "--no-position-embedding",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
)
_LLAMA2 = "Touvron et al. 2023, Llama 2, Table 1 and Sec. 2.2 (4M-token batches); the released config.json files"
_LLAMA3 = (
    "Llama Team 2024, The Llama 3 Herd of Models, Table 3 (405B: lr 8e-5, batches from 4M tokens); the released "
    "config.json files; 8B/70B learning rates are not published (the printed --lr is the placeholder)"
)
_LLAMA3_ARCH = (*_LLAMA, "--rotary-base", "500000")
_LLAMA31_ARCH = (*_LLAMA3_ARCH, "--use-rope-scaling")  # factor 8, --rope-scaling-factor's default
_LLAMA31 = "Meta's released Llama-3.1 config.json files (rope_scaling: llama3, factor 8); " + _LLAMA3
# Llama 3.2 1B/3B tie the output layer to the embedding and scale RoPE by 32.
_LLAMA32_ARCH = (
    *(f for f in _LLAMA3_ARCH if f != "--untie-embeddings-and-output-weights"),
    "--use-rope-scaling",
    "--rope-scaling-factor",
    "32",
)
_LLAMA32 = (
    "Meta's released Llama-3.2-1B/3B config.json files (tied embeddings, rope_scaling: llama3, factor 32); batch "
    "and learning rate are not published (the Llama 3 batch and the placeholder --lr are printed)"
)


# Qwen2.5: Llama's layer with biases on q, k and v, RoPE base 1e6, norm epsilon 1e-6; untied at 7B and 72B.
_QWEN25_ARCH = (*_LLAMA, "--add-qkv-bias", "--rotary-base", "1000000", "--layernorm-epsilon", "1e-6")
_QWEN25 = (
    "Qwen Team 2024, Qwen2.5 Technical Report (arXiv 2412.15115), Table 1; the released config.json files "
    "(7.61B and 72.7B parameters, as their model cards state); batch and learning rate are not published (the "
    "Llama 3 batch and the placeholder --lr are printed)"
)
# Mistral 7B (v0.1): Llama's layer with 8 kv heads; its 4096-token sliding window covers the whole sequence here.
_MISTRAL = (
    "Jiang et al. 2023, Mistral 7B (arXiv 2310.06825), Table 1; the released Mistral-7B-v0.1 config.json (7.24B "
    "parameters); batch and learning rate are not published (the Llama 2 batch and the placeholder --lr are printed)"
)


# Mixtral 8x7B (v0.1): Mistral 7B's layer with 8 SwiGLU experts of Mistral's width on every layer, each token routed to
# its top 2 (transformers' MixtralSparseMoeBlock: every token, no capacity), RoPE base 1e6; no window over 4096 tokens.
_MIXTRAL_ARCH = (
    *_LLAMA,
    "--rotary-base",
    "1000000",
    "--num-experts",
    "8",
    "--expert-interval",
    "1",
    "--topk",
    "2",
    "--disable-moe-token-dropping",
    "--disable-moe-top2-2nd-expert-sampling",
)
_MIXTRAL = (
    "Jiang et al. 2024, Mixtral of Experts (arXiv 2401.04088), Table 1; the released Mixtral-8x7B-v0.1 config.json "
    "(46.7B parameters as its model card states, 46,702,792,704 from the config); its router_aux_loss_coef (0.02) "
    "weighs transformers' loss, not --moe-loss-coeff's (docs/interop.md); 8x22B: Mistral AI's release (141B "
    "parameters, 39B active) and its config.json (hidden 6144, 56 layers, 48 heads, ffn 16384, vocabulary 32768); batch "
    "and learning rate are not published (the Llama 2 batch and the placeholder --lr are printed)"
)


def _gqa(kv: int) -> tuple[str, ...]:
    return ("--num-key-value-heads", str(kv))


# Qwen3 dense: Llama's layer without the q/k/v biases, with RMSNorm on each head's queries and keys, 128-channel heads
# at every size (--kv-channels where hidden / heads is not 128), RoPE base 1e6, epsilon 1e-6; 0.6B-4B tied.
_QWEN3_ARCH = (*_LLAMA, "--qk-layernorm", "--rotary-base", "1000000", "--layernorm-epsilon", "1e-6", *_gqa(8))
_QWEN3_TIED = tuple(f for f in _QWEN3_ARCH if f != "--untie-embeddings-and-output-weights")
_QWEN3 = (
    "Qwen Team 2025, Qwen3 (arXiv 2505.09388); the released config.json files (4B-32B as quoted in "
    "citsjtu2020/LLM-Prof sglang/Model_Config.md; 0.6B/1.7B as in rasbt/LLMs-from-scratch "
    "pkg/llms_from_scratch/qwen3.py): head_dim 128, 8 kv heads, rope_theta 1e6, rms_norm_eps 1e-6, vocab 151936, "
    "40960 positions; parameters 0.6B/1.7B/4.0B/8.2B/14.8B/32.8B (0.6B-4B exactly keras-hub's Qwen3 preset counts); "
    "batch and learning rate "
    "are not published (the Llama 3 batch and the placeholder --lr are printed)"
)


# Qwen3-MoE: Qwen3's layer (4 kv heads of 128 channels) with 128 SwiGLU experts of moe_intermediate_size on every
# layer, each token routed to its top 8 renormalized (norm_topk_prob): Megatron-LM's top-k router here.
_QWEN3_MOE_ARCH = (
    *_LLAMA,
    "--qk-layernorm",
    "--rotary-base",
    "1000000",
    "--layernorm-epsilon",
    "1e-6",
    *_gqa(4),
    "--kv-channels",
    "128",
    "--num-experts",
    "128",
    "--moe-router-topk",
    "8",
)


def _qwen2_moe_arch(experts: int, top_k: int, shared: int) -> tuple[str, ...]:
    """Qwen2's layer (q/k/v biases) with `experts` routed experts, `top_k` of a softmax over all of them unrenormalized
    (`norm_topk_prob: false`: --moe-router-pre-softmax) and a gated shared expert of width `shared`."""
    return (
        *_QWEN25_ARCH,
        "--num-experts",
        str(experts),
        "--moe-router-topk",
        str(top_k),
        "--moe-router-pre-softmax",
        "--moe-shared-expert-intermediate-size",
        str(shared),
        "--moe-shared-expert-gate",
    )


_QWEN2_MOE = (
    "the released Qwen1.5-MoE-A2.7B and Qwen2-57B-A14B config.json files (24 / 28 layers, hidden 2048 / 3584, 16 / 28 "
    "query heads and 16 / 4 kv heads, 60 experts of 1408 with 4 routed / 64 of 2560 with 8 routed, a gated shared "
    "expert of 5632 / 20480, norm_topk_prob false, vocab 151936, rope_theta 1e6): 14.3B and 57.4B parameters, 2.7B and "
    "14.2B active, as their model cards state; batch and learning rate are not published (the Llama 3 batch and the "
    "placeholder --lr are printed)"
)
_QWEN3_MOE = (
    "Qwen Team 2025, Qwen3 (arXiv 2505.09388), Table 2 (30B-A3B: 48 layers, 32 query / 4 kv heads; 235B-A22B: 94 "
    "layers, 64 / 4; 128 experts, 8 routed, no shared expert); the released config.json files (hidden 2048 / 4096, "
    "moe_intermediate_size 768 / 1536, head_dim 128, norm_topk_prob true, vocab 151936, rope_theta 1e6): 30.5B and "
    "235B parameters, 3.3B and 22B active, as the model cards state; their router_aux_loss_coef (0.001) weighs "
    "transformers' loss, not --moe-aux-loss-coeff's (docs/interop.md); batch and learning rate are not published (the "
    "Llama 3 batch and the placeholder --lr are printed)"
)


def _kv128(hidden: int, heads: int) -> tuple[str, ...]:
    """--kv-channels 128 where Qwen3's head_dim is not hidden / heads (0.6B, 4B, 32B)."""
    return () if hidden == 128 * heads else ("--kv-channels", "128")


def _qwen3(name: str, layers: int, hidden: int, heads: int, ffn: int, tied: bool) -> Preset:
    arch = (*(_QWEN3_TIED if tied else _QWEN3_ARCH), *_kv128(hidden, heads))
    return Preset(name, layers, hidden, heads, 512, None, ffn, 4096, 151936, arch, _QWEN3)


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
        Preset("llama2-7b", 32, 4096, 32, 1024, 3.0e-4, 11008, 4096, 32000, _LLAMA, _LLAMA2),
        Preset("llama2-13b", 40, 5120, 40, 1024, 3.0e-4, 13824, 4096, 32000, _LLAMA, _LLAMA2),
        Preset("llama2-70b", 80, 8192, 64, 1024, 1.5e-4, 28672, 4096, 32000, (*_LLAMA, *_gqa(8)), _LLAMA2),
        Preset("llama3-8b", 32, 4096, 32, 512, None, 14336, 8192, 128256, (*_LLAMA3_ARCH, *_gqa(8)), _LLAMA3),
        Preset("llama3-70b", 80, 8192, 64, 512, None, 28672, 8192, 128256, (*_LLAMA3_ARCH, *_gqa(8)), _LLAMA3),
        Preset("llama3.1-8b", 32, 4096, 32, 512, None, 14336, 8192, 128256, (*_LLAMA31_ARCH, *_gqa(8)), _LLAMA31),
        # Llama 3.3 70B has Llama 3.1 70B's architecture and config (the same shapes and RoPE scaling).
        Preset(
            "llama3.1-70b",
            80,
            8192,
            64,
            512,
            None,
            28672,
            8192,
            128256,
            (*_LLAMA31_ARCH, *_gqa(8)),
            _LLAMA31,
            ("llama3.3-70b",),
        ),
        # Llama 3 405B was released as Llama 3.1 only, with its RoPE scaling.
        Preset(
            "llama3-405b",
            126,
            16384,
            128,
            512,
            8.0e-5,
            53248,
            8192,
            128256,
            (*_LLAMA31_ARCH, *_gqa(8)),
            _LLAMA31,
            ("llama3.1-405b",),
        ),
        Preset("llama3.2-1b", 16, 2048, 32, 512, None, 8192, 8192, 128256, (*_LLAMA32_ARCH, *_gqa(8)), _LLAMA32),
        Preset("llama3.2-3b", 28, 3072, 24, 512, None, 8192, 8192, 128256, (*_LLAMA32_ARCH, *_gqa(8)), _LLAMA32),
        Preset("qwen2.5-7b", 28, 3584, 28, 512, None, 18944, 4096, 152064, (*_QWEN25_ARCH, *_gqa(4)), _QWEN25),
        Preset("qwen2.5-72b", 80, 8192, 64, 512, None, 29568, 4096, 152064, (*_QWEN25_ARCH, *_gqa(8)), _QWEN25),
        _qwen3("qwen3-0.6b", 28, 1024, 16, 3072, tied=True),
        _qwen3("qwen3-1.7b", 28, 2048, 16, 6144, tied=True),
        _qwen3("qwen3-4b", 36, 2560, 32, 9728, tied=True),
        _qwen3("qwen3-8b", 36, 4096, 32, 12288, tied=False),
        _qwen3("qwen3-14b", 40, 5120, 40, 17408, tied=False),
        _qwen3("qwen3-32b", 64, 5120, 64, 25600, tied=False),
        Preset(  # its sliding window of 4096 tokens (--window-size 4095,0) covers the 4096-token sequence
            "mistral-7b",
            32,
            4096,
            32,
            1024,
            None,
            14336,
            4096,
            32000,
            (*_LLAMA, *_gqa(8), "--window-size", "4095,0"),
            _MISTRAL,
        ),
        Preset("qwen3-30b-a3b", 48, 2048, 32, 512, None, 768, 4096, 151936, _QWEN3_MOE_ARCH, _QWEN3_MOE),
        Preset("qwen3-235b-a22b", 94, 4096, 64, 512, None, 1536, 4096, 151936, _QWEN3_MOE_ARCH, _QWEN3_MOE),
        Preset(
            "qwen1.5-moe-a2.7b", 24, 2048, 16, 512, None, 1408, 4096, 151936, _qwen2_moe_arch(60, 4, 5632), _QWEN2_MOE
        ),
        Preset(
            "qwen2-57b-a14b",
            28,
            3584,
            28,
            512,
            None,
            2560,
            4096,
            151936,
            (*_qwen2_moe_arch(64, 8, 20480), *_gqa(4)),
            _QWEN2_MOE,
        ),
        Preset("mixtral-8x7b", 32, 4096, 32, 1024, None, 14336, 4096, 32000, (*_MIXTRAL_ARCH, *_gqa(8)), _MIXTRAL),
        Preset("mixtral-8x22b", 56, 6144, 48, 1024, None, 16384, 4096, 32768, (*_MIXTRAL_ARCH, *_gqa(8)), _MIXTRAL),
    )
}
PRESET_SEQ_LENGTH = 2048


def _normal(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum() or ch == ".")


def find_preset(name: str) -> Preset:
    """`gpt3-1.3b`, `1.3b`, `1.3B`, `175b`, `llama2-7b`, `Llama-2-7B`, `llama3-405b` and `Llama-3.1-405B` all work."""
    key = _normal(name)
    for preset in PRESETS.values():
        names = (preset.name, preset.name.removeprefix("gpt3-"), *preset.aliases)
        if key in (_normal(n) for n in names):
            return preset
    raise PlanError(
        f"--model {name!r} is not a preset; use one of {', '.join(PRESETS)} or give "
        f"--num-layers --hidden-size --num-attention-heads --seq-length --vocab-size"
    )


def model_flags(
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    seq_length: int,
    vocab_size: int,
    ffn_hidden_size: int | None = None,
    architecture: tuple[str, ...] = (),
) -> list[str]:
    """pretrain_gpt.py's model flags for these sizes and architecture flags (what the printed command passes)."""
    sizes = [
        ("--num-layers", num_layers),
        ("--hidden-size", hidden_size),
        ("--num-attention-heads", num_attention_heads),
        ("--ffn-hidden-size", ffn_hidden_size),
        ("--seq-length", seq_length),
        ("--vocab-size", vocab_size),
    ]
    return [str(x) for flag, value in sizes if value is not None for x in (flag, value)] + list(architecture)


def model_config(
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    seq_length: int,
    vocab_size: int,
    ffn_hidden_size: int | None = None,
    tensor_parallel_size: int = 1,
    architecture: tuple[str, ...] = (),
) -> ModelConfig:
    """The ModelConfig pretrain_gpt.py builds for these flags (`flags.parser.model_config`: the same
    declarations, rules, checks and vocabulary padding; a ConfigError naming the flag)."""
    sizes = (num_layers, hidden_size, num_attention_heads, seq_length, vocab_size, ffn_hidden_size)
    argv = (*model_flags(*sizes, tuple(architecture)), "--tensor-model-parallel-size", str(tensor_parallel_size))
    return _model_config(argv)


_WARNED: set[str] = set()


@functools.lru_cache(maxsize=256)
def _model_config(argv: tuple[str, ...]) -> ModelConfig:
    """`parser.model_config`, each of its warnings (an ignored flag) printed once per process: the planner sizes
    the same model at every tensor-parallel size it tries."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        model = parser.model_config(argv)
    for line in err.getvalue().splitlines():
        if line not in _WARNED:
            _WARNED.add(line)
            print(line, file=sys.stderr, flush=True)
    return model
