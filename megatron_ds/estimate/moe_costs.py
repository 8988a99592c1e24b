"""A mixture-of-experts layer's MLP half on one rank: its capacity, the activations it saves, its FLOPs and its
all-to-all traffic, read off DeepSpeed's MoE layer as installed (0.19.8, `deepspeed/moe/sharded_moe.py`,
`experts.py`, `layer.py`) around our MLP (`megatron_ds.model.moe`). Pure: no torch.

Per micro-batch a rank routes its own S = b s tokens (sequence-first, T = 1). The gate is an fp32 linear h -> E
(`TopKGate.forward`: `input.float()`, `wg.weight.float()`; Megatron-LM's router, `moe.megatron_router`, is the same
linear into `topkgating` without dropping) and a softmax; `_capacity` gives every expert
C = max(ceil(k S / E x capacity factor), min capacity) slots (top-2 passes 2 x the factor). Without token dropping
C is the most tokens any expert got, data-dependent: planned here as the balanced ceil(k S / E), which a skewed
router exceeds. DeepSpeed 0.19.8 routes sparsely: `_sparse_encode` gathers the tokens into an (E, C, h) buffer
(`index_select`, no matmul: the one-hot dispatch einsum of earlier releases, S x E x C x h multiply-adds each way,
is gone), the first all-to-all over the E-rank expert-parallel group exchanges it, each of the E / EP local
experts runs our MLP on its EP x C slots (all E x C slots are computed, empty ones too), the second all-to-all
brings the outputs back and `_sparse_decode` gathers each token's k results and sums them weighted by the fp32
gate values. Backward runs the two all-to-alls again. PR-MoE (`--mlp-type residual`) adds a dense MLP and a
two-way softmax coefficient on the same tokens, and mixes the two outputs. Megatron-LM's shared expert
(`--moe-shared-expert-intermediate-size` N, `moe.SharedExpert`) runs a dense MLP of width N over every token (and
with `--moe-shared-expert-gate` an h -> 1 linear and a sigmoid scaling it) and adds its output to the experts'.

Saved for backward (equal to the bytes the autograd graph of the layer's output and load-balancing loss keeps
on CPU, tests/unit/test_plan_moe.py), w the compute
dtype's bytes, f the FFN size, `saved_features` the activation's saved inputs per feature:
  gate input, fp32 copy                4 S h    (and, in 16-bit, the gate weight's fp32 copy, 4 h E)
  gate probabilities                   4 S E    (the softmax output)
  route masks                          top-1: the int64 one-hot, 8 S E; top-2: two fp32 ones, 8 S E, and
                                       the sum of each token's two gate values (the clamp's input), 4 S;
                                       Megatron-LM's router (`topkgating`): the bool mask, S E, the masked and
                                       the renormalized gates, 8 S E, the sum and its clamp, 8 S, the int64
                                       top-k index, 8 k S; with --moe-router-pre-softmax
                                       (`moe.pre_softmax_gating`) the int64 top-k index alone, 8 k S
  load-balancing loss                  4 E (the routed share per expert) and 8 k (the int64 factors E, and E again
                                       for top-2, it is multiplied by; three, E, E and k, for Megatron-LM's router)
  dispatch index                       8 (E C + 1)  (int64 slot sources, one scratch slot)
  expert inputs                        E C h w, saved_features E C f w, E C f w  (fc1, activation, fc2)
  combine                              k S h w (the gathered outputs), 4 k S (gates), 8 k S (slots)
  PR-MoE                               2 S h w (the residual fc1's and the coefficient's contiguous copies of
                                       the (s, b, h) input), saved_features S f w, S f w, 2 S w (the
                                       coefficient softmax), 2 S h w (both mixed outputs)
  shared expert (N its width)          S h w (its fc1's input, the norm's output), saved_features S N w, S N w;
                                       gated: S w (the sigmoid's output) and S h w (the output it scales)
These replace the dense MLP's fc1 input, activation inputs and fc2 input; the norms, attention and residual
dropout of the layer are the dense layer's.
"""

from __future__ import annotations

import math

from megatron_ds.config import ModelConfig
from megatron_ds.model import activations

INDEX_BYTES = 8
"""int64 indices (one-hot masks, slot sources)."""
FP32 = 4


def capacity(model: ModelConfig, tokens: int, num_experts: int) -> int:
    """Slots per expert for `tokens` tokens on one rank (`sharded_moe._capacity`; balanced without dropping)."""
    k = model.moe_top_k
    if not model.moe_token_dropping:
        return min(tokens, math.ceil(k * tokens / num_experts))
    return max(math.ceil(tokens / num_experts * model.moe_train_capacity_factor * k), model.moe_min_capacity)


def mlp_terms(model: ModelConfig, micro_batch_size: int, num_experts: int, w: int) -> dict[str, float]:
    """Bytes one MoE layer's MLP half saves for one micro-batch on one rank (the module docstring's table)."""
    s_tok = micro_batch_size * model.seq_length
    h, f, e, k = model.hidden_size, model.ffn_hidden_size, num_experts, model.moe_top_k
    slots = e * capacity(model, s_tok, e)
    saved = activations.find(model.activation).saved_features
    terms = {
        "gate input (fp32)": FP32 * s_tok * h + (FP32 * h * e if w < FP32 else 0),
        "gate probabilities": FP32 * s_tok * e,
        "route masks": _route_mask_bytes(model, s_tok, e),
        "load-balancing loss": FP32 * e + INDEX_BYTES * (k if model.moe_router == "deepspeed" else 3),
        "dispatch index": INDEX_BYTES * (slots + 1),
        "expert fc1 inputs": slots * h * w,
        f"expert {model.activation} inputs": saved * slots * f * w,
        "expert fc2 inputs": slots * f * w,
        "combine (gathered outputs, gates, slots)": k * s_tok * (h * w + FP32 + INDEX_BYTES),
    }
    if model.mlp_type == "residual":
        terms["residual MLP"] = 2 * s_tok * h * w + saved * s_tok * f * w + s_tok * f * w
        terms["residual mixing"] = 2 * s_tok * w + 2 * s_tok * h * w
    n = model.moe_shared_expert_size
    if n:
        terms["shared expert"] = s_tok * h * w + saved * s_tok * n * w + s_tok * n * w
    if model.moe_shared_expert_gate:
        terms["shared expert gate"] = s_tok * w + s_tok * h * w
    return terms


def _route_mask_bytes(model: ModelConfig, s_tok: int, e: int) -> int:
    """What the gate saves of its choices (the module docstring's table)."""
    k = model.moe_top_k
    if model.moe_router_pre_softmax:  # moe.pre_softmax_gating: the top-k's int64 index alone
        return INDEX_BYTES * k * s_tok
    if model.moe_router == "megatron":  # topkgating: bool mask, masked and renormalized gates, sums, gather index
        return s_tok * e + 2 * FP32 * s_tok * e + 2 * FP32 * s_tok + INDEX_BYTES * k * s_tok
    return INDEX_BYTES * s_tok * e if k == 1 else 2 * FP32 * s_tok * e + FP32 * s_tok


def mlp_flops(model: ModelConfig, micro_batch_size: int, num_experts: int, active: bool = False) -> dict[str, int]:
    """Forward matmul FLOPs of one MoE layer's MLP half for one micro-batch on one rank: what runs (`active` False:
    every one of the E x C slots, empty ones too), or what the tokens use (`active`: k experts per token, the model
    FLOPs of the throughput line). Backward is twice each."""
    s_tok = micro_batch_size * model.seq_length
    h, f, e = model.hidden_size, model.ffn_hidden_size, num_experts
    rows = model.moe_top_k * s_tok if active else e * capacity(model, s_tok, e)
    fc1 = model.fc1_rows
    out = {"gate": 2 * s_tok * h * e, "expert fc1": 2 * rows * h * fc1, "expert fc2": 2 * rows * f * h}
    if model.mlp_type == "residual":
        out.update(
            {"residual fc1": 2 * s_tok * h * fc1, "residual fc2": 2 * s_tok * f * h, "coefficient": 4 * s_tok * h}
        )
    return {**out, **shared_expert_flops(model, s_tok)}


def shared_expert_flops(model: ModelConfig, tokens: int) -> dict[str, int]:
    """Forward matmul FLOPs of the shared expert (`moe_shared_expert_size` N) over `tokens` tokens: fc1 h -> N (2 N
    gated), fc2 N -> h, and its gate h -> 1; none without it."""
    n, h = model.moe_shared_expert_size, model.hidden_size
    if not n:
        return {}
    out = {
        "shared expert fc1": 2 * tokens * h * (2 * n if model.gated_mlp else n),
        "shared expert fc2": 2 * tokens * n * h,
    }
    if model.moe_shared_expert_gate:
        out["shared expert gate"] = 2 * tokens * h
    return out


def all_to_all_bytes(model: ModelConfig, micro_batch_size: int, num_experts: int, w: int) -> float:
    """Bytes one rank hands one of the layer's all-to-alls: its (E, C, h) buffer (two per forward, two per backward)."""
    s_tok = micro_batch_size * model.seq_length
    return num_experts * capacity(model, s_tok, num_experts) * model.hidden_size * w


def forward_working_set(model: ModelConfig, micro_batch_size: int, num_experts: int, ep: int, w: int) -> float:
    """Bytes one MoE layer holds at once in a forward under no_grad (knowledge distillation's teacher), one micro-batch
    on one rank: the layer's input and attention output (2 S h w, as a dense layer's) and the largest of the gate's
    fp32 copy of the tokens and its logits and probabilities; the all-to-all's input and output (2 E C h w); the
    experts' pass (`MOELayer.forward` keeps the exchanged (E, C, h) buffer; `Experts.forward` runs each of the E / EP
    local experts on its EP x C slots, keeping the outputs so far, then concatenates them: 3 E C h w at the end, or
    the buffer, the earlier outputs and one expert's fc1 output and activation); PR-MoE's residual MLP beside the
    experts' output; the shared expert after them (their output, the norm's output, its fc1 output and activation)."""
    s_tok = micro_batch_size * model.seq_length
    h, e = model.hidden_size, num_experts
    slots, local = e * capacity(model, s_tok, e), e // ep
    one_expert = slots / local * (model.fc1_rows + model.ffn_hidden_size) * w
    options = [
        FP32 * s_tok * h + 2 * FP32 * s_tok * e,
        3 * slots * h * w,
        (2 - 1 / local) * slots * h * w + one_expert,
    ]
    if model.mlp_type == "residual":
        options.append(s_tok * h * w + s_tok * (model.fc1_rows + model.ffn_hidden_size) * w)
    n = model.moe_shared_expert_size
    if n:  # after the experts: their output, the norm's output and the shared expert's fc1 output and activation
        options.append(2 * s_tok * h * w + s_tok * ((2 * n if model.gated_mlp else n) + n) * w)
    return 2 * s_tok * h * w + max(options)
