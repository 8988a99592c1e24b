"""Megatron-DeepSpeed `pretrain_gpt.py` flags: which we accept, which do nothing here, which we refuse.

This table is the one place that says so. `arguments.py` defines the accepted flags (with their
Megatron meaning) and registers the no-op and refused ones from here; a refused flag, or a refused
value of an accepted flag, is a one-line error with the reason below. The README's
"Megatron-DeepSpeed compatibility" table is `markdown_table()` (`python -m megatron_ds.compat`),
and a test keeps the two in sync. Flags Megatron-DeepSpeed does not have, or that no GPT launch
script uses, are unknown here: argparse says "unrecognized arguments".

Pure data and string functions: no torch, no argparse side effects at import.
"""

from __future__ import annotations

from dataclasses import dataclass

ACCEPTED, NO_OP, REFUSED, PENDING = "accepted", "no-op", "refused", "not yet"
SWITCH, VALUE, VALUES = "switch", "value", "values"
"""How many command-line values a flag takes: none, one, or any number (parsing no-op/refused flags)."""


@dataclass(frozen=True)
class Flag:
    """One Megatron-DeepSpeed flag and what `pretrain_gpt.py` does with it."""

    name: str
    status: str
    """ACCEPTED (same meaning), NO_OP (accepted, changes nothing here: `note` says why) or REFUSED."""
    group: str
    """Megatron-DeepSpeed's argument group (`megatron/arguments.py`)."""
    note: str
    """The meaning here (ACCEPTED), why nothing changes (NO_OP), or why not (REFUSED)."""
    fix: str = "drop it"
    """REFUSED only: what to do instead."""
    kind: str = SWITCH
    """NO_OP/REFUSED only: SWITCH, VALUE or VALUES, so the parser consumes the flag's values."""
    model_field: str | None = None
    """The ModelConfig field this flag sets, when the model may not implement it yet."""

    @property
    def effective_status(self) -> str:
        """PENDING while the model does not implement `model_field`, else `status`."""
        return PENDING if self.model_field in PENDING_MODEL_FIELDS else self.status


PENDING_MODEL_FIELDS: dict[str, str] = {}
"""ModelConfig fields the flags and validation carry but the model does not implement yet. A
non-default value is refused ("not implemented yet"); delete an entry once the model honours it."""

_NET, _LOG, _REG, _TRAIN = "network size", "logging", "regularization", "training"
_INIT, _LR, _CKPT, _MIXED = "initialization", "learning rate", "checkpointing", "mixed precision"
_DIST, _VAL, _DATA, _DS = "distributed", "validation", "data and tokenizer", "DeepSpeed, ZeRO, recompute"
_MOE_GROUP = "mixture of experts"

_SDPA = "attention is torch's scaled_dot_product_attention, which picks flash/memory-efficient kernels itself"
_NO_FUSION = "no hand-fused kernels here: the unfused torch ops compute the same function"
_DS_DP = "DeepSpeed's engine does the data-parallel gradient reduction; Megatron's DDP options do not apply"
_MOE = "mixture-of-experts models are not built here; train a dense model"
_ZERO_JSON = "ZeRO tuning lives in the DeepSpeed JSON; set the matching zero_optimization key in --deepspeed_config"
_DS_CKPT = (
    "recomputation uses deepspeed.checkpointing with its defaults; partitioned, contiguous, CPU and "
    "profiled checkpoints are not configured"
)

FLAGS: tuple[Flag, ...] = (
    # network size
    Flag("--num-layers", ACCEPTED, _NET, "transformer layers"),
    Flag("--hidden-size", ACCEPTED, _NET, "model width"),
    Flag("--ffn-hidden-size", ACCEPTED, _NET, "MLP inner width; 4 x hidden by default"),
    Flag("--num-attention-heads", ACCEPTED, _NET, "attention heads"),
    Flag(
        "--num-key-value-heads",
        ACCEPTED,
        _NET,
        "grouped-query attention: K/V heads, dividing the attention "
        "heads (and divisible by T); equal to --num-attention-heads is plain multi-head attention",
        model_field="num_key_value_heads",
    ),
    Flag("--kv-channels", ACCEPTED, _NET, "only hidden / heads, its default (other projection widths are not built)"),
    Flag(
        "--max-position-embeddings", ACCEPTED, _NET, "rows of the learned position embedding; --seq-length by default"
    ),
    Flag(
        "--use-rotary-position-embeddings",
        ACCEPTED,
        _NET,
        "rotary embeddings on q and k",
        model_field="use_rotary_position_embeddings",
    ),
    Flag(
        "--no-position-embedding",
        ACCEPTED,
        _NET,
        "no learned absolute position embedding",
        model_field="add_position_embedding",
    ),
    Flag("--make-vocab-size-divisible-by", ACCEPTED, _NET, "pad the vocabulary to a multiple of this x T"),
    Flag("--normalization", ACCEPTED, _NET, "`layernorm` or `rmsnorm`"),
    Flag("--layernorm-epsilon", ACCEPTED, _NET, "epsilon of every norm"),
    Flag(
        "--swiglu",
        ACCEPTED,
        _NET,
        "SwiGLU MLP (give --ffn-hidden-size explicitly, as the Llama-2 script does)",
        model_field="swiglu",
    ),
    Flag("--untie-embeddings-and-output-weights", ACCEPTED, _NET, "the last stage gets its own LM head"),
    Flag("--num-experts", ACCEPTED, _NET, "only 1 (a dense model, Megatron-DeepSpeed's default)"),
    Flag("--encoder-num-layers", REFUSED, _NET, "encoder-decoder models are not built", "use --num-layers", VALUE),
    Flag("--decoder-num-layers", REFUSED, _NET, "encoder-decoder models are not built", "use --num-layers", VALUE),
    Flag("--apply-layernorm-1p", REFUSED, _NET, "the 1+gamma norm parametrisation is not implemented"),
    Flag("--apply-residual-connection-post-layernorm", REFUSED, _NET, "the layer is pre-LN only"),
    Flag("--openai-gelu", REFUSED, _NET, "the MLP uses torch's exact GeLU; the tanh approximation is not built"),
    Flag("--squared-relu", REFUSED, _NET, "the MLP is GeLU (or SwiGLU); squared ReLU is not implemented"),
    Flag("--embedding-weights-in-fp32", REFUSED, _NET, "embeddings are kept in the training precision"),
    Flag("--mlp-type", REFUSED, _MOE_GROUP, _MOE, kind=VALUE),
    Flag("--topk", REFUSED, _MOE_GROUP, _MOE, kind=VALUE),
    Flag("--expert-interval", REFUSED, _MOE_GROUP, _MOE, kind=VALUE),
    Flag("--moe-expert-parallel-size", REFUSED, _MOE_GROUP, _MOE, kind=VALUE),
    Flag("--moe-train-capacity-factor", REFUSED, _MOE_GROUP, _MOE, kind=VALUE),
    Flag("--moe-eval-capacity-factor", REFUSED, _MOE_GROUP, _MOE, kind=VALUE),
    Flag("--moe-min-capacity", REFUSED, _MOE_GROUP, _MOE, kind=VALUE),
    Flag("--moe-loss-coeff", REFUSED, _MOE_GROUP, _MOE, kind=VALUE),
    Flag("--create-moe-param-group", REFUSED, _MOE_GROUP, _MOE),
    Flag("--disable-moe-token-dropping", REFUSED, _MOE_GROUP, _MOE),
    Flag("--use-tutel", REFUSED, _MOE_GROUP, _MOE),
    Flag("--enable-expert-tensor-parallelism", REFUSED, _MOE_GROUP, _MOE),
    # logging
    Flag("--log-interval", ACCEPTED, _LOG, "one Megatron-style line every this many iterations"),
    Flag("--tensorboard-dir", ACCEPTED, _LOG, "TensorBoard scalars, written by the last rank"),
    Flag("--tensorboard-queue-size", ACCEPTED, _LOG, "events the writer buffers before flushing"),
    Flag(
        "--log-timers-to-tensorboard",
        ACCEPTED,
        _LOG,
        "writes the time per iteration (ms); we time whole iterations only",
    ),
    Flag("--log-batch-size-to-tensorboard", ACCEPTED, _LOG, "writes the global batch size"),
    Flag(
        "--no-log-learnig-rate-to-tensorboard", ACCEPTED, _LOG, "stops writing the learning rate (Megatron's spelling)"
    ),
    Flag("--no-log-loss-scale-to-tensorboard", ACCEPTED, _LOG, "stops writing the fp16 loss scale"),
    Flag("--log-validation-ppl-to-tensorboard", ACCEPTED, _LOG, "writes validation and test perplexity"),
    Flag(
        "--log-optimizer-states-to-tensorboard",
        ACCEPTED,
        _LOG,
        "writes L1/L2 norms of the Adam moments and "
        "weights of the logging rank (last stage, its ZeRO partition), not all-reduced over ranks",
    ),
    Flag(
        "--log-memory-to-tensorboard",
        ACCEPTED,
        _LOG,
        "writes the logging rank's measured memory when the memory report is made (needs --log-memory, the default)",
    ),
    Flag("--log-world-size-to-tensorboard", ACCEPTED, _LOG, "writes the world size"),
    Flag("--timing-log-level", NO_OP, _LOG, "only whole iterations are timed", kind=VALUE),
    Flag("--timing-log-option", NO_OP, _LOG, "only whole iterations are timed", kind=VALUE),
    Flag("--log-params-norm", REFUSED, _LOG, "the parameter norm is not computed"),
    Flag("--log-num-zeros-in-grad", REFUSED, _LOG, "zeros in gradients are not counted"),
    Flag(
        "--tensorboard-log-interval",
        REFUSED,
        _LOG,
        "TensorBoard is written every --log-interval",
        "use --log-interval",
        VALUE,
    ),
    # regularization
    Flag("--attention-dropout", ACCEPTED, _REG, "dropout on attention probabilities"),
    Flag("--hidden-dropout", ACCEPTED, _REG, "dropout after the embedding and on residual branches"),
    Flag("--weight-decay", ACCEPTED, _REG, "decoupled weight decay, not on biases and norms"),
    Flag("--weight-decay-incr-style", ACCEPTED, _REG, "only `constant`, Megatron's default"),
    Flag("--clip-grad", ACCEPTED, _REG, "global gradient-norm clip (the true norm over all stages); 0 disables"),
    Flag("--adam-beta1", ACCEPTED, _REG, "Adam beta1"),
    Flag("--adam-beta2", ACCEPTED, _REG, "Adam beta2"),
    Flag("--adam-eps", ACCEPTED, _REG, "Adam epsilon"),
    Flag("--sgd-momentum", ACCEPTED, _REG, "SGD momentum"),
    Flag(
        "--start-weight-decay", REFUSED, _REG, "weight-decay schedules are not implemented", "use --weight-decay", VALUE
    ),
    Flag(
        "--end-weight-decay", REFUSED, _REG, "weight-decay schedules are not implemented", "use --weight-decay", VALUE
    ),
    # training
    Flag("--micro-batch-size", ACCEPTED, _TRAIN, "samples per micro-batch per data-parallel rank"),
    Flag("--global-batch-size", ACCEPTED, _TRAIN, "samples per optimizer step; written into the DeepSpeed JSON"),
    Flag("--train-iters", ACCEPTED, _TRAIN, "optimizer steps"),
    Flag(
        "--train-samples",
        ACCEPTED,
        _TRAIN,
        "sample-based training: iterations = ceil(samples / global batch) "
        "(Megatron rounds down); lr flags must then be sample- or token-based",
    ),
    Flag(
        "--train-tokens",
        ACCEPTED,
        _TRAIN,
        "also stop once this many tokens are consumed (the smaller limit wins); alone, it sets the length of training",
    ),
    Flag("--exit-interval", ACCEPTED, _TRAIN, "stop after an iteration divisible by this"),
    Flag(
        "--exit-duration-in-mins",
        ACCEPTED,
        _TRAIN,
        "after the iteration that passes this many minutes, save "
        "(with --save) and stop, on every rank at the same iteration; no final evaluation",
    ),
    Flag("--optimizer", ACCEPTED, _TRAIN, "`adam` (AdamW) or `sgd`"),
    Flag("--dataloader-type", ACCEPTED, _TRAIN, "only `single` (Megatron's pretraining sampler, what we use)"),
    Flag(
        "--checkpoint-activations",
        ACCEPTED,
        _TRAIN,
        "recompute transformer layers in chunks of "
        "--checkpoint-num-layers (DeepSpeed's PipelineModule activation_checkpoint_interval)",
    ),
    Flag("--checkpoint-num-layers", ACCEPTED, _TRAIN, "layers per recomputed chunk"),
    Flag(
        "--recompute-granularity",
        ACCEPTED,
        _TRAIN,
        "`full` with --recompute-method uniform is --checkpoint-activations; `selective` is refused",
    ),
    Flag("--recompute-method", ACCEPTED, _TRAIN, "`uniform` (chunks of --recompute-num-layers); `block` is refused"),
    Flag("--recompute-num-layers", ACCEPTED, _TRAIN, "layers per recomputed chunk with --recompute-method uniform"),
    Flag(
        "--activations-checkpoint-method",
        ACCEPTED,
        _TRAIN,
        "older name of --recompute-method; `uniform` turns recomputation on",
    ),
    Flag("--activations-checkpoint-num-layers", ACCEPTED, _TRAIN, "older name of --recompute-num-layers"),
    Flag(
        "--no-pipeline-parallel",
        ACCEPTED,
        _TRAIN,
        "needs --pipeline-model-parallel-size 1. We still build a "
        "1-stage PipelineModule: its engine runs the same micro-batch loop and optimizer step as DeepSpeed's "
        "plain engine; ZeRO 2/3, which only the plain engine has, stay refused",
    ),
    Flag("--use-flash-attn", NO_OP, _TRAIN, _SDPA),
    Flag("--use-flash-attn-v2", NO_OP, _TRAIN, _SDPA),
    Flag("--use-flash-attn-triton", NO_OP, _TRAIN, _SDPA),
    Flag("--no-masked-softmax-fusion", NO_OP, _TRAIN, _NO_FUSION),
    Flag("--no-bias-gelu-fusion", NO_OP, _TRAIN, _NO_FUSION),
    Flag("--no-bias-dropout-fusion", NO_OP, _TRAIN, _NO_FUSION),
    Flag("--no-gradient-accumulation-fusion", NO_OP, _TRAIN, _NO_FUSION),
    Flag("--no-persist-layer-norm", NO_OP, _TRAIN, _NO_FUSION),
    Flag("--no-async-tensor-model-parallel-allreduce", NO_OP, _TRAIN, "an overlap switch; the sums are the same"),
    Flag("--disable-bias-linear", ACCEPTED, _TRAIN, "linear layers without biases", model_field="add_bias_linear"),
    Flag("--batch-size", REFUSED, _TRAIN, "Megatron's deprecated name", "use --micro-batch-size", VALUE),
    Flag(
        "--rampup-batch-size",
        REFUSED,
        _TRAIN,
        "DeepSpeed's pipeline engine runs a fixed number of micro-batches per step",
        "train with the final --global-batch-size",
        VALUES,
    ),
    Flag(
        "--recompute-activations",
        REFUSED,
        _TRAIN,
        "selective (attention-only) recomputation is not implemented",
        "use --recompute-granularity full --recompute-method uniform",
    ),
    Flag("--distribute-saved-activations", REFUSED, _TRAIN, _DS_CKPT),
    Flag("--distribute-checkpointed-activations", REFUSED, _TRAIN, _DS_CKPT),
    Flag(
        "--exit-signal-handler",
        REFUSED,
        _TRAIN,
        "no signal handler saves on SIGTERM",
        "use --exit-duration-in-mins or --save-interval",
    ),
    Flag("--cpu-optimizer", REFUSED, _TRAIN, "the optimizer is torch's AdamW/SGD on the training device"),
    Flag(
        "--sequence-parallel",
        REFUSED,
        _TRAIN,
        "Megatron sequence parallelism is not implemented (tensor parallelism here keeps activations replicated)",
    ),
    Flag(
        "--ds-sequence-parallel-size",
        REFUSED,
        _TRAIN,
        "DeepSpeed-Ulysses sequence parallelism is not implemented",
        kind=VALUE,
    ),
    Flag("--random-ltd", REFUSED, _TRAIN, "DeepSpeed data-efficiency (random-LTD) is not implemented"),
    Flag("--enable-zbh1-pipeline", REFUSED, _TRAIN, "the schedule is DeepSpeed's 1F1B pipeline"),
    # initialization
    Flag("--seed", ACCEPTED, _INIT, "seed of weights (per layer spec, layout-independent), data order and dropout"),
    Flag("--init-method-std", ACCEPTED, _INIT, "std of the normal init; output projections std / sqrt(2 L)"),
    Flag("--data-parallel-random-init", REFUSED, _INIT, "replicas always start from the same weights"),
    Flag(
        "--init-method-xavier-uniform", REFUSED, _INIT, "only the normal init is implemented", "use --init-method-std"
    ),
    # learning rate
    Flag("--lr", ACCEPTED, _LR, "peak learning rate"),
    Flag("--min-lr", ACCEPTED, _LR, "floor of the decay"),
    Flag("--lr-decay-style", ACCEPTED, _LR, "`constant`, `linear`, `cosine` or `inverse-square-root`"),
    Flag("--lr-decay-iters", ACCEPTED, _LR, "decay length in iterations (iteration-based training)"),
    Flag("--lr-decay-samples", ACCEPTED, _LR, "decay length in samples (sample-based training)"),
    Flag("--lr-decay-tokens", ACCEPTED, _LR, "decay length in tokens (samples x seq length); wins over the others"),
    Flag("--lr-warmup-iters", ACCEPTED, _LR, "linear warm-up in iterations"),
    Flag("--lr-warmup-samples", ACCEPTED, _LR, "linear warm-up in samples"),
    Flag("--lr-warmup-tokens", ACCEPTED, _LR, "linear warm-up in tokens"),
    Flag("--lr-warmup-fraction", ACCEPTED, _LR, "warm-up as a fraction of the decay length"),
    Flag(
        "--override-opt_param-scheduler",
        ACCEPTED,
        _LR,
        "on resume, use the flags' schedule, not the "
        "checkpoint's (without either flag a difference is an error); older name --override-lr-scheduler",
    ),
    Flag(
        "--use-checkpoint-opt_param-scheduler",
        ACCEPTED,
        _LR,
        "on resume, keep the checkpoint's schedule; older name --use-checkpoint-lr-scheduler",
    ),
    Flag("--warmup", REFUSED, _LR, "Megatron's deprecated name", "use --lr-warmup-fraction", VALUE),
    # checkpointing
    Flag("--save", ACCEPTED, _CKPT, "written atomically through DeepSpeed's engine"),
    Flag("--save-interval", ACCEPTED, _CKPT, "save every this many iterations, and at the end"),
    Flag(
        "--load",
        ACCEPTED,
        _CKPT,
        "resume from `latest`. Unlike Megatron, a directory without a checkpoint is "
        "an error unless --load-optional (ours) is given",
    ),
    Flag(
        "--no-load-optim",
        ACCEPTED,
        _CKPT,
        "weights only (the iteration is kept; the lr schedule restarts, as in Megatron)",
    ),
    Flag("--no-load-rng", ACCEPTED, _CKPT, "keep this run's RNG states"),
    Flag("--finetune", ACCEPTED, _CKPT, "weights only; iteration and consumed samples start at 0"),
    Flag("--exit-on-missing-checkpoint", NO_OP, _CKPT, "already the behaviour here (see --load)"),
    Flag("--no-save-optim", REFUSED, _CKPT, "checkpoints always hold the optimizer state"),
    Flag("--no-save-rng", REFUSED, _CKPT, "checkpoints always hold every rank's RNG state"),
    Flag(
        "--no-load-lr-state",
        REFUSED,
        _CKPT,
        "the lr schedule is restored with the optimizer",
        "use --override-opt_param-scheduler",
    ),
    Flag(
        "--use-checkpoint-args",
        REFUSED,
        _CKPT,
        "flags are not read back from checkpoints (the architecture is checked against them)",
        "give the model flags",
    ),
    Flag("--no-initialization", REFUSED, _CKPT, "weights are always initialised"),
    Flag(
        "--universal-checkpoint",
        REFUSED,
        _CKPT,
        "weights carry across layouts and P without it; optimizer state does not",
        "use --no-load-optim to change the layout",
    ),
    # mixed precision
    Flag("--fp16", ACCEPTED, _MIXED, "DeepSpeed fp16 with dynamic loss scaling (needs a GPU)"),
    Flag("--bf16", ACCEPTED, _MIXED, "DeepSpeed bf16"),
    Flag("--loss-scale", ACCEPTED, _MIXED, "fp16: a static loss scale (DeepSpeed fp16.loss_scale)"),
    Flag(
        "--initial-loss-scale",
        ACCEPTED,
        _MIXED,
        "fp16: a power of 2 (fp16.initial_scale_power); DeepSpeed's 2^16 when not given, as in Megatron-DeepSpeed",
    ),
    Flag("--min-loss-scale", ACCEPTED, _MIXED, "fp16: fp16.min_loss_scale"),
    Flag("--loss-scale-window", ACCEPTED, _MIXED, "fp16: fp16.loss_scale_window"),
    Flag(
        "--hysteresis",
        ACCEPTED,
        _MIXED,
        "fp16: fp16.hysteresis. The loss-scale flags are written into the "
        "DeepSpeed JSON; without --fp16 they are ignored with a warning",
    ),
    Flag(
        "--no-query-key-layer-scaling",
        NO_OP,
        _MIXED,
        "query-key layer scaling divides the scores by the layer "
        "number and multiplies them back inside Megatron's fp16 softmax; the math is the identity, and SDPA "
        "scales by 1/sqrt(head dim) only",
    ),
    Flag(
        "--attention-softmax-in-fp32",
        NO_OP,
        _MIXED,
        "it switches Megatron's own fused softmax, which is not "
        "used: SDPA's fused kernels accumulate the softmax in fp32",
    ),
    Flag(
        "--accumulate-allreduce-grads-in-fp32",
        NO_OP,
        _MIXED,
        "DeepSpeed's bf16 optimizer accumulates gradients in fp32",
    ),
    Flag("--fp32-residual-connection", REFUSED, _MIXED, "the residual stream stays in the training precision"),
    Flag("--fp16-lm-cross-entropy", REFUSED, _MIXED, "the loss is always computed from fp32 logits"),
    # distributed
    Flag("--tensor-model-parallel-size", ACCEPTED, _DIST, "tensor-parallel ranks T (megatron-core layers)"),
    Flag("--pipeline-model-parallel-size", ACCEPTED, _DIST, "pipeline stages P"),
    Flag(
        "--standalone-embedding-stage",
        ACCEPTED,
        _DIST,
        "the input embedding on a stage of its own: our --pp-dedicated-embedding-stages pre (both with post)",
    ),
    Flag("--distributed-backend", ACCEPTED, _DIST, "`nccl` or `gloo`; gloo by default on CPU"),
    Flag("--distributed-timeout-minutes", ACCEPTED, _DIST, "process-group timeout, and our stall watchdog"),
    Flag("--local_rank", ACCEPTED, _DIST, "set by the deepspeed launcher; the environment is used"),
    Flag("--DDP-impl", NO_OP, _DIST, _DS_DP, kind=VALUE),
    Flag("--use-contiguous-buffers-in-local-ddp", NO_OP, _DIST, _DS_DP),
    Flag("--no-contiguous-buffers-in-local-ddp", NO_OP, _DIST, _DS_DP),
    Flag("--no-scatter-gather-tensors-in-pipeline", NO_OP, _DIST, "DeepSpeed's pipeline sends whole activations"),
    Flag("--use-cpu-initialization", NO_OP, _DIST, "weights are always drawn on CPU from per-spec generators"),
    Flag(
        "--empty-unused-memory-level", NO_OP, _DIST, "a CUDA cache housekeeping switch; numerics unchanged", kind=VALUE
    ),
    Flag("--pipeline-model-parallel-split-rank", REFUSED, _DIST, "encoder-decoder models are not built", kind=VALUE),
    Flag(
        "--model-parallel-size", REFUSED, _DIST, "Megatron's deprecated name", "use --tensor-model-parallel-size", VALUE
    ),
    Flag(
        "--num-layers-per-virtual-pipeline-stage",
        REFUSED,
        _DIST,
        "interleaved (virtual) pipeline stages are not in DeepSpeed's pipeline engine",
        "use --pp-layout for uneven stages",
        VALUE,
    ),
    Flag(
        "--use-distributed-optimizer",
        REFUSED,
        _DIST,
        "Megatron's distributed optimizer is not used",
        "use --zero-stage 1 (DeepSpeed's equivalent)",
    ),
    Flag("--lazy-mpu-init", REFUSED, _DIST, "the process group is always initialised", kind=VALUE),
    Flag("--use-ring-exchange-p2p", REFUSED, _DIST, "DeepSpeed's pipeline does its own point-to-point"),
    # validation
    Flag("--eval-interval", ACCEPTED, _VAL, "validate every this many iterations"),
    Flag("--eval-iters", ACCEPTED, _VAL, "batches per evaluation; 0 disables"),
    Flag("--skip-train", REFUSED, _VAL, "evaluation-only runs are not implemented"),
    # data
    Flag("--data-path", ACCEPTED, _DATA, "a prefix or a weighted blend, through megatron-core's GPTDataset"),
    Flag("--split", ACCEPTED, _DATA, "train/validation/test weights"),
    Flag("--data-cache-path", ACCEPTED, _DATA, "where index caches go"),
    Flag("--mock-data", ACCEPTED, _DATA, "seeded synthetic tokens (our MockGPTData; values follow --seed)"),
    Flag("--data-impl", ACCEPTED, _DATA, "only `mmap`, the format our tools and megatron-core write"),
    Flag("--seq-length", ACCEPTED, _DATA, "tokens per sample"),
    Flag("--vocab-size", ACCEPTED, _DATA, "vocabulary size; else the tokenizer's (then padded)"),
    Flag("--vocab-file", ACCEPTED, _DATA, "GPT-2 vocab.json"),
    Flag("--merge-file", ACCEPTED, _DATA, "GPT-2 merges.txt"),
    Flag("--vocab-extra-ids", ACCEPTED, _DATA, "only 0 (extra sentinel ids are for T5)"),
    Flag(
        "--tokenizer-type",
        ACCEPTED,
        _DATA,
        "`GPT2BPETokenizer` (the default with --vocab-file/--merge-file, "
        "as in Megatron's pretrain_gpt.py), `SentencePieceTokenizer` or `GPTSentencePieceTokenizer`. "
        "SentencePieceTokenizer is Megatron's GPTSentencePieceTokenizer here: eod is the model's eos and no "
        "special tokens are added",
    ),
    Flag("--tokenizer-model", ACCEPTED, _DATA, "SentencePiece model file"),
    Flag("--num-workers", ACCEPTED, _DATA, "DataLoader worker processes"),
    Flag("--eod-mask-loss", ACCEPTED, _DATA, "end-of-document tokens do not count in the loss"),
    Flag(
        "--train-data-path",
        REFUSED,
        _DATA,
        "separate split files are not supported",
        "use --data-path with --split",
        VALUES,
    ),
    Flag(
        "--valid-data-path",
        REFUSED,
        _DATA,
        "separate split files are not supported",
        "use --data-path with --split",
        VALUES,
    ),
    Flag(
        "--test-data-path",
        REFUSED,
        _DATA,
        "separate split files are not supported",
        "use --data-path with --split",
        VALUES,
    ),
    Flag("--encoder-seq-length", REFUSED, _DATA, "encoder-decoder models are not built", "use --seq-length", VALUE),
    Flag("--decoder-seq-length", REFUSED, _DATA, "encoder-decoder models are not built", "use --seq-length", VALUE),
    Flag("--reset-position-ids", REFUSED, _DATA, "position ids always run 0..s-1 within a sample"),
    Flag("--reset-attention-mask", REFUSED, _DATA, "attention is causal over the whole sample (SDPA is_causal)"),
    Flag("--data-efficiency-curriculum-learning", REFUSED, _DATA, "DeepSpeed curriculum learning is not implemented"),
    # DeepSpeed, ZeRO and activation checkpointing
    Flag("--deepspeed", ACCEPTED, _DS, "always on: training runs on DeepSpeed's pipeline engine"),
    Flag(
        "--deepspeed_config",
        ACCEPTED,
        _DS,
        "merged into the JSON generated from the flags; a contradiction is "
        "an error (keys no flag sets, e.g. steps_per_print or fp16 keys whose flag is not given, are taken)",
    ),
    Flag(
        "--zero-stage",
        ACCEPTED,
        _DS,
        "0 or 1, written into the JSON; 2 and 3 are refused (the pipeline engine asserts ZeRO < 2 at every P)",
    ),
    Flag(
        "--deepspeed-activation-checkpointing",
        NO_OP,
        _DS,
        "recomputation always goes through "
        "deepspeed.checkpointing; turn it on with --checkpoint-activations or --recompute-granularity full "
        "(a warning says so when neither is given)",
    ),
    Flag("--partition-activations", REFUSED, _DS, _DS_CKPT),
    Flag("--contigious-checkpointing", REFUSED, _DS, _DS_CKPT),
    Flag("--checkpoint-in-cpu", REFUSED, _DS, _DS_CKPT),
    Flag("--synchronize-each-layer", REFUSED, _DS, _DS_CKPT),
    Flag("--profile-backward", REFUSED, _DS, _DS_CKPT),
    Flag("--zero-reduce-scatter", REFUSED, _DS, _ZERO_JSON),
    Flag("--zero-contigious-gradients", REFUSED, _DS, _ZERO_JSON),
    Flag("--zero-reduce-bucket-size", REFUSED, _DS, _ZERO_JSON, kind=VALUE),
    Flag("--zero-allgather-bucket-size", REFUSED, _DS, _ZERO_JSON, kind=VALUE),
    Flag(
        "--remote-device",
        REFUSED,
        _DS,
        "ZeRO-3 parameter offload needs ZeRO-3, which the pipeline engine refuses",
        kind=VALUE,
    ),
    Flag("--use-pin-memory", REFUSED, _DS, "ZeRO-3 parameter offload needs ZeRO-3, which the pipeline engine refuses"),
    Flag("--scattered-embeddings", REFUSED, _DS, "memory-centric tiling is not implemented"),
    Flag("--split-transformers", REFUSED, _DS, "memory-centric tiling is not implemented"),
    Flag("--memory-centric-tiled-linear", REFUSED, _DS, "memory-centric tiling is not implemented"),
    Flag("--tile-factor", REFUSED, _DS, "memory-centric tiling is not implemented", kind=VALUE),
)

BY_NAME: dict[str, Flag] = {f.name: f for f in FLAGS}
assert len(BY_NAME) == len(FLAGS), "a flag is listed twice"

REFUSED_VALUES: dict[tuple[str, str], tuple[str, str]] = {
    ("--recompute-granularity", "selective"): (
        "selective (attention-only) recomputation is not implemented",
        "use --recompute-granularity full --recompute-method uniform",
    ),
    ("--recompute-method", "block"): (
        "DeepSpeed's PipelineModule recomputes uniform chunks only",
        "use --recompute-method uniform",
    ),
    ("--activations-checkpoint-method", "block"): (
        "DeepSpeed's PipelineModule recomputes uniform chunks only",
        "use --activations-checkpoint-method uniform",
    ),
    ("--data-impl", "infer"): ("only the mmap format is read", "use --data-impl mmap (or drop it)"),
    ("--data-impl", "lazy"): ("only the mmap format is read", "convert with tools/preprocess_data.py and use mmap"),
    ("--data-impl", "cached"): ("only the mmap format is read", "convert with tools/preprocess_data.py and use mmap"),
    ("--dataloader-type", "cyclic"): (
        "only Megatron's single-pass pretraining sampler is implemented",
        "use --dataloader-type single (or drop it)",
    ),
    ("--distributed-backend", "ccl"): ("only nccl and gloo are set up", "use nccl (GPU) or gloo (CPU)"),
    ("--distributed-backend", "hccl"): ("only nccl and gloo are set up", "use nccl (GPU) or gloo (CPU)"),
    ("--tokenizer-type", "BertWordPieceLowerCase"): (
        "BERT tokenizers are not provided",
        "use GPT2BPETokenizer or SentencePieceTokenizer",
    ),
    ("--tokenizer-type", "BertWordPieceCase"): (
        "BERT tokenizers are not provided",
        "use GPT2BPETokenizer or SentencePieceTokenizer",
    ),
    ("--tokenizer-type", "HFTokenizer"): (
        "Hugging Face tokenizers are not provided",
        "use GPT2BPETokenizer or SentencePieceTokenizer",
    ),
    ("--tokenizer-type", "NullTokenizer"): (
        "training reads token ids through a real tokenizer (the null "
        "tokenizer is for tools/preprocess_data.py, with its own eod)",
        "use --mock-data --vocab-size N for synthetic tokens",
    ),
    ("--weight-decay-incr-style", "linear"): ("weight-decay schedules are not implemented", "use constant"),
    ("--weight-decay-incr-style", "cosine"): ("weight-decay schedules are not implemented", "use constant"),
    ("--zero-stage", "2"): (
        "DeepSpeed's pipeline engine, used at every pipeline size (also with "
        "--no-pipeline-parallel), supports ZeRO 0 and 1 only",
        "use --zero-stage 1",
    ),
    ("--zero-stage", "3"): (
        "DeepSpeed's pipeline engine, used at every pipeline size (also with "
        "--no-pipeline-parallel), supports ZeRO 0 and 1 only",
        "use --zero-stage 1",
    ),
}
"""Values of accepted flags that are refused, with (reason, fix)."""

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer")


def refusal_message(name: str, value: str | None = None) -> str:
    """The one-line message for a refused flag, or for a refused value of an accepted flag."""
    if value is None:
        f = BY_NAME[name]
        assert f.status == REFUSED, name
        return f"{name} is not supported: {f.note}; {f.fix}"
    reason, fix = REFUSED_VALUES[(name, value)]
    return f"{name} {value} is not supported: {reason}; {fix}"


def refused_flags_message(names: list[str]) -> str:
    """One line for one or more refused flags, in the order given."""
    return " | ".join(refusal_message(n) for n in dict.fromkeys(names))


def refused_value_choices(name: str) -> tuple[str, ...]:
    """The refused values of `name` (they are valid argparse choices, refused by validation)."""
    return tuple(v for (n, v) in REFUSED_VALUES if n == name)


def pending_message(field: str, flag: str) -> str:
    """The message for a model option the model does not implement yet."""
    return (
        f"{flag} is not implemented yet: the model does not build {PENDING_MODEL_FIELDS[field]} yet "
        f"(ModelConfig.{field}); drop {flag}"
    )


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table() -> str:
    """The README table: every flag, grouped as Megatron-DeepSpeed groups them."""
    lines = ["| group | flag | here | meaning, or why not |", "|---|---|---|---|"]
    for f in FLAGS:
        status = f.effective_status
        note = f.note
        if status == REFUSED and f.fix:
            note = f"{note}; {f.fix}"
        if status == PENDING:
            note = f"{note}. Parsed and validated; a non-default value is refused as not implemented yet"
        values = [v for (n, v) in REFUSED_VALUES if n == f.name]
        if values:
            note = f"{note} (refused: {', '.join(f'`{v}`' for v in values)})"
        lines.append(f"| {f.group} | `{f.name}` | {status} | {_cell(note)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
