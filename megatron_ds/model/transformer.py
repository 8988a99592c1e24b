"""Pre-LN GPT transformer layer: causal self-attention through torch's SDPA, then an MLP whose
activation is an entry of `megatron_ds.model.activations` (tanh or exact GeLU, SwiGLU).

Options (ModelConfig): grouped-query attention (`num_key_value_heads`: kv heads shared by groups
of nh/kv query heads), rotary embeddings on q and k (base `rotary_base`, on the first `rotary_dim`
channels of each head; Llama 3.x's frequency scaling with `use_rope_scaling`), a norm on each query and key head
before rotary (`qk_layernorm`, or the weightless L2 norm of `qk_l2_norm`), the MLP activation, no biases in the linears; a mixture-of-experts MLP (DeepSpeed's MoE layer, `megatron_ds.model.moe`) on the layers that have experts, with
Megatron-LM's shared expert beside it (`moe_shared_expert_size`).
Dropout probabilities and the init std come from RegularizationConfig; the weight shapes from
`megatron_ds.model.shapes.layer_linear_shapes` (the same shapes the parameter counts use).

At T > 1 the same layer runs on each tensor rank with megatron-core's parallel linears: QKV and
fc1 are column-parallel (this rank's heads / MLP features), proj and fc2 row-parallel (their
outputs summed over tensor ranks), norms (the per-head query and key norms too) and row-parallel biases replicated. Each rank attends
with its own nh/T query heads and kv/T key/value heads (those of its groups); the fused QKV
shard holds exactly their rows, and a SwiGLU fc1 shard its block of the gate and of the up half
(`megatron_ds.model.init.shard_fused`), so the code below is the same for every T.

Split sequences (the shapes in and out of the layer):
  * Megatron's sequence parallelism: (s/T, b, h), sequence-first, this rank's part; QKV and fc1
    all-gather the sequence, proj and fc2 reduce-scatter it back (megatron-core's linears), so
    attention sees the whole sequence of this rank's heads; norms and residual dropout see the part.
  * DeepSpeed-Ulysses: (b, s/N, h); q, k, v of this rank's tokens (rotary at their positions) go
    through DeepSpeed's `DistributedAttention` (an all-to-all to the whole sequence of nh/N heads and
    back, `megatron_ds.model.ulysses`).
Residual dropout of a part draws the whole tensor's mask (`rng.dropout`): the result does not depend
on how the sequence is split.

Packed documents (`megatron_ds.model.documents`): the layer takes and returns (x, position_ids, document_ids); rotary
embeddings rotate each token by its position id, and with `document_mask` (`--reset-attention-mask`) SDPA takes the
boolean mask "same document and not later" (b, 1, s, s), built here from the document ids, instead of `is_causal`.
With experts on the pipeline engine the aggregated load-balancing loss travels last in the tuple (`moe_loss`).

Sliding-window attention (`window`: this layer's entry of `ModelConfig.layer_windows`, Megatron-LM's
`--window-size`): each query attends its window's keys only, combined with a document mask
(`megatron_ds.model.sliding_window`); the attention sees the whole sequence of its heads under every
parallelism above, so T, sequence parallelism, Ulysses and P do not change what it attends.

Selective recomputation (`selective_recompute`, Megatron's `--recompute-granularity selective`): the
core attention (SDPA: scores, softmax, attention dropout, the product with v) runs under DeepSpeed's
activation checkpointing, which keeps q, k, v and replays the attention-dropout stream in backward.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.model import activations, documents, moe, moe_loss, sliding_window
from megatron_ds.model.init import draw_normal, init_generator, qkv_row_parts
from megatron_ds.model.layers import make_head_norm, make_norm
from megatron_ds.model.rng import Stream, dropout, register_streams
from megatron_ds.model.rotary import apply_rotary, rotary_angles
from megatron_ds.model.shapes import layer_linear_shapes
from megatron_ds.model.tensor_parallel import NO_TENSOR_PARALLEL, TensorParallel, column_linear, row_linear
from megatron_ds.model.tensor_parallel_rank import NO_ULYSSES, UlyssesGroup


def linear_stds(model: ModelConfig, std: float) -> dict[str, float]:
    """Megatron's init of a layer's linears: N(0, std) for the inputs to the residual branch (qkv, fc1), std / sqrt(2L)
    for the projections that write into the residual stream (proj, fc2); biases zero. Each expert of Megatron-LM's
    router is drawn by the same rules (`moe.draw_experts_apart`)."""
    out_std = std / math.sqrt(2.0 * model.num_layers)
    return {"qkv": std, "proj": out_std, "fc1": std, "fc2": out_std}


class TransformerLayer(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)); (b, s, h) in and out, replicated over tensor ranks
    (split sequences: see the module).

    The causal mask is applied inside (SDPA `is_causal`): nothing but the hidden states travels
    between pipeline stages, except the ids of packed documents (`megatron_ds.model.documents`).
    """

    def __init__(
        self,
        model: ModelConfig,
        regularization: RegularizationConfig,
        init_seed: int,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
        ulysses: UlyssesGroup = NO_ULYSSES,
        selective_recompute: bool = False,
        document_mask: bool = False,
        num_experts: int = 1,
        expert_parallel_size: int = 1,
        window: int | None = None,
        moe_loss_carry: tuple[bool, bool] = (False, False),
    ) -> None:
        super().__init__()
        self.takes_moe_loss, self.returns_moe_loss = moe_loss_carry
        """On the pipeline engine with experts: this layer takes / returns the aggregated load-balancing loss
        (`megatron_ds.model.moe_loss`; layer 0 returns it only)."""
        self.document_mask = document_mask
        self.window = window
        """Keys before each query this layer attends (sliding-window attention), None: the whole causal sequence."""
        nh, kv = model.num_attention_heads, model.kv_heads
        assert nh % tp.size == 0 and kv % tp.size == 0 and nh % kv == 0, (nh, kv, tp.size)
        self.num_local_heads = nh // tp.size
        self.num_local_kv_heads = kv // tp.size
        self.head_dim = model.head_dim
        self.rotary = model.use_rotary_position_embeddings
        self.rotary_base = model.rotary_base
        self.rotary_dim = model.rotary_dim
        self.rope_scaling_factor = model.rope_scaling_factor if model.use_rope_scaling else None
        self.activation = activations.find(model.activation).function
        self.hidden_dropout = regularization.hidden_dropout
        self.attention_dropout = regularization.attention_dropout
        self.sequence_first = tp.sequence_parallel
        self.shard = tp.shard if tp.sequence_parallel else ulysses.shard
        self.ulysses = ulysses
        self.selective_recompute = selective_recompute
        # Dropout on the residual branches is the same on every tensor rank and equal to T=1's
        # (split or not); attention dropout acts on this rank's heads only.
        self.hidden_stream = Stream.replicated(init_seed)
        self.attention_stream = Stream.tensor_parallel(init_seed, tp.rank if ulysses.size == 1 else ulysses.rank)
        register_streams(self, self.hidden_stream, self.attention_stream)
        gen = init_generator(init_seed)
        qkv, proj, fc1, fc2 = self._full_weights(model, regularization.init_method_std, gen)
        # Registration order = parameter order (optimizer state, ZeRO partitions): keep it.
        self.input_norm = make_norm(model, tp)
        bias = model.has_bias  # QKV may have one alone (--add-qkv-bias): split over tensor ranks with its rows
        self.qkv = column_linear(tp, qkv, bias("qkv"), fused_rows=qkv_row_parts(qkv.shape[0], nh, kv))
        # --qk-layernorm: one norm over head_dim shared by every query head, one by every key head (megatron-core's
        # q_layernorm / k_layernorm, registered after linear_qkv as there); --qk-l2-norm: the weightless L2Norm
        self.q_norm = make_head_norm(model, tp)
        self.k_norm = make_head_norm(model, tp)
        self.proj = row_linear(tp, proj, bias("proj"))
        self.post_attention_norm = make_norm(model, tp)
        self.moe: nn.Module | None = None
        """DeepSpeed's MoE layer in place of fc1 and fc2 when the layer has experts (`megatron_ds.model.moe`)."""
        self.l_aux: torch.Tensor | None = None
        """The MoE layer's load-balancing loss of the last forward (None without experts)."""
        self.shared_expert: nn.Module | None = None
        """Megatron-LM's shared expert beside the routed ones (`moe.SharedExpert`), its output added to theirs."""
        self.expert_init: tuple[int, float, float] | None = None
        """Megatron-LM's router: (seed, std, output std) its experts are drawn apart with (`moe.draw_experts_apart`)."""
        if num_experts > 1:  # Megatron-DeepSpeed 4efb479: DeepSpeed's MoE around copies of the MLP
            expert = moe.ExpertMLP(fc1, fc2, bias("fc1"), self.activation)
            self.moe = moe.build(model, num_experts, expert_parallel_size, expert, gen, regularization.init_method_std)
            stds = linear_stds(model, regularization.init_method_std)
            self.shared_expert = moe.build_shared_expert(model, self.activation, gen, stds["fc1"], stds["fc2"])
            if model.moe_router == "megatron":
                self.expert_init = (init_seed, stds["fc1"], stds["fc2"])
            return
        ffn = model.ffn_hidden_size
        self.fc1 = column_linear(tp, fc1, bias("fc1"), fused_rows=(ffn, ffn) if model.gated_mlp else None)
        self.fc2 = row_linear(tp, fc2, bias("fc2"))

    @staticmethod
    def _full_weights(model: ModelConfig, std: float, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        # Full (T=1) matrices, drawn in this order whatever T is; each rank keeps its shard. The fused QKV rows are nh
        # query heads, then kv key heads, then kv value heads; a SwiGLU fc1 has the gate, then up.
        stds = linear_stds(model, std)
        return tuple(draw_normal(shape, stds[name], gen) for name, shape in layer_linear_shapes(model).items())

    def forward(self, x: Any) -> Any:
        x, aggregate = moe_loss.take(x, self.takes_moe_loss)
        x, ids = documents.split(x)
        positions = ids[0] if ids else None
        mask = documents.attention_mask(ids[1]) if ids and self.document_mask else None
        x = x + self._residual_dropout(self._attention(self.input_norm(x), positions, mask))
        out = documents.join(x + self._residual_dropout(self.mlp(x)), ids)
        if not self.returns_moe_loss:
            return out
        return moe_loss.give(out, moe_loss.add(aggregate, self.l_aux if self.moe is not None else None, x.device))

    def _residual_dropout(self, y: torch.Tensor) -> torch.Tensor:
        return dropout(y, self.hidden_dropout, self.training, self.hidden_stream, self.shard)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP branch fc2(act(fc1(norm(x)))), or the MoE layer's output on norm(x) (its load-balancing loss kept
        in `l_aux`), without residual or dropout (the dense one also used by inference)."""
        if self.moe is not None:
            normed = self.post_attention_norm(x)
            out, self.l_aux = moe.run(self.moe, normed)
            return out if self.shared_expert is None else out + self.shared_expert(normed)
        return self.fc2(self.activation(self.fc1(self.post_attention_norm(x))))

    def attention_heads(
        self, normed: torch.Tensor, first_position: int = 0, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (b, nh/T, s, hd) and k, v (b, kv/T, s, hd) of tokens at positions first_position.. (q and k normed per
        head with `qk_layernorm` or `qk_l2_norm`, then rotary applied), or at `positions` (b, s) (packed documents' position ids).

        Inference with a KV cache calls this with the position of its first new token.
        """
        qkv = self.qkv(normed)
        if self.sequence_first:  # megatron-core gathered the whole sequence: (s, b, ..) -> (b, s, ..)
            qkv = qkv.transpose(0, 1)
        b, s, _ = qkv.shape
        nq, nkv, hd = self.num_local_heads, self.num_local_kv_heads, self.head_dim
        q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], dim=-1)
        q, k, v = q.view(b, s, nq, hd), k.view(b, s, nkv, hd), v.view(b, s, nkv, hd)
        if self.q_norm is not None and self.k_norm is not None:  # over each head's hd channels, before rotary
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.transpose(1, 2)  # (b, nh/T, s, hd)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # each (b, kv/T, s, hd)
        if self.rotary and positions is not None:  # (s, r) angles looked up per token: (b, 1, s, r)
            angles = rotary_angles(s, self.rotary_dim, q.device, self.rotary_base, self.rope_scaling_factor)
            angles = F.embedding(positions, angles).unsqueeze(1)
            q, k = apply_rotary(q, angles), apply_rotary(k, angles)
        elif self.rotary:
            angles = rotary_angles(
                first_position + s, self.rotary_dim, q.device, self.rotary_base, self.rope_scaling_factor
            )[first_position:]
            q, k = apply_rotary(q, angles), apply_rotary(k, angles)
        return q, k, v

    def _attention(
        self, normed: torch.Tensor, positions: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        # Ulysses: this rank's tokens (b, s/N, h) start at position rank x s/N (packed documents are refused there).
        first = self.ulysses.rank * normed.shape[1] if self.ulysses.size > 1 else 0
        q, k, v = self.attention_heads(normed, first, positions)
        b, nq, s, hd = q.shape
        if self.ulysses.size > 1:
            from megatron_ds.model.ulysses import distributed_attention

            attn = distributed_attention(self.ulysses, self._attend, q, k, v)
        else:
            attn = self._attend(q, k, v, mask)
        if self.sequence_first:  # (b, nh/T, s, hd) -> (s, b, nh/T x hd): proj reduce-scatters the sequence
            return self.proj(attn.permute(2, 0, 1, 3).reshape(s, b, nq * hd))
        return self.proj(attn.transpose(1, 2).reshape(b, s, nq * hd))

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The core attention of (b, heads, s, hd) q, k, v (causal, or under `mask` (b, 1, s, s); within the layer's
        window when it has one); recomputed in backward under selective recomputation."""
        masks = () if mask is None else (mask,)
        if self.selective_recompute and self.training and torch.is_grad_enabled():
            from deepspeed.runtime.activation_checkpointing import checkpointing

            return checkpointing.checkpoint(self.core_attention, q, k, v, *masks)
        return self.core_attention(q, k, v, *masks)

    def core_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Softmax attention of (b, heads, s, hd) q, k, v at positions 0.. (also a KV-cached prompt's)."""
        p = self.attention_dropout if self.training else 0.0
        grouped = k.shape[1] != q.shape[1]  # query head i uses kv head i // (nq / nkv)
        gqa = {"enable_gqa": True} if grouped else {}
        # without a mask, SDPA's causal path; a document mask is causal already (True: attend)
        causal = {"is_causal": True} if mask is None else {"attn_mask": mask}
        with self.attention_stream.fork() if p > 0.0 else contextlib.nullcontext():
            window = sliding_window.effective(self.window, q.shape[2])
            if window is not None:
                return sliding_window.attention(q, k, v, window, mask, p, grouped)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, **causal, **gqa)
