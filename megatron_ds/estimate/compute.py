"""Analytic forward and backward FLOPs of every spec of our GPT, per tensor-parallel rank. Pure: no torch.

Matmul FLOPs (exact for our code; `tests/unit/test_compute_model.py` checks them against
`torch.utils.flop_counter.FlopCounterMode` on the real modules). A (m, k) x (k, n) product costs
2mkn FLOPs (one multiply and one add per MAC), as in Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", sec. 5.1 / appendix: per layer and
micro-batch (b, s) the forward is 24bsh^2 + 4bs^2h (QKV 6bsh^2, scores 2bs^2h, attention over
values 2bs^2h, projection 2bsh^2, MLP 16bsh^2), the LM head 2bshV; their eq. (3),
96Bslh^2 (1 + s/6h + V/16lh) (sec. 5.1, "equation 3" in Megatron-DeepSpeed's throughput code), is
forward + backward + one recomputed forward of every layer.
Conventions kept from the paper:
  - backward = 2 x forward for every matmul (the gradient of the input and of the weight, or of
    both operands of a bmm); holds here because every stage's input requires grad (the embedding
    output on stage 0, DeepSpeed's received activations elsewhere);
  - activation recomputation adds one forward of each recomputed transformer layer; selective
    recomputation one forward of each layer's core attention (scores, softmax, attention over values:
    Korthikanti et al.'s 2.7% overhead at GPT-3 size);
  - attention scores cover the full s x s square (the paper's s/6h term, Megatron-LM's
    `num_floating_point_operations`, FlopCounterMode and torch's math SDPA backend all count it),
    and their backward is 2x the forward. What runs differs: on CPU, SDPA takes the math backend
    (full square, bmm) when attention dropout is on and its flash kernel when it is off; flash
    kernels (CPU, and GPU with or without dropout) skip the blocks above the causal diagonal and
    recompute the scores in backward (FlopCounterMode counts 5 instead of 4 bmm there).
    `causal_attention=True` counts the s(s+1)/2 query-key pairs a causal kernel needs: use it to
    predict the time of such kernels, not to report TFLOP/s. The attention terms are s/6h of the
    rest of a layer (5.6% at s = 128, h = 384), so there the choice moves a stage's time little.
  - a layer with a sliding window (`ModelConfig.layer_windows`, `megatron_ds.model.sliding_window`) counts, with
    or without `causal_attention`, the scores our chunked attention computes (`computed_pairs`: about
    s (left + 1 + chunk) instead of s^2, the window's band and at most 1/8 more for windows over 256 tokens; what
    FlopCounterMode counts on the layer, whichever kernel runs each chunk). A windowed flash kernel computes the
    band alone (`band_pairs`; `estimate/layer_time.py` prices software that has one). The stage totals take
    every layer as the mean layer when their windows differ (`--window-attn-skip-freq`, Qwen2's full layers).
Generalised beyond the paper, term by term from our layer (megatron_ds/model/transformer.py): QKV
has nh query and kv key/value heads of hd = --kv-channels (h/nh by default; proj maps nh x hd back to h, so the
model FLOPs carry Megatron-LM's query_projection_to_hidden_size_ratio nh hd / h), SwiGLU's fc1 has 2f
outputs, f = ffn_hidden_size; at T > 1 each rank computes 1/T of QKV, scores, values, proj, fc1,
fc2 (megatron-core's column/row-parallel layers) and of the vocabulary-parallel head.

Element-wise work (norms, activations, softmax, bias and residual adds, rotary, the loss) is
counted separately ("elementwise" terms) with DeepSpeed's flops-profiler conventions
(deepspeed/profiling/flops_profiler/profiler.py: layer_norm 5 per element, gelu, silu and softmax
1, add/mul 1, dropout and embedding lookup 0; rmsnorm 4, as layer_norm without the mean; the
norm and activation registries hold these numbers) and an assumed backward of twice the forward.
These are conventions, not measured operation counts: they are < 2% of a layer's FLOPs at the
sizes we train, and their time is memory-bound anyway (`megatron_ds.estimate.calibrate` measures
time per spec type).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_ds.config import ModelConfig
from megatron_ds.estimate import moe_costs
from megatron_ds.estimate.stage_contents import held_total, recomputed_layers, stage_parts
from megatron_ds.model import activations, naming, norms, sliding_window

MATMUL = "matmul"
ELEMENTWISE = "elementwise"
WEIGHT_MATMULS = ("qkv", "proj", "fc1", "fc2", "logits")
"""The matmul terms with a weight (every linear layer, the LM head): half of each one's backward is
its weight gradient, which ZB-H1 defers to a weight pass (`model/weight_grad.py`)."""


@dataclass(frozen=True)
class ComputeInputs:
    """What the compute of one micro-batch on one tensor-parallel rank depends on."""

    model: ModelConfig
    micro_batch_size: int
    """Samples per micro-batch b (sequence length s comes from the model)."""
    tensor_parallel_size: int = 1
    """T: every rank computes 1/T of the tensor-parallel specs."""
    checkpoint_activations: bool = False
    """Recompute transformer layers in backward (`--checkpoint-activations`)."""
    checkpoint_num_layers: int = 1
    """Layers per recomputed chunk (DeepSpeed's `activation_checkpoint_interval`)."""
    causal_attention: bool = False
    """Count only the s(s+1)/2 query-key pairs causal kernels compute (see the module docstring)."""
    selective_recompute: bool = False
    """Recompute each layer's core attention in backward (`--recompute-activations`): scores, softmax and the
    attention over values run again."""
    ulysses_size: int = 1
    """N (DeepSpeed-Ulysses): every rank computes 1/N of every spec (its tokens outside attention, its heads
    over the whole sequence inside it). Megatron's sequence parallelism changes no FLOPs."""
    active_experts: bool = False
    """A mixture-of-experts layer's experts counted for the k experts each token uses (model FLOPs), not for every
    one of the E x C capacity slots DeepSpeed computes (`moe_costs.mlp_flops`)."""

    def __post_init__(self) -> None:
        m, t = self.model, self.tensor_parallel_size
        if self.micro_batch_size < 1 or t < 1 or self.checkpoint_num_layers < 1 or self.ulysses_size < 1:
            raise ValueError(
                f"micro_batch_size, tensor_parallel_size, checkpoint_num_layers and ulysses_size must be >= 1: {self}"
            )
        for what, value in (
            ("heads", m.num_attention_heads),
            ("kv heads", m.kv_heads),
            ("ffn", m.ffn_hidden_size),
            ("vocab", m.vocab_size),
        ):
            if value % t:
                raise ValueError(f"{what} {value} is not divisible by tensor-parallel size {t}")


@dataclass(frozen=True)
class Term:
    """One named piece of a spec's work, FLOPs of one micro-batch on one tensor rank."""

    name: str
    kind: str
    """`matmul` or `elementwise`."""
    forward: int
    backward: int


@dataclass(frozen=True)
class SpecFlops:
    """One spec's FLOPs for one micro-batch on one tensor rank (the loss is listed as a spec too)."""

    index: int
    name: str
    group: str
    """`pre`, `body`, `post` or `loss`."""
    terms: tuple[Term, ...]

    def _sum(self, attr: str, kind: str | None = None) -> int:
        return sum(getattr(t, attr) for t in self.terms if kind is None or t.kind == kind)

    @property
    def forward(self) -> int:
        return self._sum("forward")

    @property
    def backward(self) -> int:
        """Backward without recomputation (add `forward` for a recomputed layer)."""
        return self._sum("backward")

    @property
    def matmul_forward(self) -> int:
        return self._sum("forward", MATMUL)

    @property
    def matmul_backward(self) -> int:
        return self._sum("backward", MATMUL)

    @property
    def weight_backward(self) -> int:
        """The weight gradients' FLOPs: as many as each weight matmul's forward."""
        return sum(t.forward for t in self.terms if t.name in WEIGHT_MATMULS)


def _matmul(name: str, flops: int) -> Term:
    return Term(name, MATMUL, flops, 2 * flops)  # backward: grads of both operands


def _elementwise(name: str, flops: int, backward: int | None = None) -> Term:
    return Term(name, ELEMENTWISE, flops, 2 * flops if backward is None else backward)


def _score_pairs(s: int, causal: bool, window: int | None = None) -> int:
    """Query-key pairs per head and sample: the full square, or the causal triangle; within a window the chunks our
    attention computes."""
    if sliding_window.effective(window, s) is not None:
        return sliding_window.computed_pairs(s, window)
    return s * (s + 1) // 2 if causal else s * s


def layer_terms(inputs: ComputeInputs, num_experts: int = 1, window: int | None = None) -> tuple[Term, ...]:
    """One transformer layer on one tensor rank (model/transformer.py, in execution order); with `num_experts` > 1
    its MLP is DeepSpeed's MoE layer (T = 1; `moe_costs.mlp_flops`: the gate, the experts, PR-MoE's residual MLP);
    `window`: its sliding window's left (`ModelConfig.layer_windows`).

    At T = 1, multi-head attention and f = 4h these are Narayanan et al.'s terms: QKV 6nh^2, scores
    and attention over values 2nsh each, proj 2nh^2, MLP 16nh^2 (n = b s tokens).
    """
    m, t = inputs.model, inputs.tensor_parallel_size
    n = inputs.micro_batch_size * m.seq_length  # tokens per micro-batch
    h, hd, b = m.hidden_size, m.head_dim, inputs.micro_batch_size
    nq, nkv = m.num_attention_heads // t, m.kv_heads // t  # this rank's query / key-value heads
    f = m.ffn_hidden_size // t
    act = activations.find(m.activation)
    fc1 = 2 * f if act.gated else f
    pairs = b * nq * _score_pairs(m.seq_length, inputs.causal_attention, window)  # score entries on this rank
    norm = norms.find(m.normalization).forward_flops * n * h
    terms = [
        _elementwise("input norm", norm),
        _matmul("qkv", 2 * n * h * (nq + 2 * nkv) * hd),
        _matmul("scores", 2 * pairs * hd),  # q k^T per query head (k broadcast over a GQA group)
        _elementwise("softmax", pairs),
        _matmul("attention over values", 2 * pairs * hd),
        _matmul("proj", 2 * n * (nq * hd) * h),  # row-parallel: this rank's features -> h
        _elementwise("residual adds", 2 * n * h),
        _elementwise("post-attention norm", norm),
        _matmul("fc1", 2 * n * h * fc1),
        _elementwise(act.name, act.elementwise_flops * n * f),  # gelu; or silu and * up
        _matmul("fc2", 2 * n * f * h),
    ]
    if num_experts > 1:  # the dense fc1, activation and fc2 give way to the MoE layer's matmuls
        terms = terms[:8] + [
            _matmul(name, flops)
            for name, flops in moe_costs.mlp_flops(
                m, inputs.micro_batch_size, num_experts, inputs.active_experts
            ).items()
        ]
    if m.use_rotary_position_embeddings:
        terms.append(_elementwise("rotary", 3 * n * (nq + nkv) * hd))  # x cos + rotate_half(x) sin
    head_norm = norms.head_norm(m)  # --qk-layernorm's or --qk-l2-norm's norm over each of this rank's q and k heads
    if head_norm is not None:
        terms.append(_elementwise("query and key norms", head_norm.forward_flops * n * (nq + nkv) * hd))
    biased = {"qkv": (nq + 2 * nkv) * hd, "proj": h, "fc1": fc1, "fc2": h}  # output features on this rank
    if any(m.has_bias(name) for name in biased):
        terms.append(_elementwise("bias adds", n * sum(f for name, f in biased.items() if m.has_bias(name))))
    return tuple(terms)


def _pre_terms(inputs: ComputeInputs, name: str) -> tuple[Term, ...]:
    n, h = inputs.micro_batch_size * inputs.model.seq_length, inputs.model.hidden_size
    if name == naming.WORD_EMBEDDING:  # lookup; backward scatter-adds n rows into the (v/T, h) grad
        return (_elementwise("lookup", 0, backward=n * h),)
    if name == naming.POSITION_EMBEDDING:  # add, then dropout; backward sums the batch into (s, h)
        return (_elementwise("add position", n * h, backward=n * h),)
    return ()  # cast_token_ids, EmbeddingDropout (dropout counts 0)


def _post_terms(inputs: ComputeInputs, name: str) -> tuple[Term, ...]:
    m, t = inputs.model, inputs.tensor_parallel_size
    n, h, v = inputs.micro_batch_size * m.seq_length, m.hidden_size, m.vocab_size // t
    if name == naming.FINAL_NORM:
        return (_elementwise("final norm", norms.find(m.normalization).forward_flops * n * h),)
    if name in (naming.TIED_LM_HEAD, naming.UNTIED_LM_HEAD):
        return (_matmul("logits", 2 * n * h * v),)  # vocabulary-parallel at T > 1: v/T rows
    if name == naming.LOSS:  # log-softmax over this rank's v/T logits, then the masked mean
        return (_elementwise("cross entropy", n * v + 2 * n),)
    return ()  # logits_to_fp32: a dtype copy


@functools.lru_cache(maxsize=256)
def spec_flops(inputs: ComputeInputs) -> tuple[SpecFlops, ...]:
    """Every spec in spec-index order (`naming.gpt_spec_groups`), then the loss (group `loss`)."""
    groups = naming.gpt_spec_groups(inputs.model)
    kinds = list(zip(inputs.model.experts_per_layer, inputs.model.layer_windows))
    layers = {kind: layer_terms(inputs, *kind) for kind in set(kinds)}  # per expert count and window
    n = inputs.ulysses_size
    out = []
    for idx, name in enumerate([*groups.names, groups.loss_name]):
        group = "loss" if idx == groups.num_specs else groups.group_of(idx)
        if group == "body":
            terms = layers[kinds[idx - len(groups.pre)]]
        elif group == "pre":
            terms = _pre_terms(inputs, name)
        else:
            terms = _post_terms(inputs, name)
        if n > 1:  # every term is over the tokens or the heads, both split n ways
            terms = tuple(Term(t.name, t.kind, t.forward // n, t.backward // n) for t in terms)
        out.append(SpecFlops(idx, name, group, terms))
    return tuple(out)


CORE_ATTENTION = ("scores", "softmax", "attention over values")
"""The terms of `layer_terms` that selective recomputation runs again in backward."""


def core_attention_forward(layer: SpecFlops) -> int:
    """Forward FLOPs of one layer's core attention (what selective recomputation repeats)."""
    return sum(t.forward for t in layer.terms if t.name in CORE_ATTENTION)


@dataclass(frozen=True)
class StageFlops:
    """FLOPs of one micro-batch on one GPU of a pipeline stage."""

    stage: int
    num_layers: int
    forward: int
    backward: int
    """Backward proper (2x forward for matmuls)."""
    recompute: int
    """Forward FLOPs repeated inside backward by activation recomputation."""
    matmul_forward: int
    matmul_backward: int
    weight: int = 0
    """The part of `backward` that is weight gradients of linear layers (ZB-H1's weight pass)."""

    @property
    def backward_total(self) -> int:
        """What the backward pass costs: backward plus recomputation."""
        return self.backward + self.recompute

    @property
    def total(self) -> int:
        return self.forward + self.backward_total


def stage_flops_for(inputs: ComputeInputs, stage: int, num_stages: int, num_layers: int) -> StageFlops:
    """Stage `stage` of `num_stages` holding `num_layers` transformer layers (plus the pre group on
    stage 0, the post group and the loss on the last stage)."""
    all_pre, all_post, layer = _stage_parts(inputs)
    pre = list(all_pre) if stage == 0 else []
    post = list(all_post) if stage == num_stages - 1 else []

    def total(attr: str) -> int:
        return held_total(pre + post, layer, num_layers, attr)

    interval = inputs.checkpoint_num_layers if inputs.checkpoint_activations else 0
    num_post_funcs = sum(1 for sp in post if sp.group == "post")  # the loss is not a forward function
    again = recomputed_layers(len(pre), num_layers, num_post_funcs, interval)
    attention = num_layers * core_attention_forward(layer) if inputs.selective_recompute else 0
    attention_matmul = (
        num_layers * sum(t.forward for t in layer.terms if t.name in CORE_ATTENTION and t.kind == MATMUL)
        if inputs.selective_recompute
        else 0
    )
    return StageFlops(
        stage=stage,
        num_layers=num_layers,
        forward=total("forward"),
        backward=total("backward"),
        recompute=again * layer.forward + attention,
        matmul_forward=total("matmul_forward"),
        matmul_backward=total("matmul_backward") + again * layer.matmul_forward + attention_matmul,
        weight=total("weight_backward"),
    )


@functools.lru_cache(maxsize=256)
def _stage_parts(inputs: ComputeInputs) -> tuple[tuple[SpecFlops, ...], tuple[SpecFlops, ...], SpecFlops]:
    """(the pre specs, the post specs and the loss, one transformer layer): what a stage can hold. Layers whose
    windows differ are counted as their mean (each term's FLOPs averaged over the layers)."""
    pre, post, layer = stage_parts(spec_flops(inputs), ("post", "loss"))
    if len(set(inputs.model.layer_windows)) == 1:
        return pre, post, layer
    names = [t.name for t in layer.terms]  # the layers of the first one's kind (a MoE model's dense ones apart)
    body = [sp for sp in spec_flops(inputs) if sp.group == "body" and [t.name for t in sp.terms] == names]
    mean = tuple(
        Term(
            t.name, t.kind, *(sum(getattr(sp.terms[i], a) for sp in body) // len(body) for a in ("forward", "backward"))
        )
        for i, t in enumerate(layer.terms)
    )
    return pre, post, dataclasses.replace(layer, terms=mean)


def stage_flops(inputs: ComputeInputs, layers_per_stage: Sequence[int]) -> list[StageFlops]:
    """Every stage of a layout given as transformer layers per stage (`Layout.layers_per_stage`)."""
    p = len(layers_per_stage)
    return [stage_flops_for(inputs, s, p, k) for s, k in enumerate(layers_per_stage)]


def model_flops_per_iteration(model: ModelConfig, global_batch_size: int, recompute: bool = False) -> int:
    """Matmul FLOPs of one optimizer step over all GPUs, forward + backward (+ recomputation).

    `recompute=False` is "model FLOPs", what Megatron-LM's throughput line divides by time
    (`num_floating_point_operations` in megatron/training/training.py counts 12bsLh^2 x (...) with
    GQA and SwiGLU terms and no recomputation; equal to this count, as the tests check).
    `recompute=True` adds one forward of every layer: the paper's eq. (3) with its factor 4.
    Tensor parallelism does not change the total (each rank computes 1/T).
    A mixture-of-experts layer counts its active parameters: the gate, the k experts each token is routed to and
    PR-MoE's residual MLP (`ComputeInputs.active_experts`), not the empty capacity slots DeepSpeed also computes.
    Megatron-DeepSpeed's `throughput_calculator` (megatron/utils.py) counts `--topk` x the MLP on every layer, the
    dense ones at `--expert-interval` 2 too, and no gate.
    """
    inputs = ComputeInputs(model, micro_batch_size=1, active_experts=True)
    specs = spec_flops(inputs)
    per_sample = sum(sp.matmul_forward + sp.matmul_backward for sp in specs)
    if recompute:
        per_sample += sum(sp.matmul_forward for sp in specs if sp.group == "body")
    return global_batch_size * per_sample
