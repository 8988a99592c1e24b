"""What one layer's core attention saves for backward, from the QKV output to the output projection's input
(`attention_terms`, the attention's share of `activation_memory.transformer_layer_terms`), and what its backward and
its recomputation allocate beside that (`attention_backward_bytes`, `recomputed_attention_bytes`); which of a layer's
terms its backward has freed on reaching the core attention (`mlp_half_bytes`, `MLP_HALF`). Byte widths and
splits: `activation_kernels.py`.

The core attention: Korthikanti et al.'s 5as/h term (softmax output 2, dropout mask 1, dropout output 2 bytes per
a*s*s*b element) is stored only by the "math" SDPA path. The flash and memory-efficient SDPA
kernels (CUDA; and torch's CPU flash kernel, which runs when attention dropout is 0) save the
output and a float32 log-sum-exp of b*a*s instead of any s*s matrix. Our layer's output
projection reads a view of that output, so it is counted once, as in the paper.

Packed documents (`--reset-attention-mask`): SDPA gets a boolean (b, 1, s, s) mask instead of `is_causal`. The
fused kernels save it converted to the compute dtype, b*s*s*w bytes per layer, the same on every tensor rank (it has
one head); the math path saves nothing more (its softmax output already holds the masked scores); selective
recomputation keeps the boolean mask, b*s*s bytes, as an input of the recomputed core attention (measured on CPU:
flash path fp32 and bf16, math path, selective). (The id tensors that travel with the activations:
`activation_memory.py`.)

Sliding windows (`window`: a layer's entry of `ModelConfig.layer_windows`): the layer runs its queries in chunks
(`megatron_ds.model.sliding_window`), each SDPA call under a boolean band mask. What is saved is then counted per
chunk, P = `computed_pairs` scores per head and sample instead of s^2 (measured on CPU, fp32 and bf16, both paths):
the fused kernels keep each chunk's output (a tensor of its own: `torch.cat` copies them into the projection's
input) and its mask in the compute dtype, (chunk, keys) per chunk, P x w bytes, one for all heads and samples, or
b x P x w combined with packed documents' mask (the whole (b, 1, s, s) mask is then never an SDPA input); the math
path saves the chunk's float32 copies of q and of its keys' slice of k and v, and a x b x P probabilities (and
dropout mask and output), nothing of the mask. The CUDA figures (memory-efficient kernel, as the mask rules out
flash) follow the same rules and are not measured.

Grouped-query attention, rotary embeddings and `--qk-layernorm` (measured on CPU, fp32 and bf16, both paths, windowed
and selective; widths per token and tensor rank: query heads x head size q, kv heads x head size k_v):
* the QKV output is q + 2 k_v wide; where the core attention keeps views of it (flash path, selective
  recomputation) it keeps all of it (v, and q and k unless rotary or the norms made new ones, are views). CPU's math
  path copies q and k and v repeated to every query head (3 q wide, float32) and keeps none of it; under Ulysses the
  attention keeps the all-to-all's outputs (q + 2 k_v wide again).
* rotary embeddings (and the head norms) make new q and k (q + k_v wide), which the attention keeps where it keeps
  its inputs; each `apply_rotary` (one for q, one for k) saves its cos and sin, (s, rotary_dim) in the compute
  dtype (per sample with packed documents' position ids; this rank's tokens under Ulysses, whole on every tensor
  rank).
* the query and key norms save their input, a view of the QKV output (counted once, and on its own only where the
  attention does not keep it), and their statistics per token and head (`activation_kernels.norm_saved`);
  `--qk-l2-norm`'s weightless norm computes in float32, so it saves a float32 input (a copy of a 16-bit one) and a
  float32 rsqrt per token and head.
"""

from __future__ import annotations

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.estimate.activation_kernels import SavedWidths, Split, norm_saved
from megatron_ds.model import norms, sliding_window


def attention_terms(
    model: ModelConfig,
    b: int,
    k: SavedWidths,
    sp: Split,
    *,
    dropout: bool,
    document_mask: bool,
    window: int | None,
    position_ids: bool,
) -> dict[str, float]:
    """Saved bytes of one layer's attention between the QKV output and the projection's input, for `b` samples, by
    tensor: rotary embeddings' and the head norms', the core attention's (whole, or chunk by chunk under a
    `window`), packed documents' mask (`document_mask`); `dropout`: attention dropout is on (module docstring)."""
    s = model.seq_length
    terms = _query_key_terms(model, b, k, sp, position_ids)
    left = sliding_window.effective(window, s)
    if left is None:
        terms.update(_attention_terms(model, b, sp, k, dropout))
        if document_mask:
            terms["document mask"] = document_mask_bytes(b, s, k, sp)
        return terms
    terms.update(_window_terms(model, b, sp, k, dropout, left, document_mask))
    if document_mask and sp.selective:  # the checkpointed core attention's input, the whole boolean mask
        terms["document mask"] = document_mask_bytes(b, s, k, sp)
    return terms


def document_mask_bytes(b: int, s: int, k: SavedWidths, split: Split) -> float:
    """What one layer keeps of `--reset-attention-mask`'s (b, 1, s, s) mask (module docstring): the boolean mask
    under selective recomputation, the fused kernels' copy in the compute dtype, nothing on the math path. Ulysses
    is refused with the flag; under sequence parallelism attention sees the whole sequence."""
    if split.selective:
        return float(b * s * s)
    return float(b * s * s * k.w) if k.attention == "flash" else 0.0


def _keeps_qkv_output(sp: Split, k: SavedWidths) -> bool:
    """Whether the core attention keeps views of the QKV output (v always; q and k unless rotary embeddings or the head
    norms made new ones) among its saved inputs: not under Ulysses (it attends the all-to-all's outputs) nor on CPU's
    math path (its own float32 copies)."""
    return sp.ulysses == 1 and (sp.selective or k.attention == "flash" or not k.qkv_copies)


def _qkv_output_bytes(model: ModelConfig, b: int, k: SavedWidths, sp: Split) -> float:
    """The QKV output, (query heads + 2 kv heads) x head size wide (`ModelConfig.qkv_rows`); under Ulysses the same
    bytes as the all-to-all's q, k, v outputs."""
    return model.seq_length * b * model.qkv_rows * k.w / sp.split


def _query_key_terms(model: ModelConfig, b: int, k: SavedWidths, sp: Split, position_ids: bool) -> dict[str, float]:
    """What rotary embeddings and the head norms (--qk-layernorm's, --qk-l2-norm's) save between the QKV output and
    the core attention (module docstring)."""
    s, t, hd = model.seq_length, sp.split, model.head_dim
    heads = model.num_attention_heads + model.kv_heads  # the query and key heads rotary and the norms act on
    kept = _keeps_qkv_output(sp, k)
    terms: dict[str, float] = {}
    if model.use_rotary_position_embeddings:  # q's and k's apply_rotary each save a cos and a sin
        rows = b * s if position_ids else s  # (s, r) angles, or each sample's (b, 1, s, r) looked up by position
        terms["rotary cos, sin"] = 4 * rows * model.rotary_dim * k.w / sp.ulysses
    head_norm = norms.head_norm(model)
    if (model.use_rotary_position_embeddings or head_norm is not None) and kept:
        terms["q, k after rotary or norms"] = s * b * heads * hd * k.w / t  # new tensors the attention keeps
    if head_norm is None:
        return terms
    elements = s * b * heads * hd / t
    norm_input, norm_output, norm_stats = norm_saved(head_norm, k, elements, s * b * heads / t)
    if norm_input != elements * k.w:  # a float32 copy of 16-bit q and k (composite RMSNorm, L2Norm)
        terms["query and key norm inputs"] = norm_input
    elif not kept:  # their input is a view of the QKV output, kept whole
        terms["query and key norm inputs"] = _qkv_output_bytes(model, b, k, sp)
    terms["query and key norm statistics"] = norm_stats
    if norm_output:  # CPU's composite RMSNorm
        terms["query and key norm outputs"] = norm_output
    return terms


def _math_inputs(model: ModelConfig, b: int, sp: Split, k: SavedWidths, key_rows: int) -> float:
    """What the math path keeps of q, k, v, whose keys span `key_rows` rows (s, or a window's chunks' keys summed):
    CPU's float32 copies of q and of k and v repeated to every query head; CUDA's views of the QKV output and, with
    grouped kv heads, the repeated k and v (not measured)."""
    s, q, t = model.seq_length, model.query_size, sp.split
    if k.qkv_copies:
        return (s + 2 * key_rows) * b * q * k.math_bytes / t
    repeated = 2 * key_rows * b * q * k.w / t if model.kv_heads < model.num_attention_heads else 0
    return _qkv_output_bytes(model, b, k, sp) + repeated


def _attention_terms(model: ModelConfig, b: int, sp: Split, k: SavedWidths, dropout: bool) -> dict[str, float]:
    # q: the attention's width, heads x head size (`ModelConfig.query_size`; the hidden size unless --kv-channels)
    s, q, a, t = model.seq_length, model.query_size, model.num_attention_heads, sp.split
    sbh, scores = s * b * q, a * s * s * b
    qkv = _qkv_output_bytes(model, b, k, sp)
    if sp.selective:  # the checkpointed core attention keeps its inputs only (views of the qkv output)
        return {"q, k, v": qkv}
    if k.attention == "flash":
        # q, k, v are views of the qkv output, saved whole; plus float32 log-sum-exp per (b, head, s).
        out = {"q, k, v": qkv, "softmax log-sum-exp": 4 * b * a * s / t}
        # The projection reads a view of the kernel's output unless it reads the all-to-all's result (Ulysses), or
        # copies it: the output takes the query's memory layout (torch's CPU kernel; flash-attention's
        # empty_like(q)), and partial rotary's concatenation leaves q in (b, heads, s, hd) order, not (b, s, ..).
        partial_rotary = model.use_rotary_position_embeddings and model.rotary_dim < model.head_dim
        if sp.ulysses > 1 or partial_rotary:
            out["attention output (flash)"] = sbh * k.w / t
        return out
    out = {"q, k, v": _math_inputs(model, b, sp, k, s), "softmax output": scores * k.math_bytes / t}
    if dropout:
        out["attention dropout mask"] = scores * k.attn_mask / t
        out["attention dropout output"] = scores * k.math_bytes / t
    return out


def _window_terms(
    model: ModelConfig, b: int, sp: Split, k: SavedWidths, dropout: bool, left: int, document_mask: bool
) -> dict[str, float]:
    """`_attention_terms` of a windowed layer, chunk by chunk (module docstring)."""
    s, q, a, t = model.seq_length, model.query_size, model.num_attention_heads, sp.split
    qkv = _qkv_output_bytes(model, b, k, sp)
    if sp.selective:
        return {"q, k, v": qkv}
    pairs = sliding_window.computed_pairs(s, left)
    if k.attention == "flash":
        mask = pairs * (b if document_mask else 1) * k.w  # one (chunk, keys) mask, or (b, 1, chunk, keys)
        return {
            "q, k, v": qkv,
            "softmax log-sum-exp": 4 * b * a * s / t,
            "attention output (flash)": s * b * q * k.w / t,  # the chunks' outputs
            "window mask": float(mask),
        }
    scores = a * b * pairs
    # each chunk's q rows and its keys' k and v rows
    out = {"q, k, v": _math_inputs(model, b, sp, k, sliding_window.chunk_keys(s, left))}
    out["softmax output"] = scores * k.math_bytes / t
    if dropout:
        out["attention dropout mask"] = scores * k.attn_mask / t
        out["attention dropout output"] = scores * k.math_bytes / t
    return out


def recomputed_attention_bytes(
    model: ModelConfig,
    micro_batch_size: int,
    k: SavedWidths,
    split: Split,
    *,
    regularization: RegularizationConfig,
    window: int | None = None,
) -> float:
    """What recomputing one layer's core attention in backward allocates for one micro-batch (selective
    recomputation): what it would save besides q, k, v (views of the qkv output, kept), and on the flash
    path its output, a new tensor then (under Ulysses already one of the terms; windowed: the chunks' outputs
    are, their concatenation is new)."""
    s, b, h = model.seq_length, micro_batch_size, model.query_size  # the attention's width
    whole = Split(split.tensor, split.sequence_parallel, split.ulysses, selective=False)
    dropout, left = regularization.attention_dropout > 0, sliding_window.effective(window, s)
    if left is None:
        full = _attention_terms(model, b, whole, k, dropout)
    else:
        full = _window_terms(model, b, whole, k, dropout, left, False)
    views = _qkv_output_bytes(model, b, k, whole)  # the kept inputs (or the all-to-all's outputs)
    if k.attention == "math":  # CPU's math path copies q, k, v itself: all of it is new
        return sum(full.values()) - (0 if k.qkv_copies else views)
    # the kernel's output, new then, unless already a term (Ulysses, partial rotary: the projection reads a copy)
    output = 0 if "attention output (flash)" in full and left is None else s * b * h * k.w / whole.split
    return sum(full.values()) - views + output


_ATTENTION_HALF = (
    "norm inputs",
    "norm statistics",
    "norm outputs",
    "norm weights + 1",
    "residual dropout masks",
    "qkv input",
    "projection input",
    "q, k, v",
    "rotary cos, sin",
    "q, k after rotary or norms",
    "query and key norm inputs",
    "query and key norm statistics",
    "query and key norm outputs",
    "softmax log-sum-exp",
    "attention output (flash)",
    "softmax output",
    "attention dropout mask",
    "attention dropout output",
    "document mask",
    "window mask",
)
"""Terms of `activation_memory.transformer_layer_terms` outside the MLP half (the shared norm and dropout terms split
below); every other term (a dense MLP's, or a mixture-of-experts layer's, `moe_costs.mlp_terms`) belongs to the MLP
half."""
MLP_HALF = ("fc1 input", "fc2 input")
"""Terms of `activation_memory.transformer_layer_terms` that belong to the MLP half of the layer (with the
activation's inputs, and half of the norm and residual-dropout terms): freed once the layer's MLP backward has run."""


def mlp_half_bytes(terms: dict[str, float], activation: str) -> float:
    """What a layer's backward has freed when it reaches the core attention: the MLP half of `terms`."""
    halves = ("norm inputs", "norm statistics", "norm outputs", "residual dropout masks")
    mlp = sum(v for n, v in terms.items() if n in (*MLP_HALF, f"{activation} inputs") or n not in _ATTENTION_HALF)
    return mlp + sum(terms.get(n, 0.0) for n in halves) / 2


def attention_backward_bytes(
    model: ModelConfig, micro_batch_size: int, k: SavedWidths, split: Split, window: int | None = None
) -> float:
    """The largest gradient the core attention's backward allocates while what it saved is alive: on the math
    path the gradient of the attention probabilities, (b, a/t, s, s) in the math dtype (measured on CPU:
    four s x s blocks alive at the peak, three saved and this one), under a `window` its largest chunk's; the
    flash kernels keep no s x s tensor."""
    if k.attention != "math":
        return 0.0
    s, left = model.seq_length, sliding_window.effective(window, model.seq_length)
    pairs = s * s if left is None else sliding_window.largest_chunk_pairs(s, left)
    return model.num_attention_heads * pairs * micro_batch_size * k.math_bytes / split.split
