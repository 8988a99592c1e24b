"""Our tensor names <-> Hugging Face tensor names, one table per architecture.

Keys are (spec name, state-dict key) from `megatron_ds.model.sharding`; values name the HF
tensor(s) (`{i}` is the transformer layer number) and how the values move:

    COPY       the same matrix
    TRANSPOSE  GPT-2's Conv1D stores (in, out); our linears store (out, in)
    SPLIT      our fused rows (q|k|v of the QKV projection, gate|up of SwiGLU's fc1) are separate
               HF tensors, in the same order (our rotary is rotate-half, as HF Llama's: no permutation)

A mixture-of-experts layer's expert tensors are one entry with `{e}` for the expert's global index on both sides
(`EXPERT_PREFIX{e}.fc1.weight` -> Mixtral's `experts.{e}.w1` and `w3`, the Hub's layout, which transformers 5 fuses
on load).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_ds.config import ModelConfig
from megatron_ds.interop.hf_architectures import (
    GPT2,
    LLAMA,
    MISTRAL,
    MIXTRAL,
    PHI3,
    QWEN2,
    QWEN2_MOE,
    QWEN3,
    QWEN3_MOE,
)
from megatron_ds.model import naming, sharding
from megatron_ds.model.moe import EXPERT_PREFIX, GATE_WEIGHT, SHARED_EXPERT_PREFIX
from megatron_ds.training.checkpoint.universal.names import model_tensors

COPY, TRANSPOSE, SPLIT = "copy", "transpose", "split"


@dataclass(frozen=True)
class WeightMap:
    hf: tuple[str, ...]
    how: str = COPY


_L = naming.TRANSFORMER_LAYER
_GPT2_BLOCK = "transformer.h.{i}."
GPT2_NAMES: dict[tuple[str, str], WeightMap] = {
    (naming.WORD_EMBEDDING, "weight"): WeightMap(("transformer.wte.weight",)),
    (naming.POSITION_EMBEDDING, "weight"): WeightMap(("transformer.wpe.weight",)),
    (_L, "input_norm.weight"): WeightMap((_GPT2_BLOCK + "ln_1.weight",)),
    (_L, "input_norm.bias"): WeightMap((_GPT2_BLOCK + "ln_1.bias",)),
    (_L, "qkv.weight"): WeightMap((_GPT2_BLOCK + "attn.c_attn.weight",), TRANSPOSE),
    (_L, "qkv.bias"): WeightMap((_GPT2_BLOCK + "attn.c_attn.bias",)),
    (_L, "proj.weight"): WeightMap((_GPT2_BLOCK + "attn.c_proj.weight",), TRANSPOSE),
    (_L, "proj.bias"): WeightMap((_GPT2_BLOCK + "attn.c_proj.bias",)),
    (_L, "post_attention_norm.weight"): WeightMap((_GPT2_BLOCK + "ln_2.weight",)),
    (_L, "post_attention_norm.bias"): WeightMap((_GPT2_BLOCK + "ln_2.bias",)),
    (_L, "fc1.weight"): WeightMap((_GPT2_BLOCK + "mlp.c_fc.weight",), TRANSPOSE),
    (_L, "fc1.bias"): WeightMap((_GPT2_BLOCK + "mlp.c_fc.bias",)),
    (_L, "fc2.weight"): WeightMap((_GPT2_BLOCK + "mlp.c_proj.weight",), TRANSPOSE),
    (_L, "fc2.bias"): WeightMap((_GPT2_BLOCK + "mlp.c_proj.bias",)),
    (naming.FINAL_NORM, "norm.weight"): WeightMap(("transformer.ln_f.weight",)),
    (naming.FINAL_NORM, "norm.bias"): WeightMap(("transformer.ln_f.bias",)),
    (naming.UNTIED_LM_HEAD, "weight"): WeightMap(("lm_head.weight",)),
}

_LLAMA_BLOCK = "model.layers.{i}."
_ATTN, _MLP = _LLAMA_BLOCK + "self_attn.", _LLAMA_BLOCK + "mlp."
LLAMA_NAMES: dict[tuple[str, str], WeightMap] = {
    (naming.WORD_EMBEDDING, "weight"): WeightMap(("model.embed_tokens.weight",)),
    (_L, "input_norm.weight"): WeightMap((_LLAMA_BLOCK + "input_layernorm.weight",)),
    (_L, "qkv.weight"): WeightMap((_ATTN + "q_proj.weight", _ATTN + "k_proj.weight", _ATTN + "v_proj.weight"), SPLIT),
    (_L, "qkv.bias"): WeightMap((_ATTN + "q_proj.bias", _ATTN + "k_proj.bias", _ATTN + "v_proj.bias"), SPLIT),
    (_L, "proj.weight"): WeightMap((_ATTN + "o_proj.weight",)),
    (_L, "proj.bias"): WeightMap((_ATTN + "o_proj.bias",)),
    (_L, "post_attention_norm.weight"): WeightMap((_LLAMA_BLOCK + "post_attention_layernorm.weight",)),
    (_L, "fc1.weight"): WeightMap((_MLP + "gate_proj.weight", _MLP + "up_proj.weight"), SPLIT),
    (_L, "fc1.bias"): WeightMap((_MLP + "gate_proj.bias", _MLP + "up_proj.bias"), SPLIT),
    (_L, "fc2.weight"): WeightMap((_MLP + "down_proj.weight",)),
    (_L, "fc2.bias"): WeightMap((_MLP + "down_proj.bias",)),
    (naming.FINAL_NORM, "norm.weight"): WeightMap(("model.norm.weight",)),
    (naming.UNTIED_LM_HEAD, "weight"): WeightMap(("lm_head.weight",)),
}
QWEN3_NAMES: dict[tuple[str, str], WeightMap] = {
    **LLAMA_NAMES,
    (_L, "q_norm.weight"): WeightMap((_ATTN + "q_norm.weight",)),  # (head_dim,), shared by every query head
    (_L, "k_norm.weight"): WeightMap((_ATTN + "k_norm.weight",)),
}
PHI3_NAMES: dict[tuple[str, str], WeightMap] = {
    (naming.WORD_EMBEDDING, "weight"): WeightMap(("model.embed_tokens.weight",)),
    (_L, "input_norm.weight"): WeightMap((_LLAMA_BLOCK + "input_layernorm.weight",)),
    (_L, "qkv.weight"): WeightMap((_ATTN + "qkv_proj.weight",)),  # q|k|v rows, as ours
    (_L, "proj.weight"): WeightMap((_ATTN + "o_proj.weight",)),
    (_L, "post_attention_norm.weight"): WeightMap((_LLAMA_BLOCK + "post_attention_layernorm.weight",)),
    (_L, "fc1.weight"): WeightMap((_MLP + "gate_up_proj.weight",)),  # gate|up rows, as ours
    (_L, "fc2.weight"): WeightMap((_MLP + "down_proj.weight",)),
    (naming.FINAL_NORM, "norm.weight"): WeightMap(("model.norm.weight",)),
    (naming.UNTIED_LM_HEAD, "weight"): WeightMap(("lm_head.weight",)),
}
_MOE = _LLAMA_BLOCK + "block_sparse_moe."
MIXTRAL_NAMES: dict[tuple[str, str], WeightMap] = {
    **{k: v for k, v in LLAMA_NAMES.items() if k[1].split(".")[0] not in ("fc1", "fc2")},
    (_L, GATE_WEIGHT): WeightMap((_MOE + "gate.weight",)),  # (experts, hidden): the router
    (_L, EXPERT_PREFIX + "{e}.fc1.weight"): WeightMap(
        (_MOE + "experts.{e}.w1.weight", _MOE + "experts.{e}.w3.weight"), SPLIT
    ),
    (_L, EXPERT_PREFIX + "{e}.fc2.weight"): WeightMap((_MOE + "experts.{e}.w2.weight",)),
}
QWEN3_MOE_NAMES: dict[tuple[str, str], WeightMap] = {
    **{k: v for k, v in QWEN3_NAMES.items() if k[1].split(".")[0] not in ("fc1", "fc2")},
    (_L, GATE_WEIGHT): WeightMap((_MLP + "gate.weight",)),  # (experts, hidden): the router
    (_L, EXPERT_PREFIX + "{e}.fc1.weight"): WeightMap(
        (_MLP + "experts.{e}.gate_proj.weight", _MLP + "experts.{e}.up_proj.weight"), SPLIT
    ),
    (_L, EXPERT_PREFIX + "{e}.fc2.weight"): WeightMap((_MLP + "experts.{e}.down_proj.weight",)),
}
QWEN2_MOE_NAMES: dict[tuple[str, str], WeightMap] = {
    **{k: v for k, v in QWEN3_MOE_NAMES.items() if k[1].split(".")[0] not in ("q_norm", "k_norm")},
    (_L, SHARED_EXPERT_PREFIX + "fc1.weight"): WeightMap(
        (_MLP + "shared_expert.gate_proj.weight", _MLP + "shared_expert.up_proj.weight"), SPLIT
    ),
    (_L, SHARED_EXPERT_PREFIX + "fc2.weight"): WeightMap((_MLP + "shared_expert.down_proj.weight",)),
    (_L, SHARED_EXPERT_PREFIX + "gate.weight"): WeightMap((_MLP + "shared_expert_gate.weight",)),  # (1, hidden)
}
TABLES = {
    GPT2: GPT2_NAMES,
    LLAMA: LLAMA_NAMES,
    QWEN2: LLAMA_NAMES,
    QWEN3: QWEN3_NAMES,
    MISTRAL: LLAMA_NAMES,
    PHI3: PHI3_NAMES,
    MIXTRAL: MIXTRAL_NAMES,
    QWEN3_MOE: QWEN3_MOE_NAMES,
    QWEN2_MOE: QWEN2_MOE_NAMES,
}
"""Qwen2 and Mistral name their tensors as Llama (Qwen2's q/k/v biases are Llama's with attention_bias); Qwen3 adds
its query and key norms; Mixtral and Qwen3-MoE replace the MLP by a router and experts (`block_sparse_moe.` with
w1/w3/w2; Qwen3-MoE's under `mlp.` with Llama's projection names); Qwen2-MoE has Qwen3-MoE's names (q/k/v biases,
no query and key norms) and its gated shared expert (`mlp.shared_expert.*`, `mlp.shared_expert_gate`)."""

IGNORED_HF_TENSORS = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|rotary_emb\.inv_freq)$")
"""Buffers some HF checkpoints store that are not weights (causal masks, rotary frequencies)."""


def _entry(arch: str, spec: str, key: str) -> tuple[WeightMap, int | None]:
    """The table's entry for our (spec, key), and the expert's global index when `key` is an expert's."""
    if not key.startswith(EXPERT_PREFIX):
        return TABLES[arch][(spec, key)], None
    expert, rest = key[len(EXPERT_PREFIX) :].split(".", 1)
    return TABLES[arch][(spec, f"{EXPERT_PREFIX}{{e}}.{rest}")], int(expert)


def hf_names(arch: str, spec: str, key: str, layer: int | None) -> tuple[str, ...]:
    """The HF tensor names of our (spec, key) in transformer layer `layer`."""
    entry, expert = _entry(arch, spec, key)
    return tuple(n.format(i=layer, e=expert) for n in entry.hf)


def to_hf(arch: str, spec: str, key: str, rule: sharding.TensorRule, full: torch.Tensor) -> list[torch.Tensor]:
    """HF tensors (in `hf_names` order) from our full tensor."""
    how = _entry(arch, spec, key)[0].how
    if how == TRANSPOSE:
        return [full.t().contiguous()]
    if how == SPLIT:
        return [p.contiguous() for p in full.split(list(rule.parts), dim=0)]
    return [full.contiguous()]


def from_hf(arch: str, spec: str, key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Our full tensor from the HF tensors (inverse of `to_hf`)."""
    how = _entry(arch, spec, key)[0].how
    if how == TRANSPOSE:
        return tensors[0].t().contiguous()
    if how == SPLIT:
        return torch.cat(tensors, dim=0)
    return tensors[0].contiguous()


def read_ours(
    arch: str,
    spec: str,
    key: str,
    layer: int | None,
    rule: sharding.TensorRule,
    get: Callable[[str], torch.Tensor],
    rows: int,
) -> torch.Tensor:
    """Our full tensor (spec, key) of transformer layer `layer` from the HF tensors `get` reads by name (`from_hf`), a
    vocabulary tensor zero-padded to `rows` rows (never a token: the tokenizer has fewer ids)."""
    full = from_hf(arch, spec, key, [get(name) for name in hf_names(arch, spec, key, layer)])
    if not rule.vocab or full.shape[0] == rows:
        return full
    return torch.cat((full, full.new_zeros(rows - full.shape[0], *full.shape[1:])))


def hf_shapes(arch: str, model: ModelConfig, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the model has, with its shape (vocabulary rows: `vocab_size`)."""
    out: dict[str, tuple[int, ...]] = {}
    groups = naming.gpt_spec_groups(model)
    for tensor in model_tensors(model):  # a layer's experts too
        spec, key, rule = tensor.spec, tensor.key, tensor.rule
        layer = groups.layer_of(tensor.spec_index)
        shape = (vocab_size, *rule.shape[1:]) if rule.vocab else rule.shape
        probe = torch.empty(shape, device="meta")
        for name, t in zip(hf_names(arch, spec, key, layer), to_hf(arch, spec, key, rule, probe)):
            out[name] = tuple(t.shape)
    return out
