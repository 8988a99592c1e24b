"""The tensors of every GPT spec and how tensor parallelism splits them, as one table.

Keys are the spec's state-dict keys at T=1 (`TransformerLayer.named_parameters()` etc.); the same
keys hold each rank's shard at T > 1 (megatron-core's linears add an `_extra_state` entry, see
`extra_state_keys`). The rules mirror the model's own sharding (`megatron_ds.model.init`,
`megatron_ds.model.tensor_parallel_layers`): vocabulary-parallel embedding and head (row blocks),
column-parallel QKV and fc1 (fused parts cut per part), row-parallel proj and fc2 (column
blocks), everything else replicated. `gather` joins shards into the T=1 tensor, `split` cuts it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

import megatron_ds.model.norms as norms
from megatron_ds.config import ModelConfig
from megatron_ds.model import naming
from megatron_ds.model.init import gather_fused, qkv_row_parts, shard, shard_fused

REPLICATED, ROWS, COLUMNS, FUSED_ROWS = "replicated", "rows", "columns", "fused_rows"


@dataclass(frozen=True)
class TensorRule:
    """How one tensor of a spec is stored over T tensor-parallel ranks."""

    shape: tuple[int, ...]
    """Full (T=1) shape, with the padded vocabulary for vocabulary-sized tensors."""
    split: str = REPLICATED
    """REPLICATED, ROWS (dim 0 blocks), COLUMNS (dim 1 blocks) or FUSED_ROWS (each part's dim-0 blocks)."""
    parts: tuple[int, ...] = ()
    """Row counts of the fused parts (q, k, v; or gate, up) for FUSED_ROWS."""
    vocab: bool = False
    """Dim 0 is the (padded) vocabulary: trimmed on export, padded on import."""


def spec_tensors(model: ModelConfig, spec_name: str) -> dict[str, TensorRule]:
    """Every tensor spec `spec_name` holds (empty for parameter-free specs)."""
    h, v = model.hidden_size, model.vocab_size
    norm = _norm(model, h)
    if spec_name == naming.WORD_EMBEDDING or spec_name == naming.UNTIED_LM_HEAD:
        return {"weight": TensorRule((v, h), ROWS, vocab=True)}
    if spec_name == naming.POSITION_EMBEDDING:
        return {"weight": TensorRule((model.max_position_embeddings, h))}
    if spec_name == naming.FINAL_NORM:
        return {f"norm.{k}": r for k, r in norm.items()}
    if spec_name == naming.TRANSFORMER_LAYER:
        return _layer_tensors(model)
    return {}


def _norm(model: ModelConfig, h: int, norm: norms.Norm | None = None) -> dict[str, TensorRule]:
    return {k: TensorRule((h,)) for k in (norm or norms.find(model.normalization)).stored_keys}


def _layer_tensors(model: ModelConfig) -> dict[str, TensorRule]:
    h, f = model.hidden_size, model.ffn_hidden_size
    qkv = qkv_row_parts(model.qkv_rows, model.num_attention_heads, model.kv_heads)
    fc1 = (f, f) if model.gated_mlp else (f,)
    out: dict[str, TensorRule] = {f"input_norm.{k}": r for k, r in _norm(model, h).items()}
    out["qkv.weight"] = TensorRule((sum(qkv), h), FUSED_ROWS, qkv)
    if model.has_bias("qkv"):
        out["qkv.bias"] = TensorRule((sum(qkv),), FUSED_ROWS, qkv)
    head = norms.head_norm(model)
    if head is not None:  # --qk-layernorm: over head_dim, replicated over tensor ranks (--qk-l2-norm: no tensors)
        for name in ("q_norm", "k_norm"):
            out.update({f"{name}.{k}": r for k, r in _norm(model, model.head_dim, head).items()})
    out["proj.weight"] = TensorRule((h, model.query_size), COLUMNS)
    if model.has_bias("proj"):
        out["proj.bias"] = TensorRule((h,))
    out.update({f"post_attention_norm.{k}": r for k, r in _norm(model, h).items()})
    out["fc1.weight"] = TensorRule((sum(fc1), h), FUSED_ROWS, fc1)
    if model.has_bias("fc1"):
        out["fc1.bias"] = TensorRule((sum(fc1),), FUSED_ROWS, fc1)
    out["fc2.weight"] = TensorRule((h, f), COLUMNS)
    if model.has_bias("fc2"):
        out["fc2.bias"] = TensorRule((h,))
    return out


def extra_state_keys(spec_name: str, tensor_parallel: int) -> tuple[str, ...]:
    """State-dict entries megatron-core's parallel linears add at T > 1 (`_extra_state`, value None)."""
    if tensor_parallel == 1:
        return ()
    if spec_name == naming.TRANSFORMER_LAYER:
        return ("qkv._extra_state", "proj._extra_state", "fc1._extra_state", "fc2._extra_state")
    if spec_name == naming.UNTIED_LM_HEAD:
        return ("_extra_state",)
    return ()


def gather(rule: TensorRule, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full tensor from every tensor rank's shard (in rank order)."""
    if len(shards) == 1:
        return shards[0]
    if rule.split == ROWS:
        return torch.cat(list(shards), dim=0)
    if rule.split == COLUMNS:
        return torch.cat(list(shards), dim=1)
    if rule.split == FUSED_ROWS:
        return gather_fused(shards, rule.parts)
    return shards[0]


def split(rule: TensorRule, full: torch.Tensor, tensor_parallel: int) -> list[torch.Tensor]:
    """Each tensor rank's shard of `full`, each its own storage (torch.save writes a view's whole
    storage); replicated tensors are one shared copy."""
    if tensor_parallel == 1 or rule.split == REPLICATED:
        return [full.clone()] * tensor_parallel
    if rule.split == FUSED_ROWS:
        return [shard_fused(full, rule.parts, tensor_parallel, r) for r in range(tensor_parallel)]
    dim = 0 if rule.split == ROWS else 1
    return [shard(full, dim, tensor_parallel, r).clone() for r in range(tensor_parallel)]


def replicas_differ(shards: Sequence[torch.Tensor]) -> bool:
    """True when copies of a replicated tensor are not all equal (a corrupt checkpoint)."""
    return any(not torch.equal(shards[0], s) for s in shards[1:])
