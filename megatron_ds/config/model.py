"""The model's architecture (`ModelConfig`) and how its weights are regularised and initialised
(`RegularizationConfig`).

The split is the resume rule: every `ModelConfig` field is checked against a checkpoint (another
value is another model), while `RegularizationConfig` may change on resume or fine-tuning (a notice
says what changed). Derived sizes (head size, key/value heads, fused QKV and fc1 widths) are
properties here, and the padded vocabulary is `padded_vocab_size`; weight shapes and parameter
counts built from them are in `megatron_ds.model.shapes`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from megatron_ds.config.checks import at_least, check, one_of, positive, probability
from megatron_ds.config.experts import check_experts, experts_per_layer

NORMALIZATIONS = ("layernorm", "rmsnorm", "layernorm1p", "rmsnorm1p")
"""The norms ModelConfig accepts: the names of `megatron_ds.model.norms.REGISTRY`, which holds each
one's module, parameters, stored keys, costs and Hugging Face model types (it checks on import that
its names are these)."""
ACTIVATIONS = ("gelu_tanh", "gelu", "swiglu", "squared_relu")
"""The MLP activations ModelConfig accepts: the names of `megatron_ds.model.activations.REGISTRY`,
which holds each one's function, Hugging Face name and costs (it checks on import that its names and
gated entries are these)."""
GATED_ACTIVATIONS = ("swiglu",)
"""Activations of a gated MLP: fc1 produces a gate and an up half (2 x ffn features)."""


def default_ffn_hidden_size(hidden_size: int, activation: str) -> int:
    """`--ffn-hidden-size` when not given, as Megatron-DeepSpeed and Megatron-LM derive it: 4h; for a gated MLP
    two thirds of that, rounded down to a multiple of 64, so its two fc1 halves keep about 4h's parameters."""
    if activation in GATED_ACTIVATIONS:
        return int(4 * hidden_size * 2 / 3 / 64) * 64
    return 4 * hidden_size


DEFAULT_ROTARY_BASE = 10000.0
DEFAULT_ROPE_SCALING_FACTOR = 8.0
"""`--rope-scaling-factor`'s default (Megatron-LM's; Llama 3.1 and 3.3 use 8, Llama 3.2 32)."""
LLAMA3_ROPE_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""The other parameters of Llama 3.x's RoPE scaling: megatron-core's `RotaryEmbedding._apply_scaling` fixes them
at Llama 3.1's released values (no Megatron-LM flag sets them), as every Llama 3.x config.json has them."""


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    """Round up to a multiple of divisible_by x T, as Megatron does (keeps vocabulary shards aligned)."""
    at_least("--make-vocab-size-divisible-by", divisible_by, 1)
    at_least("--tensor-model-parallel-size", tensor_parallel_size, 1)  # padding comes before ParallelConfig's check
    multiple = divisible_by * tensor_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


@dataclass(frozen=True)
class ModelConfig:
    """GPT architecture. Every field here is checked against a checkpoint on resume."""

    num_layers: int
    """Number of transformer layers (`--num-layers`)."""
    hidden_size: int
    """Model width h (`--hidden-size`)."""
    num_attention_heads: int
    """Attention heads a; h must be divisible by a unless `kv_channels` gives the head size (`--num-attention-heads`)."""
    ffn_hidden_size: int
    """Width of the MLP's inner layer (`--ffn-hidden-size`; `default_ffn_hidden_size` when not given)."""
    seq_length: int
    """Tokens per sample s (`--seq-length`)."""
    max_position_embeddings: int
    """Rows of the learned position embedding; >= seq_length (`--max-position-embeddings`)."""
    vocab_size: int
    """Padded vocabulary size: rows of the word embedding (see `padded_vocab_size`). 0 only while
    the vocabulary is unknown (`--print-layout` without `--vocab-size` or a tokenizer)."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of every norm (`--layernorm-epsilon`)."""
    normalization: str = "layernorm"
    """The norm, one of NORMALIZATIONS (`megatron_ds.model.norms`; `--normalization`)."""
    untie_embeddings_and_output_weights: bool = False
    """Give the post stage its own LM head instead of the tied word embedding."""
    num_key_value_heads: int | None = None
    """Key/value heads for grouped-query attention (`--num-key-value-heads`); divides
    num_attention_heads. None: one per attention head (multi-head attention); a value equal to
    num_attention_heads is the same model and is stored as None. See `kv_heads`."""
    kv_channels: int | None = None
    """Channels of each attention head (Megatron's `--kv-channels`, transformers' `head_dim`): the QKV projection
    maps h to (heads + 2 kv heads) x kv_channels, the output projection heads x kv_channels back to h, and the
    softmax scale, rotary embeddings and the query and key norms work over kv_channels. None: hidden_size /
    num_attention_heads (Megatron's default); that value is stored as None (one spelling). See `head_dim`."""
    activation: str = "gelu_tanh"
    """The MLP activation, one of ACTIVATIONS (`megatron_ds.model.activations`). `gelu_tanh`, the
    default, is GeLU's tanh approximation: what Megatron-DeepSpeed's default fused bias-GeLU and
    `--openai-gelu` compute. `gelu` is the exact (erf) GeLU (`--no-bias-gelu-fusion`, or
    `--disable-bias-linear`, as in Megatron). `swiglu` (`--swiglu`): fc1 produces 2 x
    ffn_hidden_size features, silu(first half) * second half feeds fc2, as Megatron's gated MLP."""
    use_rotary_position_embeddings: bool = False
    """Rotary position embeddings on q and k in every attention (`--use-rotary-position-embeddings`)."""
    rotary_base: float = DEFAULT_ROTARY_BASE
    """The rotary base theta: frequencies theta^(-2i/head_dim) (`--rotary-base`, Megatron-DeepSpeed's
    `--rotary-position-embeddings-theta`; Llama-3 uses 500000). Without rotary embeddings it changes
    nothing and is stored as the default, so equal models compare equal."""
    rotary_percent: float = 1.0
    """The share of each head's channels that rotary embeddings rotate (`--rotary-percent`): the first
    `rotary_dim` channels of q and k; the rest pass through, as Megatron's partial rotary. Stored as
    1.0 without rotary embeddings (one spelling of the same model)."""
    use_rope_scaling: bool = False
    """Llama 3.x's RoPE frequency scaling (Megatron-LM's `--use-rope-scaling`): frequencies whose wavelength
    exceeds the original context / low_freq_factor are divided by rope_scaling_factor, those under the original
    context / high_freq_factor kept, the ones between interpolated smoothly (`model.rotary.llama3_scaled`;
    `LLAMA3_ROPE_SCALING`). Stored as False without rotary embeddings."""
    rope_scaling_factor: float = DEFAULT_ROPE_SCALING_FACTOR
    """The scaling's factor (`--rope-scaling-factor`); stored as the default without use_rope_scaling."""
    add_position_embedding: bool = True
    """Add the learned absolute position embedding after the word embedding; False with
    `--no-position-embedding` (Llama-style models that use rotary embeddings only). Without it the
    model has no position table at all."""
    add_bias_linear: bool = True
    """Biases in the attention and MLP linear layers; False with `--disable-bias-linear`."""
    add_qkv_bias: bool = False
    """A bias on the fused query/key/value projection alone (Megatron-LM's `--add-qkv-bias`; Qwen2's layout) when
    `add_bias_linear` is off. Stored as False with `add_bias_linear`, which already gives QKV its bias (one
    spelling of the same model; Megatron-LM sets it True there): ask `has_bias` which linears have one."""
    qk_layernorm: bool = False
    """A norm on each query and key head (Megatron-LM's `--qk-layernorm`, megatron-core's q_layernorm/k_layernorm;
    Qwen3's q_norm/k_norm): after the QKV projection, before rotary embeddings, over the head's channels, of the kind
    `normalization` names and with its epsilon; one weight (and bias) of head_dim per layer for all query heads,
    another for all key heads."""
    qk_l2_norm: bool = False
    """Llama 4's query and key norm (Megatron-LM's `--qk-l2-norm`, megatron-core's L2Norm): x * rsqrt(mean(x^2) + eps)
    over each query and key head in float32, no weights, on every layer where `qk_layernorm`'s would be; it replaces
    that one (as in megatron-core), so `qk_layernorm` is stored as False with it."""
    num_experts: tuple[int, ...] = (1,)
    """Megatron-DeepSpeed's `--num-experts`: experts of each mixture-of-experts layer, one value for all of them or
    one per such layer (`experts_per_layer`); (1,) is a dense model. A layer with experts replaces its MLP by
    DeepSpeed's MoE layer (a gate and that many copies of the MLP, `megatron_ds.model.moe`)."""
    expert_interval: int = 2
    """`--expert-interval`: every this-many-th layer has experts (layers 2, 4, ... by default). Stored as 2 in a
    dense model."""
    mlp_type: str = "standard"
    """`--mlp-type`: `standard` (experts alone) or `residual` (PR-MoE: a dense MLP beside the experts, mixed by a
    learned two-way softmax). Stored as `standard` in a dense model."""
    moe_router: str = "deepspeed"
    """`deepspeed`: Megatron-DeepSpeed's gates (`--topk` 1 or 2: DeepSpeed's top-1 and top-2 gates, their capacity,
    token dropping and second-expert sampling). `megatron`: Megatron-LM's top-k router (chosen by its `--moe-*`
    flags, `megatron_ds.flags.megatron_lm_moe`): softmax over the k largest logits (the same weights as a softmax
    over all experts renormalized over the k), every token routed (no capacity), the load-balancing loss
    E / k x sum_e(mean probability_e x routed share_e) counting all k choices, the gate drawn N(0, init std);
    DeepSpeed's `topkgating` computes it. With it the capacity fields are stored at their defaults and token
    dropping and second-expert sampling as off (what it does)."""
    moe_router_pre_softmax: bool = False
    """Megatron-LM's `--moe-router-pre-softmax` (its router only): the softmax over all experts first, each token's k
    largest probabilities its weights, not renormalized (Qwen2-MoE's `norm_topk_prob` false); the load-balancing
    loss is the same. Refused with DeepSpeed's gates (`moe_router` "deepspeed"), in a dense model too, as every routing
    field is checked against its router there (`--topk 3` is refused so); a dense model then stores it as False."""
    moe_shared_expert_size: int = 0
    """Megatron-LM's `--moe-shared-expert-intermediate-size` (its router only): the FFN width of a dense MLP beside the
    routed experts of every MoE layer (megatron-core's `SharedExpertMLP`: the experts' activation, no biases), whose
    output is added to theirs for every token (Qwen2-MoE's and DeepSeek's shared experts); 0: none. Refused with
    DeepSpeed's gates, in a dense model too (as `moe_router_pre_softmax`); a dense model then stores it as 0."""
    moe_shared_expert_gate: bool = False
    """Megatron-LM's `--moe-shared-expert-gate`: the shared expert's output scaled by sigmoid(a bias-free linear
    h -> 1 of the layer's input) (Qwen2-MoE's `shared_expert_gate`); needs `moe_shared_expert_size`."""
    moe_top_k: int = 1
    """`--topk` / `--moe-router-topk`: experts each token is sent to (1 or 2 with DeepSpeed's gates, any number of
    the layer's experts with Megatron-LM's router)."""
    moe_train_capacity_factor: float = 1.0
    """`--moe-train-capacity-factor`: an expert takes at most factor x tokens / experts tokens in training (x 2 for
    top-2; at least `moe_min_capacity`); the rest are dropped (their MLP output is 0) unless token dropping is off."""
    moe_eval_capacity_factor: float = 1.0
    """`--moe-eval-capacity-factor`: the same in evaluation."""
    moe_min_capacity: int = 4
    """`--moe-min-capacity`: the least capacity of an expert whatever the factor."""
    moe_token_dropping: bool = True
    """False with `--disable-moe-token-dropping`: every expert's capacity is the most tokens any expert of the
    expert-parallel group got (nothing is dropped)."""
    moe_top2_2nd_expert_sampling: bool = True
    """False with `--disable-moe-top2-2nd-expert-sampling`: top-2's second expert is the argmax of the other
    experts' logits instead of a Gumbel-max sample (drawn from torch's default generator, as DeepSpeed does)."""
    moe_loss_coeff: float = 0.1
    """`--moe-loss-coeff`: the loss is the LM loss + this x the sum of every MoE layer's load-balancing loss."""
    window_size: tuple[int, int] | None = None
    """Megatron-LM's `--window-size` (left, right) of sliding-window attention: on a layer with the window the query
    at position i attends the keys i - left .. i (left + 1 keys, itself included; Hugging Face's `sliding_window` is
    left + 1); right is 0 (attention is causal). None: every layer attends to the whole causal sequence; a left of
    -1 (upstream's "infinite") is stored as None. See `layer_windows` and `megatron_ds.model.sliding_window`."""
    window_attn_skip_freq: tuple[int, ...] | None = None
    """Which layers have the window (`--window-attn-skip-freq`), one 0 (full attention) or 1 (the window) per layer;
    None: every layer (upstream's default). Upstream's integer N (layer numbers from 1 that are multiples of N attend
    fully) is stored as its pattern, and a pattern of all ones as None (one spelling of the same model)."""

    def __post_init__(self) -> None:
        for flag, value in (
            ("--num-layers", self.num_layers),
            ("--hidden-size", self.hidden_size),
            ("--num-attention-heads", self.num_attention_heads),
            ("--ffn-hidden-size", self.ffn_hidden_size),
            ("--seq-length", self.seq_length),
            ("--max-position-embeddings", self.max_position_embeddings),
        ):
            at_least(flag, value, 1)
        at_least("--vocab-size", self.vocab_size, 0)
        self._check_head_size()
        nh, kv = self.num_attention_heads, self.num_key_value_heads
        if kv is not None:
            check(
                kv >= 1 and nh % kv == 0,
                f"--num-key-value-heads {kv} must divide --num-attention-heads {nh}; choose a divisor of {nh}",
            )
            if kv == nh:  # plain multi-head attention: one spelling, so equal models compare equal
                object.__setattr__(self, "num_key_value_heads", None)
        check(
            self.seq_length <= self.max_position_embeddings,
            f"--seq-length {self.seq_length} exceeds --max-position-embeddings {self.max_position_embeddings}; "
            f"raise --max-position-embeddings or shorten the sequence",
        )
        positive("--layernorm-epsilon", self.layernorm_epsilon)
        one_of("--normalization", self.normalization, NORMALIZATIONS)
        one_of("MLP activation", self.activation, ACTIVATIONS)
        positive("--rotary-base", self.rotary_base)
        check(
            math.isfinite(self.rotary_percent) and 0.0 < self.rotary_percent <= 1.0,
            f"--rotary-percent {self.rotary_percent} must be in (0, 1]",
        )
        positive("--rope-scaling-factor", self.rope_scaling_factor)
        if not self.use_rotary_position_embeddings:  # one spelling of the same model (as kv heads above)
            object.__setattr__(self, "rotary_base", DEFAULT_ROTARY_BASE)
            object.__setattr__(self, "rotary_percent", 1.0)
            object.__setattr__(self, "use_rope_scaling", False)
        if not self.use_rope_scaling:
            object.__setattr__(self, "rope_scaling_factor", DEFAULT_ROPE_SCALING_FACTOR)
        if self.add_bias_linear:
            object.__setattr__(self, "add_qkv_bias", False)
        if self.qk_l2_norm:
            object.__setattr__(self, "qk_layernorm", False)
        check_experts(self)
        self._check_window()
        dim = self.rotary_dim
        check(
            not self.use_rotary_position_embeddings or (dim >= 2 and dim % 2 == 0),
            f"--rotary-percent {self.rotary_percent} gives {dim} rotary channels of the head's {self.head_dim}; "
            f"rotary embeddings rotate channel pairs, so choose a share that gives an even number >= 2",
        )

    def _check_head_size(self) -> None:
        # Megatron-LM's rule: hidden / heads must be an integer only when it is the head size (no --kv-channels)
        h, nh, kv_channels = self.hidden_size, self.num_attention_heads, self.kv_channels
        if kv_channels is not None:
            at_least("--kv-channels", kv_channels, 1)
            if h % nh == 0 and kv_channels == h // nh:  # the default head size: one spelling of the same model
                object.__setattr__(self, "kv_channels", None)
            return
        check(
            h % nh == 0,
            f"--hidden-size {h} is not divisible by --num-attention-heads {nh}; "
            f"choose sizes whose ratio is an integer head size, or give the head size with --kv-channels",
        )

    def _check_window(self) -> None:
        window, pattern = self.window_size, self.window_attn_skip_freq
        if window is not None:
            window = tuple(int(n) for n in window)  # a JSON list on load
            given = ",".join(map(str, window))
            check(len(window) == 2, f"--window-size {given} must be two numbers LEFT,RIGHT, e.g. 4095,0")
            check(window[0] >= -1, f"--window-size {given}: LEFT must be >= 0, or -1 for no window")
            check(
                window[0] == -1 or window[1] == 0,
                f"--window-size {given}: RIGHT lets a token attend {window[1]} later tokens, but a GPT attends causally "
                f"(Megatron-LM's Transformer Engine attention replaces it by 0); give {window[0]},0",
            )
            window = None if window[0] == -1 else window
        if pattern is not None:
            pattern = tuple(int(n) for n in pattern)
            check(
                len(pattern) == self.num_layers and set(pattern) <= {0, 1},
                f"--window-attn-skip-freq {list(pattern)} must give one 0 (full attention) or 1 (the window) for each "
                f"of the --num-layers {self.num_layers} layers",
            )
            pattern = None if window is None or all(pattern) else pattern
            window = None if pattern is not None and not any(pattern) else window
        object.__setattr__(self, "window_size", window)
        object.__setattr__(self, "window_attn_skip_freq", pattern)

    @functools.cached_property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per transformer layer: the keys before each query that it attends (`window_size`'s left), or None for
        the whole causal sequence (Megatron-LM's `is_layer_window_attention` over layer numbers from 1)."""
        if self.window_size is None:
            return (None,) * self.num_layers
        pattern = self.window_attn_skip_freq or (1,) * self.num_layers
        return tuple(self.window_size[0] if on else None for on in pattern)

    @functools.cached_property  # the planner asks per candidate stage; O(layers) each time was most of its time
    def experts_per_layer(self) -> tuple[int, ...]:
        """Experts of each transformer layer (1: a dense MLP); see the module's `experts_per_layer`."""
        return experts_per_layer(self.num_experts, self.num_layers, self.expert_interval)

    @functools.cached_property
    def is_moe(self) -> bool:
        """Some layer has more than one expert (Megatron-DeepSpeed's `is_moe_model`)."""
        return any(n > 1 for n in self.experts_per_layer)

    @property
    def kv_heads(self) -> int:
        """Key/value heads actually used: num_key_value_heads, or num_attention_heads when None."""
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Channels per attention head: `kv_channels`, by default hidden_size / num_attention_heads."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_size(self) -> int:
        """Query heads x head size: the attention's width between the QKV and the output projection (megatron-core's
        `query_projection_size`; the hidden size unless `kv_channels` says otherwise)."""
        return self.num_attention_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that rotary embeddings rotate: int(head_dim x rotary_percent), as
        Megatron-DeepSpeed's and Megatron-LM's `rotary_dim`."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def qkv_rows(self) -> int:
        """Output features of the fused QKV projection: (heads + 2 kv heads) x head size, in the
        order all q heads, all k heads, all v heads."""
        return (self.num_attention_heads + 2 * self.kv_heads) * self.head_dim

    def has_bias(self, linear: str) -> bool:
        """Whether the layer's linear `linear` (qkv, proj, fc1, fc2) has a bias: all with add_bias_linear, else
        qkv alone with add_qkv_bias (megatron-core's `add_bias_linear or add_qkv_bias` on linear_qkv)."""
        return self.add_bias_linear or (self.add_qkv_bias and linear == "qkv")

    @property
    def gated_mlp(self) -> bool:
        """The MLP is gated (SwiGLU): fc1 holds a gate and an up half."""
        return self.activation in GATED_ACTIVATIONS

    @property
    def fc1_rows(self) -> int:
        """Output features of the MLP's first linear: ffn, or gate and up halves (2 ffn) when gated."""
        return 2 * self.ffn_hidden_size if self.gated_mlp else self.ffn_hidden_size


@dataclass(frozen=True)
class RegularizationConfig:
    """Dropout and the initial weights' scale: how training treats the weights, not their shapes.

    Nothing here is checked against a checkpoint: resuming or fine-tuning with other values is
    allowed, and rank 0 prints a one-line notice naming what changed. `init_method_std` belongs
    here rather than in `ModelConfig` because it only decides the first draw of the weights: a
    resumed or fine-tuned run loads its weights, so another value changes nothing there and must
    not be refused as "another architecture".
    """

    hidden_dropout: float = 0.1
    """Dropout after the embedding and on each residual branch (`--hidden-dropout`)."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities (`--attention-dropout`)."""
    init_method_std: float = 0.02
    """Std of the normal init; output projections use std/sqrt(2L) (`--init-method-std`)."""

    def __post_init__(self) -> None:
        probability("--hidden-dropout", self.hidden_dropout)
        probability("--attention-dropout", self.attention_dropout)
        positive("--init-method-std", self.init_method_std)
