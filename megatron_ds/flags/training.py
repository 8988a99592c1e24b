"""Flags of Megatron's groups "training" and "validation" (its "learning rate" and "mixed precision"
groups: `megatron_ds.flags.lr_precision`)."""

from __future__ import annotations

from megatron_ds.config import OPTIMIZERS
from megatron_ds.flags.declare import VALUE, Flag, Refusal, accepted, no_op, refused, switch

_TRAIN, _VAL = "training", "validation"
_SDPA = "attention is torch's scaled_dot_product_attention, which picks flash/memory-efficient kernels itself"
_NO_FUSION = "no hand-fused kernels here: the unfused torch ops compute the same function"
_DS_CKPT = (
    "Megatron's own checkpoint function (which distributes the saved activations) is not used: recomputation goes "
    "through deepspeed.checkpointing",
    "use --deepspeed-activation-checkpointing --partition-activations (DeepSpeed's partitioned checkpoints)",
)
_UNIFORM_ONLY = "DeepSpeed's PipelineModule recomputes uniform chunks only"
_FPDT_ONLY = "an FPDT setting, read only with --ds-sequence-parallel-fpdt (refused)"

TRAINING: tuple[Flag, ...] = (
    accepted(
        "--micro-batch-size",
        _TRAIN,
        "samples per micro-batch per data-parallel rank",
        "training.micro_batch_size",
        type=int,
        default=None,
        derived=True,  # 1 when not given
    ),
    accepted(
        "--global-batch-size",
        _TRAIN,
        "samples per optimizer step; written into the DeepSpeed JSON",
        "training.global_batch_size",
        type=int,
        default=None,
        derived=True,  # micro-batch x data-parallel size when not given
    ),
    accepted("--train-iters", _TRAIN, "optimizer steps", "training.train_iters", type=int, default=None, derived=True),
    accepted(
        "--train-samples",
        _TRAIN,
        "sample-based training: the training split's size; iterations = samples // global batch (a batch ramp-up's "
        "steps as Megatron-DeepSpeed counts them, a --step-batch-size-schedule's as Megatron-LM); lr flags must then "
        "be sample- or token-based",
        fields=("training.train_iters", "training.train_samples"),
        type=int,
        default=None,
        derived=True,
    ),
    accepted(
        "--train-tokens",
        _TRAIN,
        "also stop once this many tokens are consumed (the smaller limit wins); alone, it sets the length of training",
        "training.train_tokens",
        type=int,
    ),
    accepted(
        "--exit-interval", _TRAIN, "stop after an iteration divisible by this", "training.exit_interval", type=int
    ),
    accepted(
        "--exit-duration-in-mins",
        _TRAIN,
        "after the iteration that passes this many minutes, save (with --save) and stop, on every rank at the same "
        "iteration; no final evaluation",
        "training.exit_duration_in_mins",
        type=float,
    ),
    accepted(
        "--kill-switch-file",
        _TRAIN,
        "once this file exists, save (with --save) and exit with status 0; checked before every step, and every rank "
        "stops at the same iteration (upstream's ranks each look on their own); present before the first step: exit "
        "at once. No final evaluation",
        "training.kill_switch_file",
    ),
    accepted("--optimizer", _TRAIN, "`adam` (AdamW) or `sgd`", "optimizer.optimizer", choices=OPTIMIZERS),
    accepted(
        "--dataloader-type",
        _TRAIN,
        "only `single` (Megatron's pretraining sampler, what we use)",
        default="single",
        choices=("single",),
        refused_values=(
            Refusal(
                "cyclic",
                "only Megatron's single-pass pretraining sampler is implemented",
                "use --dataloader-type single (or drop it)",
            ),
        ),
    ),
    switch(
        "--checkpoint-activations",
        _TRAIN,
        "recompute transformer layers in chunks of --checkpoint-num-layers (DeepSpeed's PipelineModule "
        "activation_checkpoint_interval)",
        "training.checkpoint_activations",
        derived=True,
    ),
    accepted(
        "--checkpoint-num-layers",
        _TRAIN,
        "layers per recomputed chunk",
        "training.checkpoint_num_layers",
        type=int,
        default=None,
        derived=True,
    ),
    accepted(
        "--recompute-granularity",
        _TRAIN,
        "`full` (with --recompute-method uniform) is --checkpoint-activations; `selective` recomputes each layer's "
        "core attention in backward (as --recompute-activations)",
        fields=("training.checkpoint_activations", "training.selective_recompute"),
        derived=True,
        choices=("full", "selective"),
    ),
    accepted(
        "--recompute-method",
        _TRAIN,
        "`uniform` (chunks of --recompute-num-layers); `block` is refused",
        "training.checkpoint_activations",
        derived=True,
        choices=("uniform",),
        refused_values=(Refusal("block", _UNIFORM_ONLY, "use --recompute-method uniform"),),
    ),
    accepted(
        "--recompute-num-layers",
        _TRAIN,
        "layers per recomputed chunk with --recompute-method uniform",
        "training.checkpoint_num_layers",
        type=int,
        derived=True,
    ),
    accepted(
        "--activations-checkpoint-method",
        _TRAIN,
        "older name of --recompute-method; `uniform` turns recomputation on",
        "training.checkpoint_activations",
        derived=True,
        choices=("uniform",),
        refused_values=(Refusal("block", _UNIFORM_ONLY, "use --activations-checkpoint-method uniform"),),
    ),
    accepted(
        "--activations-checkpoint-num-layers",
        _TRAIN,
        "older name of --recompute-num-layers",
        "training.checkpoint_num_layers",
        type=int,
        derived=True,
    ),
    switch(
        "--no-pipeline-parallel",
        _TRAIN,
        "needs --pipeline-model-parallel-size 1. ZeRO 2/3 run on DeepSpeed's plain engine (as Megatron-DeepSpeed "
        "runs them); ZeRO 0/1 keep a 1-stage PipelineModule, whose engine runs the same micro-batch loop and "
        "optimizer step as the plain engine",
    ),
    no_op(
        "--use-flash-attn",
        _TRAIN,
        f"{_SDPA} (also spelled --use-flash-attn-v1, as Megatron-DeepSpeed declares it)",
        aliases=("--use-flash-attn-v1",),
    ),
    no_op("--use-flash-attn-v2", _TRAIN, _SDPA),
    no_op("--use-flash-attn-triton", _TRAIN, _SDPA),
    no_op("--use-flash-attn-builder", _TRAIN, _SDPA),
    no_op("--disable-mem-efficient-ln", _TRAIN, "apex's fused LayerNorm is not used: torch's computes the same norm"),
    no_op(
        "--ds_fused_adam",
        _TRAIN,
        "DeepSpeed's FusedAdam instead of apex's: the same Adam update; the optimizer here is DeepSpeed's or torch's",
    ),
    no_op(
        "--cpu_torch_adam",
        _TRAIN,
        "torch's Adam instead of DeepSpeed's CPU Adam under --cpu-optimizer: the same update; DeepSpeed's CPU Adam "
        "runs it here",
    ),
    no_op("--no-masked-softmax-fusion", _TRAIN, _NO_FUSION),
    switch(
        "--no-bias-gelu-fusion",
        _TRAIN,
        "exact (erf) GeLU. Megatron-DeepSpeed's default fused bias-GeLU computes GeLU's tanh approximation, and "
        "so does our default; without the fusion Megatron runs torch's exact GeLU, and so do we (also with "
        "--disable-bias-linear, which turns the fusion off there)",
        "model.activation",
        stores=False,
        dest="bias_gelu_fusion",
        default=True,
        derived=True,
    ),
    no_op("--no-bias-dropout-fusion", _TRAIN, _NO_FUSION),
    no_op("--no-gradient-accumulation-fusion", _TRAIN, _NO_FUSION),
    no_op("--no-persist-layer-norm", _TRAIN, _NO_FUSION),
    no_op("--no-async-tensor-model-parallel-allreduce", _TRAIN, "an overlap switch; the sums are the same"),
    switch(
        "--disable-bias-linear",
        _TRAIN,
        "linear layers without biases (and, as in Megatron, no fused bias-GeLU: exact GeLU unless --openai-gelu)",
        "model.add_bias_linear",
        stores=False,
        dest="add_bias_linear",
    ),
    refused("--batch-size", _TRAIN, "Megatron's deprecated name", "use --micro-batch-size", VALUE),
    accepted(
        "--rampup-batch-size",
        _TRAIN,
        "START INCREMENT SAMPLES: the global batch size starts at START and grows by INCREMENT in equal shares of "
        "SAMPLES consumed samples up to --global-batch-size (Megatron's ramp-up; DeepSpeed's engine runs the "
        "matching number of micro-batches each step, and checkpoints resume mid-ramp)",
        "training.rampup_batch_size",
        type=int,
        nargs=3,
        derived=True,
    ),
    switch(
        "--recompute-activations",
        _TRAIN,
        "selective recomputation: each layer's core attention (scores, softmax, attention dropout, the product "
        "with v) is recomputed in backward, the rest kept (Megatron's --recompute-granularity selective); not "
        "with full recomputation",
        "training.selective_recompute",
        derived=True,
    ),
    refused("--distribute-saved-activations", _TRAIN, *_DS_CKPT),
    refused("--distribute-checkpointed-activations", _TRAIN, *_DS_CKPT),
    switch(
        "--exit-signal-handler",
        _TRAIN,
        "on SIGTERM finish the step, save a checkpoint (needs --save) and exit with status 0; --load resumes from "
        "it exactly. Without it SIGTERM, like Ctrl-C, stops every rank at once with one line each",
        "training.exit_signal_handler",
    ),
    switch(
        "--cpu-optimizer",
        _TRAIN,
        "Adam on the host: DeepSpeed's CPU Adam (DeepSpeedCPUAdam, built on first use) with the optimizer offloaded "
        "(ZeRO's offload_optimizer, cpu unless --offload-optimizer says nvme); needs --zero-stage >= 1",
        "training.cpu_optimizer",
    ),
    switch(
        "--sequence-parallel",
        _TRAIN,
        "Megatron sequence parallelism with tensor parallelism: norms, dropout, residuals and what passes between "
        "pipeline stages are split along the sequence over the tensor ranks (megatron-core's sequence-parallel "
        "linears); at --tensor-model-parallel-size 1 it changes nothing (Megatron-LM turns it off there too; a "
        "NOTICE says so)",
        "parallel.sequence_parallel",
        derived=True,
    ),
    accepted(
        "--ds-sequence-parallel-size",
        _TRAIN,
        "DeepSpeed-Ulysses: groups of N ranks carved out of data parallelism split each sequence N ways, "
        "attention through DeepSpeed's DistributedAttention (all-to-all over heads); needs T = P = 1 and heads "
        "(and key/value heads) divisible by N; DeepSpeed's plain engine runs it",
        "parallel.ds_sequence_parallel_size",
        type=int,
    ),
    no_op(
        "--force-ds-sequence-parallel",
        _TRAIN,
        "DeepSpeed-Ulysses' DistributedAttention even at --ds-sequence-parallel-size 1, where its all-to-alls move "
        "nothing: the same attention on the same batches",
    ),
    refused(
        "--ds-sequence-parallel-fpdt",
        _TRAIN,
        "DeepSpeed's FPDT (Ulysses with chunked, optionally offloaded attention, MLP and loss for long sequences) is "
        "not implemented",
        "drop it; --ds-sequence-parallel-size N runs DeepSpeed-Ulysses",
    ),
    no_op("--ds-sequence-parallel-fpdt-chunk-size", _TRAIN, _FPDT_ONLY, VALUE),
    no_op("--ds-sequence-parallel-fpdt-offloading", _TRAIN, _FPDT_ONLY),
    refused(
        "--ds-inference",
        _TRAIN,
        "switches Megatron-DeepSpeed's transformer to the outputs of DeepSpeed's inference engine (text generation), "
        "which its training loop cannot take",
        "drop it; tools/generate.py generates from a checkpoint",
    ),
    refused(
        "--inference",
        _TRAIN,
        "Megatron-DeepSpeed's basic inference mode builds no optimizer or lr schedule, so nothing would train",
        "drop it; tools/generate.py generates from a checkpoint",
    ),
    refused(
        "--use-dataset-only",
        _TRAIN,
        "Megatron-DeepSpeed then builds only its datasets, for an external trainer (any value is true: argparse's "
        "bool), with samples its own pretrain_gpt.py cannot read",
        "drop it",
        VALUE,
    ),
    refused("--random-ltd", _TRAIN, "DeepSpeed data-efficiency (random-LTD) is not implemented"),
    switch(
        "--enable-zbh1-pipeline",
        _TRAIN,
        "the zero-bubble ZB-H1 schedule on DeepSpeed's pipeline engine (= --pp-schedule zbh1): backwards split into "
        "input and weight gradients, the weight passes filling 1F1B's drain; always with exact semantics (a NOTICE "
        "says so without --enable-zbh1-exact-semantics)",
        "parallel.pipeline_schedule",
        derived=True,
    ),
    switch(
        "--enable-zbh1-exact-semantics",
        _TRAIN,
        "ZB-H1 with exact semantics: the same gradients as 1F1B, summed in the same order (what ZB-H1 always does "
        "here); needs --enable-zbh1-pipeline",
    ),
)

VALIDATION: tuple[Flag, ...] = (
    accepted("--eval-interval", _VAL, "validate every this many iterations", "training.eval_interval", type=int),
    accepted("--eval-iters", _VAL, "batches per evaluation; 0 disables", "training.eval_iters", type=int),
    switch(
        "--skip-train",
        _VAL,
        "evaluate only: no training step and no save; the validation and test sets are evaluated (--eval-iters "
        "batches each) at the --load checkpoint's iteration, not written to TensorBoard or wandb",
        "training.skip_train",
    ),
)
