"""A Megatron-LM run's saved `args` as our flags, and its counters as ours.

`config_from_args` renders the saved values that shape the model or its training as Megatron-LM
command-line flags (its own spellings: `--norm-epsilon`, `--group-query-attention`,
`--position-embedding-type`...) and parses them with our parser, so each means here what it meant
upstream and one we do not build (shared experts, multi-latent attention, weight decay on the QK layer norms,
multi-token prediction, the WSD schedule...) is refused in one line naming the flag.
Values at Megatron-LM's defaults are not rendered. The run's tensor-parallel size is kept (it pads
the vocabulary); its pipeline split is not (our weight files load at any layout).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from megatron_ds.config import Config
from megatron_ds.errors import UserError
from megatron_ds.interop import saved_flags
from megatron_ds.interop.megatron_lm_files import TORCH_DIST, MegatronLMCheckpoint
from megatron_ds.interop.saved_flags import Arg, off, on, render
from megatron_ds.training.checkpoint.directory import CheckpointError
from megatron_ds.training.state import TrainState


def _qkv_bias_alone(a: dict[str, Any]) -> Any:
    """--add-qkv-bias is implied by the linear biases (validate_args sets it): rendered only without them."""
    return a.get("add_qkv_bias") if a.get("add_bias_linear") else False


def _groups_unused(a: dict[str, Any]) -> Any:
    """--num-query-groups means something only with --group-query-attention."""
    return None if a.get("group_query_attention") else a.get("num_query_groups")


MODEL_ARGS = (
    Arg("--num-layers"),
    Arg("--hidden-size"),
    Arg("--num-attention-heads"),
    Arg("--ffn-hidden-size"),
    on("--group-query-attention"),
    Arg("--num-query-groups", _groups_unused),
    Arg("--kv-channels", lambda a: a["hidden_size"] // a["num_attention_heads"]),
    Arg("--seq-length"),
    Arg("--max-position-embeddings"),
    Arg("--make-vocab-size-divisible-by"),
    Arg("--normalization"),
    Arg("--norm-epsilon", 1e-5, saved_as="layernorm_epsilon"),
    on("--apply-layernorm-1p", saved_as="layernorm_zero_centered_gamma"),
    on("--apply-residual-connection-post-layernorm"),
    on("--fp32-residual-connection"),
    on("--openai-gelu"),
    on("--squared-relu"),
    on("--swiglu"),
    off("--disable-bias-linear", "add_bias_linear"),
    Arg("--add-qkv-bias", _qkv_bias_alone, switch=True),
    Arg("--position-embedding-type", "learned_absolute"),
    Arg("--rotary-percent", 1.0),
    Arg("--rotary-base", 10000),
    on("--rotary-interleaved"),
    Arg("--rotary-seq-len-interpolation-factor"),
    on("--use-rope-scaling"),
    Arg("--rope-scaling-factor", lambda a: a["rope_scaling_factor"] if not a.get("use_rope_scaling") else 8.0),
    on("--untie-embeddings-and-output-weights"),
    Arg("--num-experts", (None, 0)),  # 0: what Megatron-LM's own checkpoint converter saves for a dense model
    on("--qk-layernorm"),
    on("--qk-l2-norm"),
    on("--multi-latent-attention"),
    Arg("--mtp-num-layers"),
    Arg("--window-size", spelled=lambda w: ",".join(map(str, w))),  # its tuple_type reads "LEFT,RIGHT"
    Arg("--window-attn-skip-freq", spelled=str),  # its moe_freq_type: N, or a list as "[1, 1, 0]"
    Arg("--heterogeneous-layers-config-path"),
    *saved_flags.INIT_AND_DROPOUT_ARGS,
)
"""What shapes the model (and its dropout and init), in Megatron-LM's spelling."""
MOE_ARGS = (
    Arg("--moe-router-topk"),  # always rendered: a flag of Megatron-LM's chooses its router here
    Arg("--moe-aux-loss-coeff", (0.0, [0.0])),
    Arg("--moe-router-load-balancing-type", ("aux_loss", ["aux_loss"])),
    Arg("--moe-layer-freq", 1, spelled=str),  # its moe_freq_type: N, or a list as "[0, 1, 0, 1]"
    Arg("--moe-ffn-hidden-size", lambda a: a["ffn_hidden_size"]),
    Arg("--moe-router-score-function", "softmax"),
    Arg("--moe-router-dtype"),
    Arg("--moe-expert-capacity-factor"),
    on("--moe-pad-expert-input-to-capacity"),
    on("--moe-router-pre-softmax"),
    Arg("--moe-router-topk-scaling-factor"),
    Arg("--moe-z-loss-coeff"),
    Arg("--moe-input-jitter-eps"),
    Arg("--moe-shared-expert-intermediate-size"),
    on("--moe-shared-expert-gate"),
    on("--moe-router-enable-expert-bias"),
    Arg("--moe-router-num-groups"),
    Arg("--moe-router-group-topk"),
    on("--moe-router-force-load-balancing"),
    on("--moe-apply-probs-on-input"),
    Arg("--moe-latent-size"),
)
"""A mixture-of-experts run's routing and experts (rendered only when it has experts). Not rendered: its
expert-parallel and expert-tensor-parallel sizes (free on resume, as the pipeline split), kernels and dispatchers (the same model), and what
only shaped its training (upcycling from a dense checkpoint, recomputation, routing replay)."""
TRAINING_ARGS = (
    *saved_flags.SCHEDULE_ARGS,
    Arg("--lr-warmup-iters", 0),
    Arg("--lr-warmup-samples", 0),
    Arg("--lr-warmup-fraction"),
    Arg("--lr-warmup-init", 0.0),
    Arg("--weight-decay", 0.01),
    Arg("--start-weight-decay", lambda a: a["weight_decay"]),
    Arg("--end-weight-decay", lambda a: a["weight_decay"]),
    Arg("--weight-decay-incr-style", "constant"),
    on("--apply-wd-to-qk-layernorm"),
    *saved_flags.ADAM_AND_PRECISION_ARGS,
)
"""What a resume compares (batch sizes, optimizer, schedule) and records."""
TOKENIZER_FILES = {**saved_flags.TOKENIZER_FILES, "HuggingFaceTokenizer": ("tokenizer_model",)}
"""Megatron-LM's tokenizers we build, and the files each needs (recorded only if they still exist)."""
NULL_TOKENIZER = "NullTokenizer"


def padded_vocab_size(ckpt: MegatronLMCheckpoint) -> int:
    padded = ckpt.args.get("padded_vocab_size")
    if not isinstance(padded, int) or padded <= 0:
        raise CheckpointError(f"{ckpt.directory}: its saved args have no padded_vocab_size; the checkpoint is damaged")
    return padded


def tokenizer_vocab_size(ckpt: MegatronLMCheckpoint) -> int | None:
    """The tokenizer's own vocabulary when the args say it (a NullTokenizer's ids, `null_tokenizer_flags`)."""
    a = ckpt.args
    if a.get("tokenizer_type") != NULL_TOKENIZER or not a.get("vocab_size"):
        return None
    return int(null_tokenizer_flags(a)[3])


def null_tokenizer_flags(args: dict[str, Any]) -> list[str]:
    """Our flags for the run's NullTokenizer. Megatron-LM's since April 2026 (commit c9dfe34798, which added
    --null-tokenizer-eod-id and --null-tokenizer-pad-id, so its args hold them) has --vocab-size ids, as ours; the
    one before it had --vocab-size + 1, the last its end-of-document, which ours is given --vocab-size + 1."""
    vocab = int(args["vocab_size"])
    if "null_tokenizer_pad_id" not in args:
        return ["--tokenizer-type", NULL_TOKENIZER, "--vocab-size", str(vocab + 1)]
    flags = ["--tokenizer-type", NULL_TOKENIZER, "--vocab-size", str(vocab)]
    if args.get("null_tokenizer_eod_id") is not None:
        flags += ["--null-tokenizer-eod-id", str(args["null_tokenizer_eod_id"])]
    if args.get("null_tokenizer_pad_id", -1) != -1:
        flags += ["--null-tokenizer-pad-id", str(args["null_tokenizer_pad_id"])]
    return flags


def tokenizer_flags(ckpt: MegatronLMCheckpoint, overrides: dict[str, str | None]) -> tuple[list[str], str | None]:
    """Our flags for the run's tokenizer and vocabulary, and a note when the tokenizer is not recorded.
    A NullTokenizer is its ids (`null_tokenizer_flags`); otherwise the padded size stands for the vocabulary
    (Megatron-LM does not save the tokenizer's own size), which pads to itself."""
    a = ckpt.args
    if a.get("tokenizer_type") == NULL_TOKENIZER and not any(overrides.values()):
        return null_tokenizer_flags(a), None
    flags, note = saved_flags.tokenizer_flags(a, overrides, TOKENIZER_FILES)
    return ["--vocab-size", str(padded_vocab_size(ckpt)), *flags], note


def placeholders(ckpt: MegatronLMCheckpoint) -> list[str]:
    """Flags our config requires that the args lack (Megatron-LM's checkpoint converter, tools/checkpoint,
    saves no training length or learning rate): --train-iters at the iteration, --lr 1e-4, as a
    weights-only Hugging Face import records them; the training run's own flags apply."""
    a, flags = ckpt.args, []
    if not any(a.get(k) for k in ("train_iters", "train_samples")):
        flags.append(f"--train-iters={max(ckpt.iteration, 1)}")
    if not a.get("lr"):
        flags.append("--lr=1e-4")
    return flags


def config_from_args(ckpt: MegatronLMCheckpoint, tokenizer: list[str]) -> Config:
    """Our Config of the run (T as saved, one pipeline stage and data-parallel rank: both are free on resume).
    Args without a training length or learning rate (a converted model) get `placeholders`."""
    from megatron_ds.flags.parser import parse_config

    experts = bool(ckpt.args.get("num_experts"))
    if experts and ckpt.tensor_parallel > 1 and ckpt.format != TORCH_DIST:
        raise CheckpointError(
            f"{ckpt.directory}: a mixture-of-experts run at --tensor-model-parallel-size {ckpt.tensor_parallel} in "
            f"--ckpt-format {ckpt.format}: its experts' tensor-parallel shards are read here only from torch_dist; load "
            f"it in Megatron-LM and save it with --ckpt-format torch_dist"
        )
    # a mixture of experts is written in universal form alone (T-free; its experts train at T = 1 here): converted at
    # T = 1 with the vocabulary padded as the run's T padded it
    t = 1 if experts else ckpt.tensor_parallel
    flags = [
        *render(model_args(ckpt.args) if t == ckpt.tensor_parallel else padded_at_t1(ckpt), MODEL_ARGS),
        *moe_flags(ckpt.args),
        *render(ckpt.args, TRAINING_ARGS),
        f"--tensor-model-parallel-size={t}",
        "--data-upstream=megatron-lm",  # its data files split and blended as Megatron-LM does
        *tokenizer,
        *placeholders(ckpt),
    ]
    try:
        config, _ = parse_config(flags, world_size=t)
    except UserError as err:
        raise CheckpointError(f"{ckpt.directory}: its saved args, as flags, are refused here: {err}") from None
    padded = padded_vocab_size(ckpt)
    if config.model.vocab_size != padded:
        raise CheckpointError(
            f"{ckpt.directory}: its padded vocabulary has {padded} rows, our padding of the same tokenizer gives "
            f"{config.model.vocab_size}; the checkpoint's args are inconsistent"
        )
    return config


def padded_at_t1(ckpt: MegatronLMCheckpoint) -> dict[str, Any]:
    """The run's args (`model_args`) with --make-vocab-size-divisible-by times its T: Megatron pads the vocabulary to a
    multiple of that x T, so at T = 1 these flags pad it to the same rows."""
    args = model_args(ckpt.args)
    divisible = args.get("make_vocab_size_divisible_by")
    return {**args, "make_vocab_size_divisible_by": divisible * ckpt.tensor_parallel} if divisible else args


def model_args(args: dict[str, Any]) -> dict[str, Any]:
    """The run's args as our flags take them: with experts on every layer the dense FFN size shapes no tensor, so the
    experts' (--moe-ffn-hidden-size, which Qwen- and DeepSeek-style lines set apart from --ffn-hidden-size) is the FFN
    size (our experts are the MLP's width)."""
    freq = args.get("moe_layer_freq", 1)
    every_layer = freq == 1 or (isinstance(freq, list) and set(freq) == {1})
    moe_size = args.get("moe_ffn_hidden_size")
    if args.get("num_experts") and every_layer and moe_size:
        return {**args, "ffn_hidden_size": moe_size}
    return args


def moe_flags(args: dict[str, Any]) -> list[str]:
    """The run's `MOE_ARGS` as flags ([] for a dense run, which saves them at Megatron-LM's defaults)."""
    return render(model_args(args), MOE_ARGS) if args.get("num_experts") else []


def train_state(ckpt: MegatronLMCheckpoint, config: Config) -> dict[str, Any]:
    """Our TrainState of the run: Megatron-LM saves the samples consumed in its args and the model
    FLOPs so far beside them; tokens are the samples' (Megatron-LM does not count them)."""
    a, s = ckpt.args, ckpt.states
    samples = int(a.get("consumed_train_samples") or 0)
    state = TrainState(
        iteration=int(s.get("iteration") or ckpt.iteration),
        consumed_train_samples=samples,
        consumed_valid_samples=int(a.get("consumed_valid_samples") or 0),
        consumed_train_tokens=samples * config.model.seq_length,
        floating_point_operations_so_far=float(s.get("num_floating_point_operations_so_far") or 0.0),
    )
    return asdict(state)
