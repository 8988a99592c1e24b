"""The configuration tree: one frozen dataclass per concern, built once by `arguments.py`.

Precedence: command-line flags > `--deepspeed_config` file (merged, contradictions are errors) >
the defaults below. Run state (iteration, consumed samples) is *not* configuration: it lives in
`megatron_ds.training.state.TrainState`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

PRECISIONS = ("fp32", "bf16", "fp16")
DEDICATED_CHOICES = ("none", "pre", "post", "both")


@dataclass(frozen=True)
class ModelConfig:
    """GPT architecture. Every field here is checked against a checkpoint on resume."""

    num_layers: int
    """Number of transformer layers (`--num-layers`)."""
    hidden_size: int
    """Model width h (`--hidden-size`)."""
    num_attention_heads: int
    """Attention heads a; h must be divisible by a (`--num-attention-heads`)."""
    ffn_hidden_size: int
    """Width of the MLP's inner layer; 4h by default (`--ffn-hidden-size`)."""
    seq_length: int
    """Tokens per sample s (`--seq-length`)."""
    max_position_embeddings: int
    """Rows of the learned position embedding; >= seq_length (`--max-position-embeddings`)."""
    vocab_size: int
    """Padded vocabulary size: rows of the word embedding (see `--make-vocab-size-divisible-by`)."""
    hidden_dropout: float = 0.1
    """Dropout after the embedding and on each residual branch (`--hidden-dropout`)."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities (`--attention-dropout`)."""
    init_method_std: float = 0.02
    """Std of the normal init; output projections use std/sqrt(2L) (`--init-method-std`)."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of every norm (`--layernorm-epsilon`)."""
    normalization: str = "layernorm"
    """Norm type: `layernorm` or `rmsnorm` (`--normalization`)."""
    untie_embeddings_and_output_weights: bool = False
    """Give the post stage its own LM head instead of the tied word embedding."""
    num_key_value_heads: int | None = None
    """Key/value heads for grouped-query attention (`--num-key-value-heads`); divides
    num_attention_heads. None: one per attention head (multi-head attention, also what a value
    equal to --num-attention-heads gives). See `kv_heads`."""
    swiglu: bool = False
    """SwiGLU MLP instead of GeLU (`--swiglu`): fc1 produces 2 x ffn_hidden_size features,
    silu(first half) * second half feeds fc2, as Megatron's gated MLP."""
    use_rotary_position_embeddings: bool = False
    """Rotary position embeddings on q and k in every attention (`--use-rotary-position-embeddings`)."""
    add_position_embedding: bool = True
    """Add the learned absolute position embedding after the word embedding; False with
    `--no-position-embedding` (Llama-style models that use rotary embeddings only)."""
    add_bias_linear: bool = True
    """Biases in the attention and MLP linear layers; False with `--disable-bias-linear`."""

    @property
    def kv_heads(self) -> int:
        """Key/value heads actually used: num_key_value_heads, or num_attention_heads when None."""
        return self.num_key_value_heads or self.num_attention_heads


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over processes."""

    pipeline_model_parallel_size: int = 1
    """Pipeline stages P (`--pipeline-model-parallel-size`)."""
    tensor_model_parallel_size: int = 1
    """Tensor-parallel ranks T inside each stage (`--tensor-model-parallel-size`)."""
    data_parallel_size: int = 1
    """Derived: world size / (P * T)."""
    pp_dedicated_embedding_stages: str = "none"
    """`none`, `pre`, `post` or `both`: stages reserved for the pre/post-processing groups."""
    pp_layout: str | None = None
    """Explicit layout string in Megatron-LM's grammar, e.g. `E|t*3|t*3|L` (`--pp-layout`)."""
    pp_partition_method: str | None = None
    """DeepSpeed-style partition method (`uniform`, `parameters`, `type:REGEX`, weighted types)."""
    distributed_backend: str | None = None
    """`nccl` or `gloo`; None picks nccl on GPU and gloo on CPU (`--distributed-backend`)."""
    distributed_timeout_minutes: float = 10.0
    """A collective stalled longer than this is an error on every rank, never a silent hang."""

    @property
    def layout_method(self) -> str:
        """A short description of how stage boundaries are chosen."""
        if self.pp_layout is not None:
            return f"layout {self.pp_layout!r}"
        if self.pp_dedicated_embedding_stages != "none":
            return f"dedicated {self.pp_dedicated_embedding_stages}"
        return self.pp_partition_method or "type:transformer"


@dataclass(frozen=True)
class DataConfig:
    """Where samples come from and how text becomes tokens."""

    data_path: tuple[str, ...] = ()
    """One prefix, or a weighted blend `0.7 a 0.3 b` of `<prefix>.bin/.idx` (`--data-path`)."""
    split: str = "969,30,1"
    """Train/validation/test proportions of the documents (`--split`)."""
    data_cache_path: str | None = None
    """Where dataset index caches are written; next to the data by default (`--data-cache-path`)."""
    mock_data: bool = False
    """Deterministic synthetic tokens; no files needed (`--mock-data`)."""
    tokenizer_type: str | None = None
    """`SentencePieceTokenizer` or `GPT2BPETokenizer` (`--tokenizer-type`)."""
    tokenizer_model: str | None = None
    """SentencePiece model file (`--tokenizer-model`)."""
    vocab_file: str | None = None
    """GPT-2 BPE vocabulary (`--vocab-file`)."""
    merge_file: str | None = None
    """GPT-2 BPE merges (`--merge-file`)."""
    make_vocab_size_divisible_by: int = 128
    """The padded vocabulary is a multiple of this times T (`--make-vocab-size-divisible-by`)."""
    num_workers: int = 2
    """DataLoader worker processes (`--num-workers`)."""
    eod_mask_loss: bool = False
    """Exclude end-of-document tokens from the loss (`--eod-mask-loss`)."""


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer and learning-rate schedule."""

    optimizer: str = "adam"
    """`adam` (AdamW with decoupled weight decay, as Megatron) or `sgd` (`--optimizer`)."""
    lr: float = 1e-4
    """Peak learning rate (`--lr`)."""
    min_lr: float = 0.0
    """Floor of the decay (`--min-lr`)."""
    weight_decay: float = 0.01
    """Decoupled weight decay; not applied to biases and norm weights (`--weight-decay`)."""
    adam_beta1: float = 0.9
    """Adam beta1 (`--adam-beta1`)."""
    adam_beta2: float = 0.999
    """Adam beta2 (`--adam-beta2`)."""
    adam_eps: float = 1e-8
    """Adam epsilon (`--adam-eps`)."""
    sgd_momentum: float = 0.9
    """SGD momentum (`--sgd-momentum`)."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping (`--clip-grad`)."""
    lr_decay_style: str = "linear"
    """`constant`, `linear` or `cosine` (`--lr-decay-style`)."""
    lr_decay_iters: int | None = None
    """Iterations over which lr decays to min_lr; train iterations by default (`--lr-decay-iters`)."""
    lr_warmup_iters: int = 0
    """Linear warm-up iterations (`--lr-warmup-iters`); see also `--lr-warmup-fraction`."""
    lr_warmup_samples: int = 0
    """Linear warm-up over this many samples (`--lr-warmup-samples`; sample-based training)."""
    lr_decay_samples: int | None = None
    """Samples over which lr decays (`--lr-decay-samples`); --train-samples by default."""
    lr_warmup_tokens: int | None = None
    """Linear warm-up over this many tokens (`--lr-warmup-tokens`); tokens = samples x seq_length."""
    lr_decay_tokens: int | None = None
    """Tokens over which lr decays (`--lr-decay-tokens`); takes precedence over iterations/samples."""
    override_opt_param_scheduler: bool = False
    """On resume use the flags' schedule, not the checkpoint's (`--override-opt_param-scheduler`)."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On resume use the checkpoint's schedule, not the flags' (`--use-checkpoint-opt_param-scheduler`).
    With neither flag a difference between the two is an error."""


@dataclass(frozen=True)
class TrainingConfig:
    """Batch sizes, length of training, precision and memory savers."""

    micro_batch_size: int = 1
    """Samples per micro-batch per data-parallel rank (`--micro-batch-size`)."""
    global_batch_size: int = 1
    """Samples per optimizer step over all data-parallel ranks (`--global-batch-size`)."""
    train_iters: int = 0
    """Optimizer steps to train (`--train-iters`, or derived from `--train-samples`; capped by `--train-tokens`)."""
    eval_interval: int = 1000
    """Evaluate on the validation split every this many iterations (`--eval-interval`)."""
    eval_iters: int = 100
    """Batches per evaluation (`--eval-iters`); 0 disables evaluation."""
    seed: int = 1234
    """Seed of weights, data order and dropout (`--seed`)."""
    precision: str = "fp32"
    """`fp32`, `bf16` (`--bf16`) or `fp16` (`--fp16`)."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage; only 0 and 1 combine with pipeline parallelism (`--zero-stage`)."""
    checkpoint_activations: bool = False
    """Recompute transformer layers in backward (`--checkpoint-activations`, or Megatron's
    `--recompute-granularity full --recompute-method uniform`)."""
    checkpoint_num_layers: int = 1
    """Transformer layers per recomputed chunk (`--checkpoint-num-layers` / `--recompute-num-layers`)."""
    deepspeed_config: str | None = None
    """Optional user DeepSpeed JSON merged into the generated one (`--deepspeed_config`)."""
    exit_interval: int | None = None
    """Stop after this iteration (`--exit-interval`)."""
    exit_duration_in_mins: float | None = None
    """Save (with `--save`) and stop once training has run this long (`--exit-duration-in-mins`);
    checked after every iteration, the same on every rank."""
    train_tokens: int | None = None
    """Stop once this many tokens are consumed (`--train-tokens`); already folded into train_iters."""
    loss_scale: float | None = None
    """fp16 only: a static loss scale; None means dynamic scaling (`--loss-scale`)."""
    initial_loss_scale: float | None = None
    """fp16 only: first dynamic loss scale, a power of 2; DeepSpeed's 2**16 when None (`--initial-loss-scale`)."""
    min_loss_scale: float | None = None
    """fp16 only: floor of the dynamic loss scale; 1 when None (`--min-loss-scale`)."""
    loss_scale_window: int | None = None
    """fp16 only: steps without overflow before the scale doubles; 1000 when None (`--loss-scale-window`)."""
    hysteresis: int | None = None
    """fp16 only: overflows tolerated before the scale is lowered; 2 when None (`--hysteresis`)."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving and loading."""

    save: str | None = None
    """Directory checkpoints are written to (`--save`)."""
    save_interval: int | None = None
    """Save every this many iterations, and at the end (`--save-interval`)."""
    load: str | None = None
    """Directory to resume from (`--load`)."""
    load_optional: bool = False
    """Start fresh, with a warning, when `--load` holds no checkpoint yet (`--load-optional`)."""
    no_load_optim: bool = False
    """Load model weights only (`--no-load-optim`)."""
    no_load_rng: bool = False
    """Do not restore RNG states (`--no-load-rng`)."""
    finetune: bool = False
    """Load weights only and reset iteration and consumed samples to 0 (`--finetune`)."""


@dataclass(frozen=True)
class LoggingConfig:
    """What is printed and where."""

    log_interval: int = 100
    """Print one training line every this many iterations (`--log-interval`)."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars here (`--tensorboard-dir`)."""
    log_memory: bool = True
    """Print each stage's measured memory once, after the first log interval (`--log-memory`)."""
    tensorboard_queue_size: int = 1000
    """Events the TensorBoard writer buffers before flushing (`--tensorboard-queue-size`)."""
    log_timers_to_tensorboard: bool = False
    """Write the time per iteration (ms) to TensorBoard (`--log-timers-to-tensorboard`)."""
    log_batch_size_to_tensorboard: bool = False
    """Write the global batch size to TensorBoard (`--log-batch-size-to-tensorboard`)."""
    log_learning_rate_to_tensorboard: bool = True
    """Write the learning rate; off with Megatron's `--no-log-learnig-rate-to-tensorboard`."""
    log_loss_scale_to_tensorboard: bool = True
    """Write the fp16 loss scale; off with `--no-log-loss-scale-to-tensorboard`."""
    log_validation_ppl_to_tensorboard: bool = False
    """Write validation/test perplexity next to the loss (`--log-validation-ppl-to-tensorboard`)."""
    log_optimizer_states_to_tensorboard: bool = False
    """Write L2/L1 norms of the Adam moments and weights held by the logging rank (the last
    stage, its ZeRO partition) (`--log-optimizer-states-to-tensorboard`)."""
    log_memory_to_tensorboard: bool = False
    """Write the logging rank's measured memory when the memory report is made (`--log-memory-to-tensorboard`)."""
    log_world_size_to_tensorboard: bool = False
    """Write the world size (`--log-world-size-to-tensorboard`)."""


@dataclass(frozen=True)
class Config:
    """The whole configuration, passed explicitly to every component."""

    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def grad_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step on each data-parallel rank."""
        t = self.training
        return t.global_batch_size // (t.micro_batch_size * self.parallel.data_parallel_size)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able nested dict (stored in checkpoints)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        """Inverse of `to_dict`; unknown keys are ignored so older checkpoints stay readable."""
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        sub = {}
        for name, klass in _SECTIONS.items():
            if name in d:
                known = {f.name for f in dataclasses.fields(klass)}
                vals = {k: v for k, v in d[name].items() if k in known}
                if "data_path" in vals:
                    vals["data_path"] = tuple(vals["data_path"])
                sub[name] = klass(**vals)
        assert set(sub) <= set(kinds)
        return cls(**sub)

    def replace(self, **sections: Any) -> Config:
        """A copy with whole sections or `section__field=value` entries replaced."""
        updates: dict[str, Any] = {}
        for key, value in sections.items():
            if "__" in key:
                sec, fld = key.split("__", 1)
                base = updates.get(sec, getattr(self, sec))
                updates[sec] = dataclasses.replace(base, **{fld: value})
            else:
                updates[key] = value
        return dataclasses.replace(self, **updates)


_SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "data": DataConfig,
    "optimizer": OptimizerConfig,
    "training": TrainingConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}
