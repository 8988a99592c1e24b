"""`GPTModel`: the pipeline's layers in one plain `nn.Module`, and `load_model` for checkpoints.

A mixture-of-experts model (`ModelConfig.experts_per_layer`) has the training MoE layer (DeepSpeed's, every expert on
this process: expert-parallel size 1) where the training model has one, its gate set to route every token to its top-k
experts whatever else is in the batch (`moe.route_every_token`: no token dropped, top-2's second expert by score), so
a KV-cached step computes what the whole sequence does. A layer with a sliding window
(`ModelConfig.layer_windows`) keeps every key in the cache and lets each new token attend the cached keys its window
holds (`sliding_window.visible`), as the whole sequence's forward does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.model import moe, naming, sliding_window
from megatron_ds.model.layers import FinalNorm, LMHead, PositionEmbedding, WordEmbedding
from megatron_ds.model.transformer import TransformerLayer
from megatron_ds.training.checkpoint import reader as checkpoint_reader
from megatron_ds.training.checkpoint import weights


@dataclass
class KVCache:
    """Keys and values of the tokens seen so far, per layer: each (b, kv heads, length, head dim)."""

    keys: list[torch.Tensor | None] = field(default_factory=list)
    values: list[torch.Tensor | None] = field(default_factory=list)
    length: int = 0


INFERENCE = RegularizationConfig(hidden_dropout=0.0, attention_dropout=0.0)
"""No dropout; Megatron's init std for weights drawn before a checkpoint is loaded."""


class GPTModel(nn.Module):
    """tokens (b, s) int64 -> logits (b, s, model.vocab_size) float32; T=1, eval mode.

    Built on whatever device is current (`torch.device("meta")` for loading without drawing
    initial weights); `load_model` builds it from a checkpoint.
    """

    def __init__(self, model: ModelConfig, init: RegularizationConfig = INFERENCE) -> None:
        super().__init__()
        self.config = model
        # `init` only scales freshly drawn weights (a loaded checkpoint replaces them); no dropout runs in eval.
        self.embedding = WordEmbedding(model, init, 0)
        self.position = PositionEmbedding(model, init, 0) if model.add_position_embedding else None
        self.layers = nn.ModuleList(
            _layer(model, init, n, w) for n, w in zip(model.experts_per_layer, model.layer_windows)
        )
        self.final_norm = FinalNorm(model, 0)
        self.lm_head = LMHead(model, init, 0) if model.untie_embeddings_and_output_weights else None
        self.eval()

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Logits of `tokens`; with `cache`, `tokens` continue the cached ones and the cache grows."""
        x = self.embedding(tokens.long())
        if cache is None:
            if self.position is not None:
                x = self.position(x)
            for layer in self.layers:
                x = layer(x)
        else:
            x = self._cached(x, cache)
        x = self.final_norm(x)
        head = self.lm_head.weight if self.lm_head is not None else self.embedding.weight
        return F.linear(x, head).float()

    def _cached(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        start, s = cache.length, x.shape[1]
        if self.position is not None:
            x = x + self.position.weight[start : start + s].to(x.dtype)
        if not cache.keys:
            cache.keys, cache.values = [None] * len(self.layers), [None] * len(self.layers)
        for i, layer in enumerate(self.layers):
            x = _cached_layer(layer, x, cache, i, start)
        cache.length = start + s
        return x


def _layer(model: ModelConfig, init: RegularizationConfig, num_experts: int, window: int | None) -> TransformerLayer:
    """A transformer layer as training builds it (with `num_experts` > 1: its MoE layer, all experts here; its
    sliding window)."""
    layer = TransformerLayer(model, init, 0, num_experts=num_experts, window=window)
    if layer.moe is not None:
        moe.route_every_token(layer.moe)
    return layer


def _cached_layer(layer: TransformerLayer, x: torch.Tensor, cache: KVCache, i: int, start: int) -> torch.Tensor:
    """`TransformerLayer.forward` (eval) for new tokens at positions start.., attending to the cache."""
    b, s, _ = x.shape
    q, k, v = layer.attention_heads(layer.input_norm(x), start)
    if cache.keys[i] is not None:
        k, v = torch.cat((cache.keys[i], k), dim=2), torch.cat((cache.values[i], v), dim=2)
    cache.keys[i], cache.values[i] = k, v
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    if start == 0:  # the prompt: the training layer's attention (causal, or within its window)
        attn = layer.core_attention(q, k, v)
    elif layer.window is not None:  # new token j (position start + j) sees its window of the cached positions
        visible = sliding_window.visible(start, s, 0, start + s, layer.window, x.device)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, **gqa)
    else:  # new token j (position start + j) sees cached positions 0 .. start + j
        visible = torch.ones(s, start + s, dtype=torch.bool, device=x.device).tril(diagonal=start)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, **gqa)
    x = x + layer.proj(attn.transpose(1, 2).reshape(b, s, q.shape[1] * layer.head_dim))
    return x + layer.mlp(x)


def module_name(spec: str, key: str, layer: int | None) -> str:
    """The `GPTModel` parameter name of a spec's tensor."""
    prefix = {
        naming.WORD_EMBEDDING: "embedding.",
        naming.POSITION_EMBEDDING: "position.",
        naming.FINAL_NORM: "final_norm.",
        naming.UNTIED_LM_HEAD: "lm_head.",
        naming.TRANSFORMER_LAYER: f"layers.{layer}.",
    }[spec]
    return prefix + key


def load_model(
    path: str,
    vocab_size: int | None = None,
    dtype: torch.dtype | None = None,
    tokenizer: dict[str, str | None] | None = None,
) -> GPTModel:
    """Load a checkpoint (root or global_stepN directory; any P, T, layout) into one `GPTModel`.

    The vocabulary padding is removed (see `checkpoint_reader.unpadded_vocab_size`; `vocab_size`
    overrides it); `dtype` converts the stored weights; `tokenizer` overrides the checkpoint's
    tokenizer flags (only its size is used here). Needs no process group.
    """
    ckpt = checkpoint_reader.open_checkpoint(path, moe=True)
    tok = checkpoint_reader.checkpoint_tokenizer(ckpt, tokenizer)
    vocab = checkpoint_reader.unpadded_vocab_size(ckpt, tok, vocab_size)
    with torch.device("meta"):  # no initial weights are drawn: the checkpoint's replace them
        model = GPTModel(dataclasses.replace(ckpt.config.model, vocab_size=vocab))
    state = {}
    for t in weights.iter_model_tensors(ckpt):
        tensor = t.tensor[:vocab] if t.rule.vocab else t.tensor
        state[module_name(t.spec, t.key, t.layer)] = tensor.to(dtype) if dtype is not None else tensor
    model.load_state_dict(state, strict=True, assign=True)
    return model
