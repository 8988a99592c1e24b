"""Pre-LN GPT transformer layer: causal self-attention through torch's SDPA, then a GeLU MLP."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_ds.config import ModelConfig
from megatron_ds.model.init import init_generator, normal_
from megatron_ds.model.layers import make_norm


class TransformerLayer(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)); (b, s, h) in and out.

    The causal mask is applied inside (SDPA `is_causal`): nothing but the hidden states travels
    between pipeline stages.
    """

    def __init__(self, model: ModelConfig, init_seed: int) -> None:
        super().__init__()
        h, f = model.hidden_size, model.ffn_hidden_size
        self.num_heads = model.num_attention_heads
        self.hidden_dropout = model.hidden_dropout
        self.attention_dropout = model.attention_dropout
        self.input_norm = make_norm(model)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.post_attention_norm = make_norm(model)
        self.fc1 = nn.Linear(h, f)
        self.fc2 = nn.Linear(f, h)
        self._init_weights(model, init_seed)

    @torch.no_grad()
    def _init_weights(self, model: ModelConfig, init_seed: int) -> None:
        # Megatron's init: N(0, std) for inputs to the residual branch, std / sqrt(2L) for the
        # projections that write into the residual stream; biases zero.
        gen = init_generator(init_seed)
        std = model.init_method_std
        out_std = std / math.sqrt(2.0 * model.num_layers)
        for linear, s in ((self.qkv, std), (self.proj, out_std), (self.fc1, std), (self.fc2, out_std)):
            normal_(linear.weight, s, gen)
            linear.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = self.qkv(self.input_norm(x)).view(b, s, 3, self.num_heads, h // self.num_heads)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=2))  # each (b, nh, s, hd)
        p = self.attention_dropout if self.training else 0.0
        attn = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        attn = attn.transpose(1, 2).reshape(b, s, h)
        x = x + F.dropout(self.proj(attn), self.hidden_dropout, self.training)
        mlp = self.fc2(F.gelu(self.fc1(self.post_attention_norm(x))))
        return x + F.dropout(mlp, self.hidden_dropout, self.training)
