"""Megatron-LM's flags that Megatron-DeepSpeed lacks (its `examples/gpt3/train_gpt3_175b_distributed.sh`
and `examples/llama/train_llama3_8b_h100_fp8.sh` use them), grouped as `megatron_ds.flags.registry`
splices them into Megatron-DeepSpeed's groups: here those of the network size, training, mixed
precision, Transformer Engine and distributed groups, and `GROUPS`, every table of Megatron-LM's
flags; its data, checkpointing and logging flags are in `megatron_ds.flags.megatron_lm_io`. Each
means what it means in Megatron-LM, changes nothing here (the help says why), or is refused; FP8
(Transformer Engine) and context parallelism above 1 are refused.
"""

from __future__ import annotations

import megatron_ds.flags.megatron_lm_io as megatron_lm_io
import megatron_ds.flags.megatron_lm_moe as megatron_lm_moe
from megatron_ds.flags.declare import MEGATRON_LM, VALUE, Flag, Refusal, accepted, no_op, refused, switch

_NET, _TRAIN, _DIST, _TE = "network size", "training", "distributed", "Transformer Engine"
_FP8 = "FP8 training runs on Transformer Engine, which is not used here (the layers are torch's)"
_FP8_FIX = "drop the --fp8-* flags and train in --bf16"
_CP = "context parallelism is not implemented"

NETWORK: tuple[Flag, ...] = (
    no_op(
        "--use-mcore-models",
        _NET,
        f"{MEGATRON_LM}: megatron-core's GPTModel; the one GPT here is built from the same options (Megatron-LM "
        "itself builds only megatron-core models now)",
    ),
    accepted(
        "--transformer-impl",
        _NET,
        f"{MEGATRON_LM}: `local` or `transformer_engine` compute the same (non-FP8) layers; torch's kernels run them "
        "here (FP8 is refused)",
        choices=("local", "transformer_engine"),
    ),
    accepted(
        "--attention-backend",
        _NET,
        f"{MEGATRON_LM}: every backend computes the same softmax attention; torch's scaled_dot_product_attention picks "
        "its flash or memory-efficient kernel itself",
        choices=("auto", "flash", "fused", "unfused", "local"),
    ),
    accepted(
        "--position-embedding-type",
        _NET,
        f"{MEGATRON_LM}: `learned_absolute` (the learned table, the default), `rope` (rotary embeddings, no table, as "
        "--use-rotary-position-embeddings) or `none`",
        fields=("model.use_rotary_position_embeddings", "model.add_position_embedding"),
        derived=True,
        choices=("learned_absolute", "rope", "none"),
        refused_values=tuple(
            Refusal(v, "only learned absolute, rotary or no position embeddings are built", "use rope")
            for v in ("mrope", "relative", "yarn")
        ),
    ),
    switch(
        "--group-query-attention",
        _NET,
        f"{MEGATRON_LM}: grouped-query attention with --num-query-groups K/V heads (1 when not given, as Megatron-LM)",
        "model.num_key_value_heads",
        derived=True,
    ),
    accepted(
        "--num-query-groups",
        _NET,
        f"{MEGATRON_LM}: K/V heads with --group-query-attention (ignored without it, as in Megatron-LM); "
        "--num-key-value-heads is the same",
        "model.num_key_value_heads",
        type=int,
        derived=True,
    ),
    switch(
        "--use-rope-scaling",
        _NET,
        f"{MEGATRON_LM}: Llama 3.x's RoPE frequency scaling (long wavelengths divided by --rope-scaling-factor, short ones "
        "kept, smoothed between; megatron-core's fixed low/high frequency factors 1 and 4 and original context "
        "8192); ignored, with a warning, without rotary embeddings",
        "model.use_rope_scaling",
    ),
    accepted(
        "--rope-scaling-factor",
        _NET,
        f"{MEGATRON_LM}: the factor of --use-rope-scaling (8 for Llama 3.1 and 3.3, 32 for Llama 3.2); ignored, with a "
        "warning, without it",
        "model.rope_scaling_factor",
        type=float,
    ),
    no_op(
        "--apply-query-key-layer-scaling",
        _NET,
        f"{MEGATRON_LM}: an fp16 safeguard that divides the scores by the layer number before the softmax and multiplies "
        "them back inside it; the same attention (the softmax here runs in fp32)",
    ),
    switch(
        "--add-qkv-bias",
        _NET,
        f"{MEGATRON_LM}: a bias on the query/key/value projection even with --disable-bias-linear (Qwen2's layout; zero "
        "at init, split over tensor ranks with the QKV rows); implied without --disable-bias-linear",
        "model.add_qkv_bias",
    ),
    switch(
        "--qk-layernorm",
        _NET,
        f"{MEGATRON_LM}: a norm over each query and each key head after the QKV projection, before rotary embeddings "
        "(megatron-core's q_layernorm and k_layernorm; Qwen3's q_norm and k_norm): the --normalization kind with "
        "its epsilon, replicated over tensor ranks, its gradients summed over them",
        "model.qk_layernorm",
    ),
    switch(
        "--qk-l2-norm",
        _NET,
        f"{MEGATRON_LM}: Llama 4's query and key norm, x * rsqrt(mean(x^2) + eps) over each query and each key head in "
        "float32, no weights, after the QKV projection and before rotary embeddings, on every layer (megatron-core's "
        "L2Norm; eps is --norm-epsilon); with --qk-layernorm it replaces that norm, as in Megatron-LM (a warning says "
        "so)",
        "model.qk_l2_norm",
    ),
    accepted(
        "--window-size",
        _NET,
        f"{MEGATRON_LM}: sliding-window attention LEFT,RIGHT (e.g. 4095,0): on a layer with the window each token attends "
        "itself and the LEFT tokens before it (Hugging Face's sliding_window is LEFT + 1), within its document with "
        "--reset-attention-mask; RIGHT must be 0 (causal); LEFT -1: no window",
        "model.window_size",
        derived=True,
    ),
    accepted(
        "--window-attn-skip-freq",
        _NET,
        f"{MEGATRON_LM}: which layers have --window-size's window: N (every layer but the N-th, 2N-th, ...; they attend "
        "fully) or a list pattern such as ([1]*3+[0])*2, one 1 (window) or 0 (full) per layer; all when not given",
        "model.window_attn_skip_freq",
        derived=True,
    ),
    refused(
        "--rotary-interleaved",
        _NET,
        f"{MEGATRON_LM}: rotary embeddings here rotate the two halves of each head (Megatron's and Llama's default), not "
        "interleaved pairs",
        "drop it",
    ),
    no_op(
        "--no-rope-fusion",
        _NET,
        f"{MEGATRON_LM}: an unfused kernel of the same rotary embeddings; torch's operations apply them here",
    ),
    no_op(
        "--no-bias-swiglu-fusion",
        _NET,
        f"{MEGATRON_LM}: an unfused kernel of the same bias and SwiGLU; torch's operations compute them here",
    ),
)

TRAINING: tuple[Flag, ...] = (
    accepted(
        "--step-batch-size-schedule",
        _TRAIN,
        f"{MEGATRON_LM}: 'THRESHOLD:BATCH ...' (K/M/B/T suffixes); thresholds are tokens, converted to samples by "
        "--seq-length as Megatron-LM does; the last batch size is the global batch size (--global-batch-size "
        "may be given too only if equal). The pairs may come as one word or several: Megatron-LM's own 175B "
        "script expands its quoted schedule unquoted, so its argparse receives several words and refuses them",
        "training.step_batch_size_schedule",
        nargs="+",
        derived=True,
    ),
    accepted(
        "--decoupled-lr",
        _TRAIN,
        f"{MEGATRON_LM}: peak learning rate of the word embedding and output layer weights (their own optimizer "
        "group; warm-up and decay as --lr's)",
        "optimizer.decoupled_lr",
        type=float,
    ),
    refused(
        "--apply-wd-to-qk-layernorm",
        _TRAIN,
        f"{MEGATRON_LM}: weight decay on the --qk-layernorm norms is not built; here, as in Megatron-LM without it, no "
        "norm weight decays",
        "drop it (a run that had it decayed those norms)",
    ),
    accepted(
        "--decoupled-min-lr",
        _TRAIN,
        f"{MEGATRON_LM}: the floor of that group's decay (--min-lr when not given)",
        "optimizer.decoupled_min_lr",
        type=float,
    ),
    switch(
        "--calculate-per-token-loss",
        _TRAIN,
        f"{MEGATRON_LM}: the loss is averaged over every token of the global batch rather than per micro-batch. The two "
        "are one while every micro-batch counts all its tokens, as here: with --eod-mask-loss they differ and it "
        "is refused, and a batch whose loss mask drops a padded token prints a WARNING",
        "training.calculate_per_token_loss",
    ),
    no_op(
        "--cross-entropy-loss-fusion",
        _TRAIN,
        f"{MEGATRON_LM}: a fused kernel of the same cross entropy; the loss here is torch's, from fp32 logits",
    ),
    switch(
        "--deterministic-mode",
        _TRAIN,
        f"{MEGATRON_LM}: bit-identical reruns. NCCL_ALGO (Ring) and CUBLAS_WORKSPACE_CONFIG (:4096:8) are set when the "
        "environment lacks them and checked when it has them (a non-deterministic value is a one-line error before "
        "launch), and torch runs deterministic kernels only (an operation without one raises)",
        "training.deterministic_mode",
    ),
    switch(
        "--no-check-for-nan-in-loss-and-grad",
        _TRAIN,
        f"{MEGATRON_LM}: train on when a step's loss or gradient norm is NaN or Inf. Without it the run stops at that "
        "step with one line, before saving (the check is off under fp16 with dynamic loss scaling, as in "
        "Megatron-LM; Megatron-DeepSpeed trains on)",
        "training.check_for_nan_in_loss_and_grad",
        stores=False,
        dest="check_for_nan_in_loss_and_grad",
        default=True,
    ),
    switch(
        "--manual-gc",
        _TRAIN,
        f"{MEGATRON_LM}: Python's automatic garbage collection off while training; gc.collect() every "
        "--manual-gc-interval steps and around evaluations",
        "training.manual_gc",
    ),
    accepted(
        "--manual-gc-interval",
        _TRAIN,
        f"{MEGATRON_LM}: steps between collections with --manual-gc (0: only around evaluations)",
        "training.manual_gc_interval",
        type=int,
    ),
    switch(
        "--no-manual-gc-eval",
        _TRAIN,
        f"{MEGATRON_LM}: no collection around evaluations with --manual-gc",
        "training.manual_gc_eval",
        stores=False,
        dest="manual_gc_eval",
        default=True,
    ),
)

MIXED_PRECISION: tuple[Flag, ...] = (
    no_op(
        "--grad-reduce-in-bf16",
        "mixed precision",
        f"{MEGATRON_LM}: gradients are reduced over data-parallel ranks in bf16; DeepSpeed's bf16 engine already does "
        "(its communication_data_type defaults to the model's dtype), and an fp32 run keeps fp32 gradients as "
        "Megatron-LM does",
    ),
)

TRANSFORMER_ENGINE: tuple[Flag, ...] = (
    refused("--fp8-format", _TE, _FP8, _FP8_FIX, VALUE),
    refused("--fp8-recipe", _TE, _FP8, _FP8_FIX, VALUE),
    refused("--fp8-amax-history-len", _TE, _FP8, _FP8_FIX, VALUE),
    refused("--fp8-amax-compute-algo", _TE, _FP8, _FP8_FIX, VALUE),
    refused("--fp8-param-gather", _TE, _FP8, _FP8_FIX),
    refused("--fp8-margin", _TE, _FP8, _FP8_FIX, VALUE),
    refused("--fp8-interval", _TE, _FP8, _FP8_FIX, VALUE),
    refused("--fp8-e4m3", _TE, _FP8, _FP8_FIX),
    refused("--fp8-hybrid", _TE, _FP8, _FP8_FIX),
    refused("--no-fp8-wgrad", _TE, _FP8, _FP8_FIX),
)

DISTRIBUTED: tuple[Flag, ...] = (
    no_op(
        "--overlap-grad-reduce",
        _DIST,
        f"{MEGATRON_LM}: overlaps the gradient reduction with the backward; DeepSpeed's engine reduces after the "
        "pipeline's backward, the sums are the same",
    ),
    no_op(
        "--overlap-param-gather",
        _DIST,
        f"{MEGATRON_LM}: overlaps the distributed optimizer's parameter all-gather with the forward; ZeRO-1 gathers after "
        "the step, the parameters are the same",
    ),
    no_op(
        "--overlap-param-gather-with-optimizer-step",
        _DIST,
        f"{MEGATRON_LM}: starts the first bucket's parameter all-gather during the optimizer step; the parameters are the same",
    ),
    no_op(
        "--no-align-param-gather",
        _DIST,
        f"{MEGATRON_LM}: each pipeline stage launches its parameter all-gathers on its own; the parameters are the same",
    ),
    no_op(
        "--ddp-average-in-collective",
        _DIST,
        f"{MEGATRON_LM}: averages inside the data-parallel collective instead of scaling before it; the same mean",
    ),
    no_op(
        "--ddp-bucket-size",
        _DIST,
        f"{MEGATRON_LM}: the gradient buckets' size; DeepSpeed's buckets are set in --deepspeed_config "
        "(zero_optimization.reduce_bucket_size); the sums are the same",
        takes=VALUE,
    ),
    no_op(
        "--ddp-num-buckets", _DIST, f"{MEGATRON_LM}: the number of gradient buckets; as --ddp-bucket-size", takes=VALUE
    ),
    no_op(
        "--num-distributed-optimizer-instances",
        _DIST,
        f"{MEGATRON_LM}: replicas of the distributed optimizer's shards (memory against communication); ZeRO-1 shards over "
        "the whole data-parallel group here, the update is the same",
        takes=VALUE,
    ),
    no_op(
        "--use-precision-aware-optimizer",
        _DIST,
        f"{MEGATRON_LM}: Transformer Engine's FusedAdam keeps the fp32 master weights and moments itself; at its default "
        "fp32 dtypes the update is DeepSpeed's Adam's",
    ),
    no_op(
        "--use-tp-pp-dp-mapping",
        _DIST,
        f"{MEGATRON_LM}: orders ranks tensor, pipeline, data instead of tensor, data, pipeline; ranks are DeepSpeed's order "
        "here (tensor innermost, pipeline outermost): which GPUs exchange what changes, not the values",
    ),
    no_op(
        "--cuda-graph-impl",
        _DIST,
        f"{MEGATRON_LM}: CUDA graphs replay the same kernels with less launch overhead; none are captured here",
        takes=VALUE,
    ),
    no_op("--enable-cuda-graph", _DIST, f"{MEGATRON_LM} (deprecated there): as --cuda-graph-impl local"),
    no_op(
        "--tp-comm-overlap",
        _DIST,
        f"{MEGATRON_LM}: overlaps tensor-parallel communication with the matmuls (Transformer Engine userbuffers); the "
        "sums are the same, not overlapped here",
    ),
    no_op(
        "--tp-comm-overlap-cfg",
        _DIST,
        f"{MEGATRON_LM}: the userbuffers configuration of --tp-comm-overlap",
        takes=VALUE,
    ),
    no_op(
        "--no-overlap-p2p-communication",
        _DIST,
        f"{MEGATRON_LM}: blocking pipeline sends and receives under the interleaved schedule; the interleaved engine here "
        "posts its sends (docs/training.md), the values are the same",
    ),
    accepted(
        "--context-parallel-size",
        _DIST,
        f"{MEGATRON_LM}: only 1; more are refused ({_CP})",
        type=int,
        default=1,
    ),
)

GROUPS: tuple[tuple[Flag, ...], ...] = (
    NETWORK,
    megatron_lm_moe.MIXTURE_OF_EXPERTS,
    TRAINING,
    MIXED_PRECISION,
    TRANSFORMER_ENGINE,
    DISTRIBUTED,
    megatron_lm_io.DATA,
    megatron_lm_io.CHECKPOINTING,
    megatron_lm_io.LOGGING,
)
"""Every table of Megatron-LM's flags, here, in `megatron_lm_moe` and in `megatron_lm_io` (what `--data-upstream auto` reads as
Megatron-LM's)."""
