"""Seconds of one micro-batch through one transformer layer, the pre group (embeddings) and the post group
(final norm, LM head, loss) on one GPU: matmuls by shape, attention, memory-bound kernels by bytes, and
the tensor-parallel communication they expose. Pure: no torch.

Shapes are our layer's (model/transformer.py; the FLOPs of estimate/compute.py): n = b s tokens, h, and
per tensor rank nq query / nkv key-value heads of hd, ffn f / t and fc1 2f / t for SwiGLU. Each linear's
backward is two matmuls, the input gradient (n x out) @ (out x in) and the weight gradient
(in x n) @ (n x out). Memory-bound bytes per pass (w bytes per element, e = the elements of one
(n, h) tensor, 1/t of them with sequence parallelism):
  norms: read and write e each, two per layer;
  after attention and after the MLP: dropout (read, write, a 1-byte mask) and the residual add (two
      reads, a write): (5w + 1) e each, or (3w + 1) e as one fused bias-dropout-add kernel;
  the activation: read and write n f / t (SwiGLU reads both halves);
  math attention: scale, mask and softmax over the b nq s^2 scores (4 w each, or 2 w fused), dropout
      (2w + 1); flash attention keeps them on chip;
  a layer with a sliding window (`ModelConfig.layer_windows`): the scores the software computes for it
      (`RunFeatures.window_kernel`: our query chunks' rectangles, a windowed flash kernel's band, or the masked
      square), the layer's time the mean over the model's layers;
  rotary embeddings: read and write q and k.
A backward moves `BACKWARD_MEMORY_RATIO` times its forward's bytes (the incoming gradient, the saved
input, the outgoing gradient). The tensor-parallel all-reduces (two per pass: after attention and after
the MLP; with sequence parallelism a reduce-scatter and an all-gather of the same volume) run over the
node's link; with `tp_overlap` only their part beyond the pass's matmuls is exposed, and the matmuls pay for
the overlap as Transformer Engine's userbuffers run it (`_overlapped_linear`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_ds.config import ModelConfig
from megatron_ds.estimate import moe_costs
from megatron_ds.estimate.communication import Links
from megatron_ds.estimate.efficiency import Kernels
from megatron_ds.estimate.run_features import FLASH, WINDOW_BAND, WINDOW_CHUNKS, RunFeatures
from megatron_ds.model import sliding_window

BACKWARD_MEMORY_RATIO = 2.0
FLASH_BACKWARD_FLOPS = 2.5
"""Flash attention's backward runs 5 of the forward's 2 matmuls again (the FlashAttention papers count
its backward as 2.5 x the forward's FLOPs)."""
CROSS_ENTROPY_BYTES = (14, 10)
"""Bytes per logit element of the loss, forward and backward: the fp32 copy (read w, write 4), the max
and the exponent sums (two reads of 4); the softmax gradient (read 4, write 4 and the w-byte gradient)."""
MEGATRON_CROSS_ENTROPY_BYTES = (36, 12)
"""The same for Megatron's unfused vocabulary-parallel loss on fp32 logits, plus w each way (the cast's read
and its gradient's write). Forward: `logits.float()` (read w, write 4), the max (read 4), the in-place
subtraction of the max (read 4, write 4), the in-place exponent (4, 4), its sum (4) and the in-place
division into the softmax it saves (4, 4); backward: the in-place product with the incoming gradient (4, 4)
and the cast's gradient (read 4, write w). Megatron-LM 2021 (`mpu/cross_entropy.py`, commit 6985e58938,
fed `output.float()` by `gpt_model.py`) and megatron-core at f2e5db402c (`tensor_parallel/cross_entropy.py`;
the fused kernel only with `--cross-entropy-loss-fusion`) run it so."""
TE_COMM_SMS = 16
"""Streaming multiprocessors a userbuffers communication kernel occupies while a matmul runs beside it, for
the `bulk` and `pipeline` overlaps (ring exchanges use copy engines and 1): Transformer Engine v1.8's
`initialize_ub` defaults (`transformer_engine/pytorch/module/base.py`), which Megatron-LM f2e5db402c keeps
unless `--tp-comm-overlap-cfg` names a file (`_initialize_tp_communicators` passes empty `ub_cfgs`)."""
TE_PIPELINE_SPLITS = 4
"""Chunks a `pipeline` overlap cuts the row-parallel forward matmul into (`num_splits`, the same defaults)."""


@dataclass(frozen=True)
class PassTimes:
    """Seconds of one micro-batch through one piece of the model on one GPU."""

    forward: float
    backward: float
    """The backward proper (no recomputation)."""
    recompute: float = 0.0
    """What recomputing this piece's forward inside its backward costs (full recomputation)."""
    attention_recompute: float = 0.0
    """What recomputing its core attention's forward costs (selective recomputation)."""
    weight: float = 0.0
    """The weight-gradient part of `backward` (its linears' grad_output^T x input: what ZB-H1 defers)."""
    parts: dict = field(default_factory=dict)
    """Forward + backward seconds by kind: matmul, attention, memory, tp-comm."""


@dataclass(frozen=True)
class LayerShapes:
    """One tensor rank's sizes."""

    tokens: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    fc1: int
    seq: int
    batch: int
    vocab: int

    @classmethod
    def of(cls, model: ModelConfig, micro_batch_size: int, tp: int) -> LayerShapes:
        return cls(
            tokens=micro_batch_size * model.seq_length,
            hidden=model.hidden_size,
            heads=model.num_attention_heads // tp,
            kv_heads=max(1, model.kv_heads // tp),
            head_dim=model.head_dim,
            ffn=model.ffn_hidden_size // tp,
            fc1=model.fc1_rows // tp,
            seq=model.seq_length,
            batch=micro_batch_size,
            vocab=model.vocab_size // tp,
        )


@dataclass(frozen=True)
class LinearTimes:
    """Seconds of one linear y = x W's three matmuls."""

    forward: float
    input_grad: float
    weight_grad: float

    @property
    def backward(self) -> float:
        return self.input_grad + self.weight_grad


def _linear(k: Kernels, n: int, d_in: int, d_out: int, w: int) -> LinearTimes:
    """y = x W for x (n, d_in): the forward, the input gradient (n x out) @ (out x in) and the weight gradient
    (in x n) @ (n x out)."""
    return LinearTimes(
        k.matmul(n, d_out, d_in, element_bytes=w),
        k.matmul(n, d_in, d_out, element_bytes=w),
        k.matmul(d_in, d_out, n, element_bytes=w),
    )


def _chunks(k: Kernels, m: int, n: int, d: int, w: int, parts: int) -> float:
    """One (m x d) @ (d x n) matmul run as `parts` matmuls of m / parts rows (each its own waves of tiles)."""
    return parts * k.matmul(max(1, m // parts), n, d, element_bytes=w)


def _beside_comm(k: Kernels, matmul: float, comm: float) -> float:
    """A matmul sharing the processors with a communication kernel on `TE_COMM_SMS` of them for `comm`
    seconds: the processor-seconds it loses while both run (none without a processor count)."""
    if not k.compute_units:
        return matmul
    return matmul + TE_COMM_SMS / k.compute_units * min(comm, matmul)


def _overlapped_linear(
    k: Kernels, n: int, d_in: int, d_out: int, w: int, tp: int, column: bool, comm: float
) -> LinearTimes:
    """One tensor-parallel linear under sequence parallelism with `--tp-comm-overlap`, as Transformer Engine
    v1.8's default userbuffers methods run it (`initialize_ub`: ring exchange for qkv and fc1 forward and for
    proj and fc2 input gradients; pipeline for proj and fc2 forward; bulk for qkv and fc1 backward). A ring
    exchange all-gathers chunk by chunk, one matmul per arriving 1/t of the rows; a pipeline reduce-scatters
    the forward's output in `TE_PIPELINE_SPLITS` chunks, each computed beside the previous one's reduction;
    a bulk overlap runs the column-parallel backward's all-gather of the input (for the weight gradient)
    beside the input-gradient matmul and the reduce-scatter of that gradient beside the weight-gradient
    matmul. `comm`: one all-gather or reduce-scatter of an (n, h) activation over the tensor group."""
    plain = _linear(k, n, d_in, d_out, w)
    if column:  # qkv, fc1: x (n, h) gathered from its sequence shards
        return LinearTimes(
            _chunks(k, n, d_out, d_in, w, tp),
            _beside_comm(k, plain.input_grad, comm),
            _beside_comm(k, plain.weight_grad, comm),
        )
    # proj, fc2: the output reduce-scattered into sequence shards; its gradient all-gathered back
    forward = _chunks(k, n, d_out, d_in, w, TE_PIPELINE_SPLITS)
    return LinearTimes(_beside_comm(k, forward, comm), _chunks(k, n, d_in, d_out, w, tp), plain.weight_grad)


def _attention(
    k: Kernels, sh: LayerShapes, features: RunFeatures, w: int, dropout: bool, window: int | None = None
) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core (scores, softmax, dropout, weighted values) of a layer
    whose sliding window is `window` (its left; None: the whole causal sequence)."""
    bh, s, hd = sh.batch * sh.heads, sh.seq, sh.head_dim
    window = sliding_window.effective(window, s)
    chunks = window is not None and features.window_kernel == WINDOW_CHUNKS
    if features.attention == FLASH:  # the causal triangle's (or the window's band's, or chunks') two matmuls
        band = window if features.window_kernel == WINDOW_BAND else None
        pairs = sliding_window.computed_pairs(s, window) if chunks else sliding_window.band_pairs(s, band)
        flops = 4.0 * bh * hd * pairs
        return k.attention(flops), k.attention(FLASH_BACKWARD_FLOPS * flops, backward=True)
    # (query rows, keys) of each score matrix: the square, or each chunk's rectangle
    blocks = [(e - a, e - f) for a, e, f in sliding_window.chunks(s, window)] if chunks else [(s, s)]
    scores = sum(k.matmul(r, c, hd, batch=bh, element_bytes=w) for r, c in blocks)
    values = sum(k.matmul(r, hd, c, batch=bh, element_bytes=w) for r, c in blocks)
    elements = bh * sum(r * c for r, c in blocks)
    softmax = (2 if features.fused_elementwise else 4) * w * elements + ((2 * w + 1) * elements if dropout else 0)
    back_mm = sum(2 * k.matmul(r, hd, c, batch=bh, element_bytes=w) for r, c in blocks) + scores + values
    return scores + values + k.memory(softmax), back_mm + k.memory(BACKWARD_MEMORY_RATIO * softmax)


def _mean_attention(
    k: Kernels, sh: LayerShapes, features: RunFeatures, w: int, dropout: bool, windows: tuple[int | None, ...]
) -> tuple[float, float]:
    """`_attention` averaged over the model's layers (their sliding windows)."""
    counts = {window: windows.count(window) for window in set(windows)}
    times = {window: _attention(k, sh, features, w, dropout, window) for window in counts}
    forward, backward = (sum(n * times[window][i] for window, n in counts.items()) / len(windows) for i in (0, 1))
    return forward, backward


def _elementwise_bytes(
    model: ModelConfig, sh: LayerShapes, features: RunFeatures, tp: int, w: int, mlp_rows: int | None = None
) -> float:
    """One forward's memory-bound bytes outside the attention core (`mlp_rows`: the rows the MLP's activation runs
    over, the tokens, or a MoE layer's E x C slots)."""
    e = sh.tokens * sh.hidden / (tp if features.sequence_parallel else 1)
    norms = 2 * 2 * w * e
    residual = 2 * ((3 * w + 1) if features.fused_elementwise else (5 * w + 1)) * e
    activation = (sh.fc1 + sh.ffn) * (sh.tokens if mlp_rows is None else mlp_rows) * w
    rotary = 4 * sh.tokens * (sh.heads + sh.kv_heads) * sh.head_dim * w if model.use_rotary_position_embeddings else 0
    return norms + residual + activation + rotary


def _tp_comm(links: Links, sh: LayerShapes, tp: int, w: int, count: int) -> float:
    """`count` all-reduces (or reduce-scatter + all-gather pairs) of one (n, h) activation over the tensor group."""
    return count * links.all_reduce(sh.tokens * sh.hidden * w, tp, within_node=True)


def _moe_mlp(
    model: ModelConfig, sh: LayerShapes, num_experts: int, w: int, kernels: Kernels, links: Links, a2a: tuple[int, bool]
) -> tuple[LinearTimes, float, float, int]:
    """A MoE layer's MLP half (module docstring of `estimate/moe_costs.py`): (its matmuls, the memory-bound bytes of
    one forward besides the activation, the seconds of one all-to-all, the activation's rows E x C). The gate is an
    fp32 linear over the tokens; each of the E / EP local experts runs its MLP over its EP x C slots; the dispatch
    gathers E C h elements into the slots, the combine gathers k S h and sums them weighted in fp32; PR-MoE's
    residual MLP and coefficient, and Megatron-LM's shared expert (and its gate), run over the tokens. `a2a`: (EP, the group within a node)."""
    n, h, ep = sh.tokens, sh.hidden, a2a[0]
    k, local = model.moe_top_k, num_experts // ep
    rows = num_experts * moe_costs.capacity(model, n, num_experts)
    expert = [_linear(kernels, rows // local, h, sh.fc1, w), _linear(kernels, rows // local, sh.ffn, h, w)]
    parts = [_linear(kernels, n, h, num_experts, moe_costs.FP32)] + [x for x in expert for _ in range(local)]
    if model.mlp_type == "residual":
        parts += [_linear(kernels, n, h, sh.fc1, w), _linear(kernels, n, sh.ffn, h, w), _linear(kernels, n, h, 2, w)]
    shared = model.moe_shared_expert_size
    if shared:
        parts += [
            _linear(kernels, n, h, 2 * shared if model.gated_mlp else shared, w),
            _linear(kernels, n, shared, h, w),
        ]
    if model.moe_shared_expert_gate:
        parts.append(_linear(kernels, n, h, 1, w))
    total = LinearTimes(*(sum(getattr(x, a) for x in parts) for a in ("forward", "input_grad", "weight_grad")))
    gate_copy = n * h * (w + moe_costs.FP32)  # the tokens' fp32 copy for the gate
    dispatch = 2 * rows * h * w
    combine = k * n * h * w + n * h * (2 * moe_costs.FP32 + w)  # gathered outputs; weighted fp32 sum, cast back
    mixing = 3 * n * h * w if model.mlp_type == "residual" else 0
    mixing += 3 * n * h * w * ((1 if shared else 0) + (1 if model.moe_shared_expert_gate else 0))  # add; gate scale
    one = links.all_to_all(moe_costs.all_to_all_bytes(model, sh.batch, num_experts, w), ep, a2a[1])
    return total, gate_copy + dispatch + combine + mixing, one, rows


def layer_times(
    model: ModelConfig,
    micro_batch_size: int,
    tp: int,
    w: int,
    kernels: Kernels,
    links: Links,
    features: RunFeatures,
    attention_dropout: bool = True,
    num_experts: int = 1,
    all_to_all: tuple[int, bool] = (1, True),
) -> PassTimes:
    """One transformer layer (w: bytes per activation element); with `num_experts` > 1 a MoE layer (T = 1) whose
    tokens reach their experts by two all-to-alls per pass over the expert-parallel group (`all_to_all`: its size
    and whether it sits in one node), exposed (DeepSpeed runs them between the gate and the experts)."""
    sh = LayerShapes.of(model, micro_batch_size, tp)
    n, h = sh.tokens, sh.hidden
    shapes = [  # (d_in, d_out, column-parallel)
        (h, (sh.heads + 2 * sh.kv_heads) * sh.head_dim, True),
        (sh.heads * sh.head_dim, h, False),
        (h, sh.fc1, True),
        (sh.ffn, h, False),
    ]
    moe = _moe_mlp(model, sh, num_experts, w, kernels, links, all_to_all) if num_experts > 1 else None
    if moe is not None:
        shapes = shapes[:2]
    if features.tp_overlap and features.sequence_parallel and tp > 1:
        one = links.reduce_scatter(n * h * w, tp, within_node=True)
        linears = [_overlapped_linear(kernels, n, a, b, w, tp, col, one) for a, b, col in shapes]
    else:
        linears = [_linear(kernels, n, a, b, w) for a, b, _ in shapes]
    linears += [moe[0]] if moe is not None else []
    mm_f, mm_b = sum(x.forward for x in linears), sum(x.backward for x in linears)
    at_f, at_b = _mean_attention(kernels, sh, features, w, attention_dropout, model.layer_windows)
    mem = _elementwise_bytes(model, sh, features, tp, w, moe[3] if moe else None) + (moe[1] if moe else 0.0)
    me_f, me_b = kernels.memory(mem), kernels.memory(BACKWARD_MEMORY_RATIO * mem)
    comm = _tp_comm(links, sh, tp, w, 2)
    tp_f = max(0.0, comm - mm_f) if features.tp_overlap else comm
    tp_b = max(0.0, comm - mm_b) if features.tp_overlap else comm
    a2a = 2 * moe[2] if moe else 0.0  # two all-to-alls each pass
    forward = mm_f + at_f + me_f + tp_f + a2a
    parts = {"matmul": mm_f + mm_b, "attention": at_f + at_b, "memory": me_f + me_b, "tp-comm": tp_f + tp_b}
    if moe is not None:
        parts["all-to-all"] = 2 * a2a
    weight = sum(x.weight_grad for x in linears)
    return PassTimes(
        forward,
        mm_b + at_b + me_b + tp_b + a2a,
        recompute=forward,
        attention_recompute=at_f,
        weight=weight,
        parts=parts,
    )


def pre_times(model: ModelConfig, micro_batch_size: int, tp: int, w: int, kernels: Kernels, links: Links) -> PassTimes:
    """The embeddings on stage 0: the lookup, the position add, dropout; the vocabulary-parallel all-reduce.
    The lookup's backward fills the table's whole (v/t, h) gradient: zeroed, then accumulated into the
    parameter's gradient (a write, a read and a write of it)."""
    sh = LayerShapes.of(model, micro_batch_size, tp)
    e = sh.tokens * sh.hidden
    nbytes = 2 * w * e + (3 * w * e if model.add_position_embedding else 0) + (2 * w + 1) * e
    comm = _tp_comm(links, sh, tp, w, 1)
    forward = kernels.memory(nbytes) + comm
    backward = kernels.memory(BACKWARD_MEMORY_RATIO * nbytes + 3 * w * sh.vocab * sh.hidden)
    return PassTimes(forward, backward, parts={"memory": kernels.memory(3 * nbytes), "tp-comm": comm})


def post_times(
    model: ModelConfig,
    micro_batch_size: int,
    tp: int,
    w: int,
    kernels: Kernels,
    links: Links,
    features: RunFeatures,
) -> PassTimes:
    """The final norm, the LM head's logits (vocabulary-parallel) and the loss on the last stage."""
    sh = LayerShapes.of(model, micro_batch_size, tp)
    head = _linear(kernels, sh.tokens, sh.hidden, sh.vocab, w)
    norm = 2 * w * sh.tokens * sh.hidden
    logits = sh.tokens * sh.vocab
    if features.megatron_cross_entropy:
        loss_f, loss_b = (b + w for b in MEGATRON_CROSS_ENTROPY_BYTES)
    else:
        loss_f, loss_b = CROSS_ENTROPY_BYTES
    mem_f = kernels.memory(norm + loss_f * logits)
    mem_b = kernels.memory(BACKWARD_MEMORY_RATIO * norm + loss_b * logits)
    comm = _tp_comm(links, sh, tp, w, 1)  # the head's input gradient, summed over the tensor ranks
    parts = {"matmul": head.forward + head.backward, "memory": mem_f + mem_b, "tp-comm": comm}
    return PassTimes(head.forward + mem_f, head.backward + mem_b + comm, weight=head.weight_grad, parts=parts)


def head_forward(model: ModelConfig, micro_batch_size: int, tp: int, w: int, kernels: Kernels) -> float:
    """A forward-only head (knowledge distillation's teacher): the final norm, the LM head's vocabulary-parallel
    logits and their fp32 copy (read w, write 4 per logit), no loss."""
    sh = LayerShapes.of(model, micro_batch_size, tp)
    head = _linear(kernels, sh.tokens, sh.hidden, sh.vocab, w)
    return head.forward + kernels.memory(2 * w * sh.tokens * sh.hidden + (w + 4) * sh.tokens * sh.vocab)
