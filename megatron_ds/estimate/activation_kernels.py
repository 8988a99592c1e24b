"""How the activation terms are counted: the byte widths of what the kernels that run save (`SavedWidths`, for one device
and precision) and how one rank's share of a layer is cut (`Split`). `activation_memory.py` (a layer's terms outside
the core attention, the pre- and post-processing specs) and `attention_activations.py` (the core attention's) read
both; this module owns the byte-size constants they share and what a norm saves (`norm_saved`).

Widths (`kernels`), each from the kernel that runs, where Korthikanti et al. (`activation_memory.py`) count 16 bits:

* compute dtype width w (2 for bf16/fp16, 4 for fp32) instead of the paper's fixed 2;
* dropout masks: 1 byte (bool) in CUDA's native_dropout, w bytes on CPU (torch saves a mask in
  the input dtype there);
* torch's CPU math path computes in float32 (also for bf16 inputs) and saves copies of q, k, v.
* torch's RMSNorm on CPU is composite (`SavedWidths.composite_rmsnorm`): it saves its input in float32 (a copy for
  16-bit inputs), x x rstd in float32 and rstd in float32, for the hidden norms as for the head norms; CUDA's fused
  kernel saves the input and rstd (not measured here). (A zero-centred norm's weight + 1: `activation_memory.py`.)

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
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ds.estimate.model_states import PRECISION_BYTES
from megatron_ds.model import norms

DEVICES = ("cuda", "cpu")
ATTENTION_KINDS = ("flash", "math")
TOKEN_ID_BYTES = 8  # int64 token ids and labels
LOSS_MASK_BYTES = 4  # float32 loss mask
DOCUMENT_ID_BYTES = 2 * 8  # packed documents: int64 position id and document id per token


@dataclass(frozen=True)
class SavedWidths:
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


def kernels(precision: str, device: str, attention_dropout: float, attention: str | None = None) -> SavedWidths:
    """The kernel byte widths; `attention` None picks what torch's SDPA dispatch runs."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r} is not one of {', '.join(DEVICES)}")
    if attention is not None and attention not in ATTENTION_KINDS:
        raise ValueError(f"attention {attention!r} is not one of {', '.join(ATTENTION_KINDS)}")
    w = PRECISION_BYTES[precision]
    if device == "cuda":
        # LayerNorm's CUDA kernel saves mean/rstd in float32; native_dropout's mask is bool.
        return SavedWidths(
            w=w, mask=1, attention=attention or "flash", math_bytes=w, attn_mask=1, qkv_copies=False, stat=4
        )
    # CPU: the flash kernel takes no dropout, so SDPA falls back to math when dropout is on.
    chosen = attention or ("math" if attention_dropout > 0 else "flash")
    return SavedWidths(
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


def norm_saved(norm: norms.Norm, k: SavedWidths, elements: float, rows: float) -> tuple[float, float, float]:
    """(input, output, statistics) bytes one norm saves over `elements` values in `rows` rows: a fused kernel its
    input and statistics (LayerNorm mean + rstd, RMSNorm rstd); torch's composite RMSNorm (CPU) its input as float32
    (a copy for 16-bit inputs, the input itself in fp32), x x rstd in float32 and a float32 rstd; --qk-l2-norm's
    L2Norm, which computes in float32 on every device, its float32 input and a float32 rsqrt."""
    if norm is norms.L2_NORM:
        return 4 * elements, 0.0, 4 * rows
    if k.composite_rmsnorm and norm.megatron_lm == "RMSNorm":
        return 4 * elements, 4 * elements, 4 * rows
    return elements * k.w, 0.0, norm.saved_statistics * rows * k.stat
