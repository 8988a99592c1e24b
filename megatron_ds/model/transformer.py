"""Pre-LN GPT transformer layer: causal self-attention through torch's SDPA, then a GeLU MLP.

At T > 1 the same layer runs on each tensor rank with megatron-core's parallel linears: QKV and
fc1 are column-parallel (this rank's heads / MLP features), proj and fc2 row-parallel (their
outputs summed over tensor ranks), norms and row-parallel biases replicated. Each rank attends
with its own nh/T heads; the fused QKV shard holds the q, k, v rows of exactly those heads
(`megatron_ds.model.init.shard_qkv`), so the code below is the same for every T.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_ds.config import ModelConfig
from megatron_ds.model.init import draw_normal, init_generator
from megatron_ds.model.layers import make_norm
from megatron_ds.model.parallel import NO_TENSOR_PARALLEL, TensorParallel, column_linear, row_linear
from megatron_ds.model.rng import Stream, checkpoint_streams, dropout


class TransformerLayer(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)); (b, s, h) in and out, replicated over tensor ranks.

    The causal mask is applied inside (SDPA `is_causal`): nothing but the hidden states travels
    between pipeline stages.
    """

    def __init__(self, model: ModelConfig, init_seed: int, tp: TensorParallel = NO_TENSOR_PARALLEL) -> None:
        super().__init__()
        h = model.hidden_size
        assert model.num_attention_heads % tp.size == 0, (model.num_attention_heads, tp.size)
        self.num_local_heads = model.num_attention_heads // tp.size
        self.head_dim = h // model.num_attention_heads
        self.hidden_dropout = model.hidden_dropout
        self.attention_dropout = model.attention_dropout
        # Dropout on the residual branches (replicated activations) is the same on every tensor
        # rank and equal to T=1's; attention dropout acts on this rank's heads only.
        self.hidden_stream = Stream.replicated(init_seed)
        self.attention_stream = Stream.tensor_parallel(init_seed, tp.rank)
        checkpoint_streams(self, self.hidden_stream, self.attention_stream)
        qkv, proj, fc1, fc2 = self._full_weights(model, init_seed)
        # Registration order = parameter order (optimizer state, ZeRO partitions): keep it.
        self.input_norm = make_norm(model)
        self.qkv = column_linear(tp, qkv, qkv_heads=model.num_attention_heads)
        self.proj = row_linear(tp, proj)
        self.post_attention_norm = make_norm(model)
        self.fc1 = column_linear(tp, fc1)
        self.fc2 = row_linear(tp, fc2)

    @staticmethod
    def _full_weights(model: ModelConfig, init_seed: int) -> tuple[torch.Tensor, ...]:
        # Megatron's init: N(0, std) for inputs to the residual branch, std / sqrt(2L) for the
        # projections that write into the residual stream; biases zero. Full (T=1) matrices,
        # drawn in this order whatever T is; each rank keeps its shard.
        gen = init_generator(init_seed)
        h, f = model.hidden_size, model.ffn_hidden_size
        std = model.init_method_std
        out_std = std / math.sqrt(2.0 * model.num_layers)
        shapes = (((3 * h, h), std), ((h, h), out_std), ((f, h), std), ((h, f), out_std))
        return tuple(draw_normal(shape, s, gen) for shape, s in shapes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(self.input_norm(x)).view(b, s, 3, self.num_local_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=2))  # each (b, nh/T, s, hd)
        p = self.attention_dropout if self.training else 0.0
        with self.attention_stream.fork() if p > 0.0 else contextlib.nullcontext():
            attn = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        attn = attn.transpose(1, 2).reshape(b, s, self.num_local_heads * self.head_dim)
        x = x + dropout(self.proj(attn), self.hidden_dropout, self.training, self.hidden_stream)
        mlp = self.fc2(F.gelu(self.fc1(self.post_attention_norm(x))))
        return x + dropout(mlp, self.hidden_dropout, self.training, self.hidden_stream)
