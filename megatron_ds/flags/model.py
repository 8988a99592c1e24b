"""Flags of Megatron's groups "network size", "mixture of experts", "regularization", "initialization".

How Megatron's activation flags select `ModelConfig.activation` is flags -> config, so it lives in
`megatron_ds.flags.to_model_config` (`model_activation`, `ACTIVATION_FLAGS`)."""

from __future__ import annotations

from megatron_ds.config.experts import MLP_TYPES
from megatron_ds.config.optimizer import WD_INCR_STYLES
from megatron_ds.flags.declare import VALUE, Flag, accepted, field_default, no_op, refused, switch
from megatron_ds.model import norms

_NET, _MOE, _REG, _INIT = "network size", "mixture of experts", "regularization", "initialization"

NETWORK: tuple[Flag, ...] = (
    accepted("--num-layers", _NET, "transformer layers", "model.num_layers", type=int, default=None),
    accepted("--hidden-size", _NET, "model width", "model.hidden_size", type=int, default=None),
    accepted(
        "--ffn-hidden-size",
        _NET,
        "MLP inner width; 4 x hidden by default, with --swiglu 2/3 of that rounded down to a multiple of 64 "
        "(Megatron-DeepSpeed's and Megatron-LM's default)",
        "model.ffn_hidden_size",
        type=int,
        default=None,
        derived=True,
    ),
    accepted("--num-attention-heads", _NET, "attention heads", "model.num_attention_heads", type=int, default=None),
    accepted(
        "--num-key-value-heads",
        _NET,
        "grouped-query attention: K/V heads, dividing the attention heads (and divisible by T); equal to "
        "--num-attention-heads is plain multi-head attention",
        "model.num_key_value_heads",
        type=int,
        derived=True,  # also Megatron-LM's --group-query-attention --num-query-groups
    ),
    accepted(
        "--kv-channels",
        _NET,
        "channels of each attention head (QKV: h -> (heads + 2 kv heads) x this; output projection: heads x this -> "
        "h; softmax scale 1/sqrt(this)); hidden / heads by default, which --hidden-size must then divide",
        "model.kv_channels",
        type=int,
    ),
    accepted(
        "--max-position-embeddings",
        _NET,
        "rows of the learned position embedding; --seq-length by default",
        "model.max_position_embeddings",
        type=int,
        default=None,
        derived=True,
    ),
    switch(
        "--use-rotary-position-embeddings",
        _NET,
        "rotary embeddings on q and k",
        "model.use_rotary_position_embeddings",
        derived=True,  # also --position-embedding-type rope
    ),
    accepted(
        "--rotary-percent",
        _NET,
        "the share of each head's channels that rotary embeddings rotate (partial rotary: the first "
        "int(head size x share) channels, the rest pass through, as Megatron); ignored, with a warning, without "
        "rotary embeddings",
        "model.rotary_percent",
        type=float,
    ),
    accepted(
        "--rotary-base",
        _NET,
        "rotary base theta (Megatron-LM's name; Megatron-DeepSpeed's is --rotary-position-embeddings-theta); "
        "ignored, with a warning, without rotary embeddings",
        "model.rotary_base",
        type=float,
        aliases=("--rotary-position-embeddings-theta",),
    ),
    switch(
        "--no-position-embedding",
        _NET,
        "no learned absolute position embedding",
        "model.add_position_embedding",
        stores=False,
        dest="add_position_embedding",
        default=True,
        derived=True,  # rotary embeddings also drop the table
    ),
    accepted(
        "--make-vocab-size-divisible-by",
        _NET,
        "pad the vocabulary to a multiple of this x T",
        "data.make_vocab_size_divisible_by",
        type=int,
    ),
    accepted(
        "--normalization",
        _NET,
        ", ".join(f"`{n.name}` ({n.title})" for n in norms.REGISTRY.values())
        + "; Megatron-LM's spellings "
        + " and ".join(f"`{n}`" for n in dict.fromkeys(m.megatron_lm for m in norms.REGISTRY.values()))
        + " are the same norms",
        "model.normalization",
        choices=norms.FLAG_SPELLINGS,
        default=field_default("model.normalization"),
        derived=True,  # with --apply-layernorm-1p
    ),
    switch(
        "--apply-layernorm-1p",
        _NET,
        "the norm computes with (1 + weight), its weight stored zero-centred and starting at 0 (Megatron's "
        "LayerNorm1P; with Megatron-LM's --normalization RMSNorm, megatron-core's zero-centred RMSNorm). "
        "Megatron-DeepSpeed's --normalization rmsnorm ignores it, and so does it here, with a warning",
        "model.normalization",
        derived=True,
    ),
    accepted(
        "--layernorm-epsilon",
        _NET,
        "epsilon of every norm (Megatron-LM's name: --norm-epsilon; both default to 1e-5)",
        "model.layernorm_epsilon",
        type=float,
        aliases=("--norm-epsilon",),
    ),
    switch(
        "--swiglu",
        _NET,
        "SwiGLU MLP; without --ffn-hidden-size its width is int(8 x hidden / 3 / 64) x 64, as upstream (the "
        "Llama scripts give it)",
        "model.activation",
        derived=True,  # with --openai-gelu and --no-bias-gelu-fusion: model_activation below
    ),
    switch(
        "--openai-gelu",
        _NET,
        "GeLU's tanh approximation (what the default fused bias-GeLU computes), also with --no-bias-gelu-fusion or "
        "--disable-bias-linear; not with --swiglu",
        "model.activation",
        derived=True,
    ),
    switch(
        "--squared-relu",
        _NET,
        "squared ReLU MLP, relu(x)^2; not with --swiglu or --openai-gelu",
        "model.activation",
        derived=True,
    ),
    switch(
        "--untie-embeddings-and-output-weights",
        _NET,
        "the last stage gets its own LM head",
        "model.untie_embeddings_and_output_weights",
    ),
    accepted(
        "--num-experts",
        _NET,
        "experts of each mixture-of-experts layer (every --expert-interval-th layer): one count for all, or one per "
        "such layer; 1, the default, is a dense model. DeepSpeed's MoE layer around copies of the MLP, as "
        "Megatron-DeepSpeed (Megatron-LM's MoE flags: its top-k router, experts drawn apart); at pipeline size 1 on DeepSpeed's plain engine (ZeRO 0-2), at P > 1 on its pipeline "
        "engine (ZeRO 0/1) as its GPTModelPipe; T = 1, any precision (docs/training.md)",
        "model.num_experts",
        type=int,
        nargs="+",
    ),
    refused("--encoder-num-layers", _NET, "encoder-decoder models are not built", "use --num-layers", VALUE),
    refused("--decoder-num-layers", _NET, "encoder-decoder models are not built", "use --num-layers", VALUE),
    refused("--apply-residual-connection-post-layernorm", _NET, "the layer is pre-LN only"),
    refused("--embedding-weights-in-fp32", _NET, "embeddings are kept in the training precision"),
    refused(
        "--onnx-safe",
        _NET,
        "any value switches Megatron-DeepSpeed's MLP to its erf GeLU (x / 1.41421), in place of --swiglu and the fused "
        "tanh GeLU: a workaround for torch's ONNX exporter, not built here",
        "drop it (--no-bias-gelu-fusion gives torch's exact GeLU)",
        VALUE,
    ),
    no_op(
        "--bert-no-binary-head",
        _NET,
        "BERT's sentence-order head (pretrain_bert.py); GPT training never reads it, nor does Megatron-DeepSpeed's "
        "pretrain_gpt.py",
    ),
)

MIXTURE_OF_EXPERTS: tuple[Flag, ...] = (
    accepted(
        "--mlp-type",
        _MOE,
        "`standard`: experts alone; `residual`: PR-MoE, a dense MLP beside the experts mixed by a learned softmax",
        "model.mlp_type",
        choices=MLP_TYPES,
    ),
    accepted(
        "--topk",
        _MOE,
        "experts each token goes to with DeepSpeed's gates: 1 or 2 (default 1)",
        "model.moe_top_k",
        type=int,
        derived=True,
        default=None,
    ),
    accepted(
        "--moe-expert-parallel-size",
        _MOE,
        "ranks that share out each MoE layer's experts (divides the data-parallel size and every expert count); "
        "tokens reach their expert through DeepSpeed's all-to-all",
        "parallel.expert_parallel_size",
        type=int,
    ),
    accepted(
        "--expert-interval",
        _MOE,
        "every this-many-th layer has experts (default 2)",
        "model.expert_interval",
        type=int,
        derived=True,
        default=None,
    ),
    accepted(
        "--moe-train-capacity-factor",
        _MOE,
        "an expert takes at most factor x tokens / experts tokens in training (x 2 for top-2; at least "
        "--moe-min-capacity), the rest are dropped at random",
        "model.moe_train_capacity_factor",
        type=float,
    ),
    accepted(
        "--moe-eval-capacity-factor", _MOE, "the same in evaluation", "model.moe_eval_capacity_factor", type=float
    ),
    accepted("--moe-min-capacity", _MOE, "the least capacity of an expert", "model.moe_min_capacity", type=int),
    accepted(
        "--moe-loss-coeff",
        _MOE,
        "the loss trained is the LM loss + this x the sum of the MoE layers' load-balancing losses (default 0.1)",
        "model.moe_loss_coeff",
        type=float,
        derived=True,
        default=None,
    ),
    switch(
        "--create-moe-param-group",
        _MOE,
        "the experts' parameters in optimizer groups of their own (DeepSpeed's "
        "split_params_into_different_moe_groups_for_optimizer); the update is the same; needed under ZeRO 1/2",
        "optimizer.create_moe_param_group",
    ),
    switch(
        "--disable-moe-token-dropping",
        _MOE,
        "no capacity limit: every expert takes the most tokens any expert got",
        "model.moe_token_dropping",
        stores=False,
    ),
    refused("--use-tutel", _MOE, "Tutel's MoE kernels are not built here"),
    refused(
        "--enable-expert-tensor-parallelism",
        _MOE,
        "mixture-of-experts models train at tensor-parallel size 1 here, without expert tensor parallelism",
    ),
    refused(
        "--num-experts-switch",
        _MOE,
        "Megatron-LM's Switch Transformer MLPs (SwitchMLP) are not built here",
        "use DeepSpeed's MoE layer: --num-experts N",
        takes=VALUE,
    ),
    switch(
        "--disable-moe-top2-2nd-expert-sampling",
        _MOE,
        "top-2's second expert is the argmax of the other experts' logits, not a Gumbel-max sample",
        "model.moe_top2_2nd_expert_sampling",
        stores=False,
    ),
)

REGULARIZATION: tuple[Flag, ...] = (
    accepted(
        "--attention-dropout",
        _REG,
        "dropout on attention probabilities",
        "regularization.attention_dropout",
        type=float,
    ),
    accepted(
        "--hidden-dropout",
        _REG,
        "dropout after the embedding and on residual branches",
        "regularization.hidden_dropout",
        type=float,
    ),
    accepted(
        "--weight-decay",
        _REG,
        "decoupled weight decay, not on biases and norms",
        "optimizer.weight_decay",
        type=float,
    ),
    accepted(
        "--weight-decay-incr-style",
        _REG,
        "`constant` (--weight-decay), or `linear` / `cosine` from --start-weight-decay to --end-weight-decay over "
        "the training samples (Megatron's OptimizerParamScheduler; biases and norms keep 0)",
        fields=("optimizer.weight_decay_incr_style", "optimizer.weight_decay_incr_samples"),
        derived=True,  # the length: --train-samples or --train-iters x --global-batch-size
        choices=WD_INCR_STYLES,
        default="constant",
    ),
    accepted(
        "--start-weight-decay",
        _REG,
        "first weight decay of a linear or cosine --weight-decay-incr-style",
        "optimizer.start_weight_decay",
        type=float,
    ),
    accepted(
        "--end-weight-decay",
        _REG,
        "last weight decay of a linear or cosine --weight-decay-incr-style",
        "optimizer.end_weight_decay",
        type=float,
    ),
    accepted(
        "--clip-grad",
        _REG,
        "global gradient-norm clip (the true norm over all stages); 0 disables. Written into the DeepSpeed JSON; "
        "absent: --deepspeed_config's gradient_clipping, else Megatron's 1.0 (also when the file has none, so "
        "the installed DeepSpeed's default for a missing key never applies)",
        "optimizer.clip_grad",
        type=float,
        default=None,
        derived=True,
    ),
    accepted("--adam-beta1", _REG, "Adam beta1", "optimizer.adam_beta1", type=float),
    accepted("--adam-beta2", _REG, "Adam beta2", "optimizer.adam_beta2", type=float),
    accepted("--adam-eps", _REG, "Adam epsilon", "optimizer.adam_eps", type=float),
    accepted("--sgd-momentum", _REG, "SGD momentum", "optimizer.sgd_momentum", type=float),
)

INITIALIZATION: tuple[Flag, ...] = (
    accepted(
        "--seed",
        _INIT,
        "seed of weights (per layer spec, layout-independent), data order and dropout",
        "training.seed",
        type=int,
    ),
    accepted(
        "--init-method-std",
        _INIT,
        "std of the normal init; output projections std / sqrt(2 L)",
        "regularization.init_method_std",
        type=float,
    ),
    refused("--data-parallel-random-init", _INIT, "replicas always start from the same weights"),
    refused("--init-method-xavier-uniform", _INIT, "only the normal init is implemented", "use --init-method-std"),
)
