"""Activation bytes one micro-batch leaves saved for backward, per layer spec of our GPT.

Reference: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv:2205.05198), Sec. 4.1-4.2. For a 16-bit transformer layer without recomputation
the paper counts sbh(34 + 5as/h) bytes (s sequence, b micro-batch, h hidden, a heads), and with
t-way tensor parallelism (no sequence parallelism) sbh(10 + 24/t + 5as/(ht)). We apply the same
per-tensor accounting to `megatron_ds.model.transformer.TransformerLayer`, with the byte width of
each saved tensor taken from the kernels that actually run:

* compute dtype width w (2 for bf16/fp16, 4 for fp32) instead of the paper's fixed 2;
* dropout masks: 1 byte (bool) in CUDA's native_dropout, w bytes on CPU (torch saves a mask in
  the input dtype there);
* attention: the paper's 5as/h term (softmax output 2, dropout mask 1, dropout output 2 bytes per
  a*s*s*b element) is stored only by the "math" SDPA path. The flash and memory-efficient SDPA
  kernels (CUDA; and torch's CPU flash kernel, which runs when attention dropout is 0) save the
  output and a float32 log-sum-exp of b*a*s instead of any s*s matrix. Our layer's output
  projection reads a view of that output, so it is counted once, as in the paper.
* torch's CPU math path computes in float32 (also for bf16 inputs) and saves copies of q, k, v.

These CPU rules were read off `torch.autograd.graph.saved_tensors_hooks` on our own layers
(tests/unit/test_memory_model.py repeats that check); the CUDA rules are the kernels' documented
saved tensors and are not measured here. Every number is an estimate.

Splits (`Split`), Sec. 4.2.2 and 5 of the paper: with Megatron's sequence parallelism the "10" terms
(norms, the qkv and fc1 inputs, which megatron-core's linears save split and gather again in
backward, residual dropout masks) are split t ways too, giving sbh/t (34 + 5as/h); selective
recomputation drops what the core attention saves besides q, k, v (the 5as/h term on the math path,
the log-sum-exp on the flash path), giving sbh/t x 34 with sequence parallelism. DeepSpeed-Ulysses
splits every tensor N ways: the sequence outside attention, the heads inside it; its attention
output comes back from the all-to-all as a tensor of its own, beside the one the flash kernel saves.

Packed documents (`--reset-attention-mask`): SDPA gets a boolean (b, 1, s, s) mask instead of `is_causal`. The
fused kernels save it converted to the compute dtype, b*s*s*w bytes per layer, the same on every tensor rank (it has
one head); the math path saves nothing more (its softmax output already holds the masked scores); selective
recomputation keeps the boolean mask, b*s*s bytes, as an input of the recomputed core attention (measured on CPU:
flash path fp32 and bf16, math path, selective). With either packed-documents flag the two int64 id tensors
(`DOCUMENT_ID_BYTES` per token) travel with every activation (pipe buffers, `transients.py`) and are kept by full
recomputation with each checkpointed chunk's input.

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
  attention does not keep it), and their statistics per token and head; `--qk-l2-norm`'s weightless norm computes in
  float32, so it saves a float32 input (a copy of a 16-bit one) and a float32 rsqrt per token and head.
* torch's RMSNorm on CPU is composite (`Kernels.composite_rmsnorm`): it saves its input in float32 (a copy for
  16-bit inputs), x x rstd in float32 and rstd in float32, for the hidden norms as for the head norms; CUDA's fused
  kernel saves the input and rstd (not measured here). A zero-centred norm (`--apply-layernorm-1p`) also saves the
  weight + 1 it computes with.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.estimate.model_states import PRECISION_BYTES
from megatron_ds.model import activations, norms, sliding_window

DEVICES = ("cuda", "cpu")
ATTENTION_KINDS = ("flash", "math")
TOKEN_ID_BYTES = 8  # int64 token ids and labels
LOSS_MASK_BYTES = 4  # float32 loss mask
DOCUMENT_ID_BYTES = 2 * 8  # packed documents: int64 position id and document id per token


@dataclass(frozen=True)
class Kernels:
    """Byte widths of the tensors the forward pass saves, for one device and precision."""

    w: int
    """Compute dtype bytes (hidden states, linear inputs)."""
    mask: int
    """Bytes per residual/embedding dropout-mask element."""
    attention: str
    """`flash` (no s*s tensor saved) or `math` (softmax probabilities saved)."""
    math_bytes: int
    """Bytes per element of the math path's scores (and q/k/v copies on CPU)."""
    attn_mask: int
    """Bytes per attention-dropout-mask element on the math path."""
    qkv_copies: bool
    """Math path saves its own q, k, v copies (CPU) rather than views of the qkv output (CUDA)."""
    stat: int
    """Bytes of one norm statistic (mean or rstd) per token."""
    rng_state: int = 16
    """Bytes of one generator state (`get_rng_state()`): CUDA's Philox seed and offset, the CPU's mt19937 5056."""
    composite_rmsnorm: bool = False
    """RMSNorm runs torch's composite function (CPU), which saves float32 input, output and rstd, rather than a
    fused kernel (module docstring)."""


@dataclass(frozen=True)
class Split:
    """How one rank's share of a layer's activations is cut, and what is recomputed."""

    tensor: int = 1
    """t: heads and MLP features (tensor parallelism)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism: the replicated regions split t ways along the sequence too."""
    ulysses: int = 1
    """N (DeepSpeed-Ulysses): the sequence outside attention, the heads inside it."""
    selective: bool = False
    """The core attention is recomputed in backward (selective recomputation)."""

    @property
    def replicated(self) -> int:
        """Divisor of the activations outside the tensor-parallel regions (the paper's "10")."""
        return (self.tensor if self.sequence_parallel else 1) * self.ulysses

    @property
    def split(self) -> int:
        """Divisor of the activations inside them (the paper's "24" and the attention scores)."""
        return self.tensor * self.ulysses


def as_split(split: Split | int) -> Split:
    """A `Split`, from one or from a tensor-parallel size."""
    return split if isinstance(split, Split) else Split(tensor=split)


def kernels(precision: str, device: str, attention_dropout: float, attention: str | None = None) -> Kernels:
    """The kernel byte widths; `attention` None picks what torch's SDPA dispatch runs."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r} is not one of {', '.join(DEVICES)}")
    if attention is not None and attention not in ATTENTION_KINDS:
        raise ValueError(f"attention {attention!r} is not one of {', '.join(ATTENTION_KINDS)}")
    w = PRECISION_BYTES[precision]
    if device == "cuda":
        # LayerNorm's CUDA kernel saves mean/rstd in float32; native_dropout's mask is bool.
        return Kernels(w=w, mask=1, attention=attention or "flash", math_bytes=w, attn_mask=1, qkv_copies=False, stat=4)
    # CPU: the flash kernel takes no dropout, so SDPA falls back to math when dropout is on.
    chosen = attention or ("math" if attention_dropout > 0 else "flash")
    return Kernels(
        w=w,
        mask=w,
        attention=chosen,
        math_bytes=4,
        attn_mask=4,
        qkv_copies=True,
        stat=w,
        rng_state=5056,
        composite_rmsnorm=True,
    )


def _norm_saved(norm: norms.Norm, k: Kernels, elements: float, rows: float) -> tuple[float, float, float]:
    """(input, output, statistics) bytes one norm saves over `elements` values in `rows` rows: a fused kernel its
    input and statistics (LayerNorm mean + rstd, RMSNorm rstd); torch's composite RMSNorm (CPU) its input as float32
    (a copy for 16-bit inputs, the input itself in fp32), x x rstd in float32 and a float32 rstd; --qk-l2-norm's
    L2Norm, which computes in float32 on every device, its float32 input and a float32 rsqrt."""
    if norm is norms.L2_NORM:
        return 4 * elements, 0.0, 4 * rows
    if k.composite_rmsnorm and norm.megatron_lm == "RMSNorm":
        return 4 * elements, 4 * elements, 4 * rows
    return elements * k.w, 0.0, norm.saved_statistics * rows * k.stat


def _one_plus_weights(model: ModelConfig, k: Kernels, widths: int) -> float:
    """A zero-centred norm (`--apply-layernorm-1p`) computes with weight + 1, a new tensor each forward that the norm
    saves: `widths` channels of them (whole on every rank), in the compute dtype."""
    return widths * k.w if norms.find(model.normalization).zero_centered_gamma else 0.0


def transformer_layer_terms(
    model: ModelConfig,
    micro_batch_size: int,
    k: Kernels,
    split: Split | int = 1,
    *,
    regularization: RegularizationConfig,
    document_mask: bool = False,
    window: int | None = None,
    position_ids: bool = False,
) -> dict[str, float]:
    """Saved bytes of one TransformerLayer for one micro-batch, by tensor (Korthikanti Sec. 4.1 terms);
    dropout masks exist only when `regularization`'s probabilities are > 0. `split`: a `Split`, or the
    tensor-parallel size. `document_mask`: `--reset-attention-mask`'s dense mask; `window`: the layer's sliding
    window; `position_ids`: packed documents' position ids (either flag), by which rotary embeddings rotate (module
    docstring)."""
    sp = as_split(split)
    b, s, h, f = micro_batch_size, model.seq_length, model.hidden_size, model.ffn_hidden_size
    r, t, q = sp.replicated, sp.split, model.query_size
    sbh, bs = s * b * h, s * b
    drop_h = regularization.hidden_dropout > 0
    drop_a = regularization.attention_dropout > 0
    norm_input, norm_output, norm_stats = _norm_saved(norms.find(model.normalization), k, sbh, bs)
    terms = {
        # Replicated over tensor-parallel ranks (the paper's "10"): norm inputs, qkv and fc1 inputs, masks.
        "norm inputs": 2 * norm_input / r,
        "norm statistics": 2 * norm_stats / r,
        "qkv input": sbh * k.w / r,
        "fc1 input": sbh * k.w / r,
        "residual dropout masks": (2 * sbh * k.mask / r) if drop_h else 0,
        # Split over tensor-parallel ranks (the paper's "24/t").
        "projection input": s * b * q * k.w / t,  # heads x head size wide (h unless --kv-channels)
        # GeLU saves its input (the paper's 4h-wide "GeLU input"); SwiGLU fc1's two halves and silu's output.
        f"{model.activation} inputs": activations.find(model.activation).saved_features * s * b * f * k.w / t,
        "fc2 input": s * b * f * k.w / t,
    }
    if norm_output:  # CPU's composite RMSNorm
        terms["norm outputs"] = 2 * norm_output / r
    head_norms = 2 * model.head_dim if model.qk_layernorm else 0
    if one_plus := _one_plus_weights(model, k, 2 * h + head_norms):
        terms["norm weights + 1"] = one_plus
    terms.update(_query_key_terms(model, b, k, sp, position_ids))
    left = sliding_window.effective(window, s)
    if left is None:
        terms.update(_attention_terms(model, b, sp, k, drop_a))
        if document_mask:
            terms["document mask"] = document_mask_bytes(b, s, k, sp)
        return terms
    terms.update(_window_terms(model, b, sp, k, drop_a, left, document_mask))
    if document_mask and sp.selective:  # the checkpointed core attention's input, the whole boolean mask
        terms["document mask"] = document_mask_bytes(b, s, k, sp)
    return terms


def document_mask_bytes(b: int, s: int, k: Kernels, split: Split) -> float:
    """What one layer keeps of `--reset-attention-mask`'s (b, 1, s, s) mask (module docstring): the boolean mask
    under selective recomputation, the fused kernels' copy in the compute dtype, nothing on the math path. Ulysses
    is refused with the flag; under sequence parallelism attention sees the whole sequence."""
    if split.selective:
        return float(b * s * s)
    return float(b * s * s * k.w) if k.attention == "flash" else 0.0


def _keeps_qkv_output(sp: Split, k: Kernels) -> bool:
    """Whether the core attention keeps views of the QKV output (v always; q and k unless rotary embeddings or the head
    norms made new ones) among its saved inputs: not under Ulysses (it attends the all-to-all's outputs) nor on CPU's
    math path (its own float32 copies)."""
    return sp.ulysses == 1 and (sp.selective or k.attention == "flash" or not k.qkv_copies)


def _qkv_output_bytes(model: ModelConfig, b: int, k: Kernels, sp: Split) -> float:
    """The QKV output, (query heads + 2 kv heads) x head size wide (`ModelConfig.qkv_rows`); under Ulysses the same
    bytes as the all-to-all's q, k, v outputs."""
    return model.seq_length * b * model.qkv_rows * k.w / sp.split


def _query_key_terms(model: ModelConfig, b: int, k: Kernels, sp: Split, position_ids: bool) -> dict[str, float]:
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
    norm_input, norm_output, norm_stats = _norm_saved(head_norm, k, elements, s * b * heads / t)
    if norm_input != elements * k.w:  # a float32 copy of 16-bit q and k (composite RMSNorm, L2Norm)
        terms["query and key norm inputs"] = norm_input
    elif not kept:  # their input is a view of the QKV output, kept whole
        terms["query and key norm inputs"] = _qkv_output_bytes(model, b, k, sp)
    terms["query and key norm statistics"] = norm_stats
    if norm_output:  # CPU's composite RMSNorm
        terms["query and key norm outputs"] = norm_output
    return terms


def _math_inputs(model: ModelConfig, b: int, sp: Split, k: Kernels, key_rows: int) -> float:
    """What the math path keeps of q, k, v, whose keys span `key_rows` rows (s, or a window's chunks' keys summed):
    CPU's float32 copies of q and of k and v repeated to every query head; CUDA's views of the QKV output and, with
    grouped kv heads, the repeated k and v (not measured)."""
    s, q, t = model.seq_length, model.query_size, sp.split
    if k.qkv_copies:
        return (s + 2 * key_rows) * b * q * k.math_bytes / t
    repeated = 2 * key_rows * b * q * k.w / t if model.kv_heads < model.num_attention_heads else 0
    return _qkv_output_bytes(model, b, k, sp) + repeated


def _attention_terms(model: ModelConfig, b: int, sp: Split, k: Kernels, dropout: bool) -> dict[str, float]:
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
    model: ModelConfig, b: int, sp: Split, k: Kernels, dropout: bool, left: int, document_mask: bool
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
    k: Kernels,
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


CPU_RNG_STATE_BYTES = 5056
"""torch.get_rng_state() on the CPU (mt19937)."""


def checkpoint_rng_bytes(k: Kernels, tracker_streams: int) -> float:
    """What one call of DeepSpeed's activation checkpointing keeps for its recompute besides its inputs: the
    CPU generator's state, the accelerator's, and every stream of the RNG tracker (`CheckpointFunction.forward`)."""
    return CPU_RNG_STATE_BYTES + k.rng_state * (1 + tracker_streams)


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
"""Terms of `transformer_layer_terms` outside the MLP half (the shared norm and dropout terms split below); every
other term (a dense MLP's, or a mixture-of-experts layer's, `moe_costs.mlp_terms`) belongs to the MLP half."""
MLP_HALF = ("fc1 input", "fc2 input")
"""Terms of `transformer_layer_terms` that belong to the MLP half of the layer (with the activation's inputs,
and half of the norm and residual-dropout terms): freed once the layer's MLP backward has run."""


def mlp_half_bytes(terms: dict[str, float], activation: str) -> float:
    """What a layer's backward has freed when it reaches the core attention: the MLP half of `terms`."""
    halves = ("norm inputs", "norm statistics", "norm outputs", "residual dropout masks")
    mlp = sum(v for n, v in terms.items() if n in (*MLP_HALF, f"{activation} inputs") or n not in _ATTENTION_HALF)
    return mlp + sum(terms.get(n, 0.0) for n in halves) / 2


def attention_backward_bytes(
    model: ModelConfig, micro_batch_size: int, k: Kernels, split: Split, window: int | None = None
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


def korthikanti_layer_bytes(
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    num_heads: int,
    tensor_parallel_size: int = 1,
    sequence_parallel: bool = False,
    selective: bool = False,
) -> float:
    """The paper's closed forms (16-bit, 4h MLP), Sec. 4.2 and 5: sbh(10 + 24/t + 5as/(ht)); with
    sequence parallelism sbh/t (34 + 5as/h); selective recomputation drops the 5as/h term."""
    s, b, h, a, t = seq_length, micro_batch_size, hidden_size, num_heads, tensor_parallel_size
    scores = 0 if selective else 5 * a * s / h
    if sequence_parallel:
        return s * b * h / t * (34 + scores)
    return s * b * h * (10 + 24 / t + scores / t)


def checkpointed_layer_bytes(
    model: ModelConfig,
    micro_batch_size: int,
    k: Kernels,
    split: Split | int = 1,
    document_ids: bool = False,
    partitioned: bool = False,
    on_host: bool = False,
) -> float:
    """With full recomputation only a chunk's input survives: 2sbh in the paper's 16-bit terms (sbh/t with
    sequence parallelism, sbh/N under Ulysses: the layer's input is this rank's part); with packed documents'
    `document_ids` also the whole sample's two int64 id tensors.

    DeepSpeed's options (`training.activation_checkpointing`): `partitioned` (`--partition-activations`) keeps
    1/t of the input on each tensor rank; `on_host` (`--checkpoint-in-cpu`) keeps it in host memory, none on the
    device. Both act on floating-point inputs only: the integer ids stay where they are. (The recompute gathers
    or copies one chunk's input back for its backward, within the recompute's own transient.)"""
    sp = as_split(split)
    ids = model.seq_length * micro_batch_size * DOCUMENT_ID_BYTES if document_ids else 0
    if on_host:
        return ids
    hidden = model.seq_length * micro_batch_size * model.hidden_size * k.w / sp.replicated
    return hidden / (sp.tensor if partitioned else 1) + ids


def pre_terms(
    model: ModelConfig,
    micro_batch_size: int,
    k: Kernels,
    *,
    regularization: RegularizationConfig,
    split: Split | int = 1,
) -> dict[str, dict[str, float]]:
    """Saved bytes of the pre-processing specs, keyed by spec name."""
    sp = as_split(split)
    bs = model.seq_length * micro_batch_size
    dropout = bs * model.hidden_size * k.mask / sp.replicated if regularization.hidden_dropout > 0 else 0
    return {
        "cast_token_ids": {},
        "WordEmbedding": {"token ids (embedding backward)": bs * TOKEN_ID_BYTES / sp.ulysses},
        # spec 2 is PositionEmbedding, or a bare EmbeddingDropout for rotary models (no position table)
        ("PositionEmbedding" if model.add_position_embedding else "EmbeddingDropout"): {
            "embedding dropout mask": dropout
        },
    }


def post_terms(
    model: ModelConfig, micro_batch_size: int, k: Kernels, head_name: str, split: Split | int = 1
) -> dict[str, dict[str, float]]:
    """Saved bytes of the post-processing specs (the loss's saved tensors are put on logits_to_fp32).
    Under sequence parallelism the head's linear saves its input split (and gathers it again in backward)."""
    sp = as_split(split)
    bs = model.seq_length * micro_batch_size
    sbh = bs * model.hidden_size
    bsv = bs * model.vocab_size / (sp.tensor * sp.ulysses)  # vocab-parallel logits under tensor parallelism
    norm_input, norm_output, norm_stats = _norm_saved(norms.find(model.normalization), k, sbh, bs)
    final_norm = {"norm input": norm_input / sp.replicated, "norm statistics": norm_stats / sp.replicated}
    if norm_output:  # CPU's composite RMSNorm
        final_norm["norm output"] = norm_output / sp.replicated
    if one_plus := _one_plus_weights(model, k, model.hidden_size):
        final_norm["norm weight + 1"] = one_plus
    return {
        "FinalNorm": final_norm,
        head_name: {"LM head input": sbh * k.w / sp.replicated},
        # log_softmax saves its float32 output (nll_loss reuses it); the fp32 logits themselves are not
        # saved by autograd but DeepSpeed keeps them as the stage output (see `logits_bytes`). At T > 1
        # the saved softmax is that same storage (`loss_in_logits`). Under Ulysses each rank holds its
        # part of the labels and all of the loss mask.
        "logits_to_fp32": {
            "fp32 log-probabilities": 4 * bsv,
            "labels and loss mask": bs * (TOKEN_ID_BYTES / sp.ulysses + LOSS_MASK_BYTES) + 8,
            **({"vocabulary-parallel target mask": bs - 4} if sp.tensor > 1 else {}),  # bool; one scalar fewer
        },
    }


def logits_bytes(model: ModelConfig, micro_batch_size: int, tensor_parallel_size: int = 1, ulysses: int = 1) -> float:
    """The float32 logits of one micro-batch, which the last stage's pipe buffer keeps until backward."""
    return 4 * model.seq_length * micro_batch_size * model.vocab_size / (tensor_parallel_size * ulysses)


def loss_in_logits(tensor_parallel_size: int) -> bool:
    """Whether the loss works in the float32 logits themselves rather than beside them: megatron-core's
    vocabulary-parallel cross entropy (T > 1; Ulysses runs at T = 1 with torch's). Its forward
    (`_VocabParallelCrossEntropy`, megatron/core/tensor_parallel/cross_entropy.py) takes
    `vocab_parallel_logits.float()` (the tensor itself when it is float32, as `logits_to_fp32`'s output
    is), subtracts the max in place, exponentiates into it (`torch.exp(..., out=exp_logits)`), divides
    in place and saves it as the softmax; its backward makes the logits' gradient in that storage
    (`grad_input = softmax`, `grad_2d[arange_1d, masked_target_1d] -= ...`, `grad_input.mul_`). So a
    micro-batch's saved softmax, its logits' gradient and the logits the pipe buffer keeps are one
    tensor."""
    return tensor_parallel_size > 1


def loss_backward_transient(
    model: ModelConfig, micro_batch_size: int, tensor_parallel_size: int = 1, ulysses: int = 1, compute_bytes: int = 4
) -> float:
    """Gradient buffers the loss backward allocates for one micro-batch beyond what it saved. torch's
    cross entropy (T = 1): d(log-probs) and d(logits), float32 b*s*v each (nll_loss and log_softmax
    backward). The vocabulary-parallel one (T > 1, `loss_in_logits`): none of its own; with 16-bit
    activations (`compute_bytes` < 4) the backward of `logits_to_fp32`'s cast (ToCopyBackward0) makes the
    gradient of the 16-bit logits, b*s*v/t of them."""
    fp32 = logits_bytes(model, micro_batch_size, tensor_parallel_size, ulysses)
    if loss_in_logits(tensor_parallel_size):
        return 0.0 if compute_bytes >= 4 else fp32 * compute_bytes / 4
    return 2 * fp32
