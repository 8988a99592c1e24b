"""Megatron-LM's mixture-of-experts flags, declared (the table `MIXTURE_OF_EXPERTS`): what each means here, or why it
changes nothing, or why it is refused. `megatron_lm_moe` maps them onto the model's routing fields and refuses them beside
DeepSpeed's gate flags.
"""

from __future__ import annotations

from megatron_ds.flags.declare import (
    MEGATRON_LM,
    NO_OP,
    SWITCH,
    VALUE,
    Flag,
    Refusal,
    accepted,
    no_op,
    refused,
    switch,
)

_MOE = "mixture of experts"
_SAME = "the experts compute the same outputs"
_GATE = "DeepSpeed's gates (--topk)"


def _refused(name: str, reason: str, fix: str = "drop it", takes: int | str = SWITCH) -> Flag:
    return refused(name, _MOE, f"{MEGATRON_LM}: {reason}", fix, takes)


def _value_no_op(name: str, reason: str, choices: tuple[str, ...] | None = None) -> Flag:
    """A flag taking one value that changes nothing here (its choices still checked)."""
    return Flag(name, _MOE, NO_OP, f"{MEGATRON_LM}: {reason}", nargs=None, choices=choices)


MIXTURE_OF_EXPERTS: tuple[Flag, ...] = (
    accepted(
        "--moe-router-topk",
        _MOE,
        f"{MEGATRON_LM}: experts each token goes to with Megatron-LM's top-k router (softmax over the k largest "
        "logits, every token routed; default 2); any of its flags chooses that router",
        fields=("model.moe_top_k", "model.moe_router"),
        type=int,
        derived=True,
        default=None,
    ),
    accepted(
        "--moe-aux-loss-coeff",
        _MOE,
        f"{MEGATRON_LM}: the loss trained is the LM loss + this x the sum of the MoE layers' load-balancing losses "
        "(E / k x sum over experts of mean probability x routed share; default 0); one value (Megatron-LM takes one "
        "per --moe-router-load-balancing-type)",
        fields=("model.moe_loss_coeff",),
        type=float,
        nargs="+",
        derived=True,
        default=None,
    ),
    accepted(
        "--moe-router-load-balancing-type",
        _MOE,
        f"{MEGATRON_LM}: `aux_loss` (the loss --moe-aux-loss-coeff weighs) or `none` (no load-balancing loss); one "
        "type (Megatron-LM's list of several is not built)",
        fields=("model.moe_loss_coeff",),
        nargs="+",
        derived=True,
        default=None,
        choices=("aux_loss", "none"),
        refused_values=tuple(
            Refusal(v, "only the GShard/Switch aux_loss is built", "use aux_loss")
            for v in ("seq_aux_loss", "global_aux_loss", "sinkhorn")
        ),
    ),
    accepted(
        "--moe-layer-freq",
        _MOE,
        f"{MEGATRON_LM}: which layers have experts: 1 (every layer, the default) or a list pattern of 0s and 1s "
        "such as ([0]+[1])*16, as Megatron-DeepSpeed's --expert-interval N places them (layers N, 2N, ... from 1)",
        fields=("model.expert_interval",),
        derived=True,
        default=None,
    ),
    accepted(
        "--moe-ffn-hidden-size",
        _MOE,
        f"{MEGATRON_LM}: each expert's FFN size (default --ffn-hidden-size); with experts on every layer it is the "
        "model's FFN size (--ffn-hidden-size then shapes no tensor); with dense layers too it must equal --ffn-hidden-size",
        type=int,
        derived=True,
        default=None,
    ),
    accepted(
        "--moe-router-score-function",
        _MOE,
        f"{MEGATRON_LM}: `softmax` (the default)",
        derived=True,
        default=None,
        choices=("softmax",),
        refused_values=(Refusal("sigmoid", "the router's scores are a softmax here", "use softmax"),),
    ),
    switch(
        "--moe-router-pre-softmax",
        _MOE,
        f"{MEGATRON_LM}: the softmax over all experts first, each token's k largest probabilities its weights, not "
        "renormalized (Qwen2-MoE's norm_topk_prob false; without it the softmax is over the k largest logits); the "
        "same load-balancing loss",
        "model.moe_router_pre_softmax",
        derived=True,
        default=None,
    ),
    accepted(
        "--moe-router-dtype",
        _MOE,
        f"{MEGATRON_LM}: `fp32`: the router's logits in fp32, as DeepSpeed's gate always computes them (without it "
        "Megatron-LM computes them in the training precision; a notice says so under --bf16)",
        derived=True,
        default=None,
        choices=("fp32",),
        refused_values=(Refusal("fp64", "the router computes in fp32 here", "use fp32"),),
    ),
    accepted(
        "--expert-model-parallel-size",
        _MOE,
        f"{MEGATRON_LM}: the same as --moe-expert-parallel-size (ranks that share out each MoE layer's experts)",
        fields=("parallel.expert_parallel_size",),
        type=int,
        derived=True,
        default=None,
    ),
    accepted(
        "--expert-tensor-parallel-size",
        _MOE,
        f"{MEGATRON_LM}: only 1 (experts are not split over tensor ranks here; MoE models train at T = 1)",
        type=int,
        derived=True,
        default=None,
    ),
    accepted(
        "--moe-shared-expert-intermediate-size",
        _MOE,
        f"{MEGATRON_LM}: a shared expert beside the routed ones on every MoE layer (megatron-core's SharedExpertMLP: "
        "a dense MLP of this FFN width, the experts' activation, no biases), its output added to theirs for every "
        "token (Qwen2-MoE's, DeepSeek's); > 0",
        fields=("model.moe_shared_expert_size",),
        type=int,
        derived=True,
        default=None,
    ),
    switch(
        "--moe-shared-expert-gate",
        _MOE,
        f"{MEGATRON_LM}: the shared expert's output times sigmoid(a bias-free linear hidden -> 1 of the layer's input) "
        "(Qwen2-MoE's shared_expert_gate); needs --moe-shared-expert-intermediate-size",
        "model.moe_shared_expert_gate",
        derived=True,
        default=None,
    ),
    no_op(
        "--moe-shared-expert-overlap",
        _MOE,
        f"{MEGATRON_LM}: runs the shared expert on a side CUDA stream, overlapped with the token dispatcher; the same "
        "outputs",
    ),
    no_op("--moe-grouped-gemm", _MOE, f"{MEGATRON_LM}: one grouped GEMM for the local experts; {_SAME}"),
    no_op("--moe-use-legacy-grouped-gemm", _MOE, f"{MEGATRON_LM}: the older grouped GEMM; {_SAME}"),
    _value_no_op(
        "--moe-token-dispatcher-type",
        "every dispatcher delivers the same tokens; DeepSpeed's all-to-all runs here",
        ("allgather", "alltoall", "flex"),
    ),
    no_op("--moe-permute-fusion", _MOE, f"{MEGATRON_LM}: a fused token permutation kernel; {_SAME}"),
    no_op("--moe-router-fusion", _MOE, f"{MEGATRON_LM}: fused router kernels; the same routing"),
    no_op("--moe-enable-deepep", _MOE, f"{MEGATRON_LM}: DeepEP's dispatch kernels; {_SAME}"),
    _value_no_op("--moe-flex-dispatcher-backend", "the flex dispatcher's kernels; the same tokens delivered"),
    _value_no_op("--moe-deepep-num-sms", "SMs for DeepEP's kernels (a GPU setting)"),
    _value_no_op("--moe-hybridep-num-sms", "SMs for HybridEP's kernels (a GPU setting)"),
    no_op("--overlap-moe-expert-parallel-comm", _MOE, f"{MEGATRON_LM}: overlaps the all-to-alls; {_SAME}"),
    no_op("--moe-per-layer-logging", _MOE, f"{MEGATRON_LM}: each layer's load-balancing loss in its logs"),
    _value_no_op(
        "--moe-token-drop-policy",
        "which tokens an over-capacity expert drops; without --moe-expert-capacity-factor none is",
        ("probs", "position"),
    ),
    _value_no_op("--moe-router-bias-update-rate", "the expert bias's update rate; without the bias it does nothing"),
    no_op("--moe-pad-experts-for-cuda-graph-inference", _MOE, f"{MEGATRON_LM}: CUDA-graph inference only"),
    no_op("--moe-router-padding-for-fp8", _MOE, f"{MEGATRON_LM}: FP8 padding (FP8 is refused)"),
    no_op("--moe-router-padding-for-quantization", _MOE, f"{MEGATRON_LM}: quantization padding (FP8 is refused)"),
    _refused(
        "--moe-expert-capacity-factor",
        "token dropping by Megatron-LM's rule (the tokens of highest renormalized probability kept) is not built",
        f"drop it (every token routed), or train with {_GATE} and --moe-train-capacity-factor",
        takes=VALUE,
    ),
    _refused("--moe-pad-expert-input-to-capacity", "padding to a capacity: the capacity factor is not built"),
    _refused("--moe-router-topk-scaling-factor", "scaled routing weights are not built", takes=VALUE),
    _refused("--moe-z-loss-coeff", "the router's z-loss is not built", takes=VALUE),
    _refused("--moe-input-jitter-eps", "the router's input jitter is not built", takes=VALUE),
    _refused("--moe-router-enable-expert-bias", "the auxiliary-loss-free expert bias (DeepSeek-V3's) is not built"),
    _refused("--moe-router-num-groups", "group-limited routing is not built", takes=VALUE),
    _refused("--moe-router-group-topk", "group-limited routing is not built", takes=VALUE),
    _refused("--moe-router-force-load-balancing", "random routing for benchmarks is not built"),
    _refused("--moe-apply-probs-on-input", "weighting an expert's input rather than its output is not built"),
    _refused("--moe-latent-size", "a latent projection of the experts' input is not built", takes=VALUE),
    _refused(
        "--moe-layer-recompute",
        "recomputing the MoE layer alone is not built",
        "drop it (--recompute-granularity full recomputes whole layers at pipeline size 1)",
    ),
    _refused("--moe-extended-tp", "experts are not split over tensor ranks here"),
    _refused("--moe-use-upcycling", "upcycling a dense checkpoint into experts is not built"),
    _refused("--moe-upcycling-granularity", "upcycling is not built", takes=VALUE),
    _refused("--moe-enable-routing-replay", "replaying recorded routes is not built"),
)
"""Megatron-LM's mixture-of-experts flags (core_v0.16.1's `_add_moe_args` and the TransformerConfig fields its
argument factory adds)."""
