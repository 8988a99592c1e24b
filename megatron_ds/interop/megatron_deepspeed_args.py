"""A Megatron-DeepSpeed run's saved `args` as our flags, and its schedule and counters as ours.

`config_from_args` renders the saved values that shape the model or its training as
Megatron-DeepSpeed command-line flags and parses them with our own parser, so each one means
here what it meant upstream, and one we do not build (post-LN residuals,
fp32 residuals...) is refused in one line naming the flag. Values at upstream's neutral
setting are not rendered. The padded vocabulary comes out as upstream padded it: the tokenizer's
size (`universal_checkpoint_info`'s `original_vocab_size`) with the same divisor and T.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from megatron_ds.config import Config
from megatron_ds.errors import UserError
from megatron_ds.interop import megatron_scheduler, saved_flags
from megatron_ds.interop.megatron_deepspeed_files import MegatronDeepSpeedCheckpoint
from megatron_ds.interop.saved_flags import Arg, off, on, render
from megatron_ds.training.checkpoint.directory import CheckpointError
from megatron_ds.training.state import TrainState

MODEL_ARGS = (
    Arg("--num-layers"),
    Arg("--hidden-size"),
    Arg("--num-attention-heads"),
    Arg("--ffn-hidden-size"),
    Arg("--num-key-value-heads", lambda a: a["num_attention_heads"]),
    Arg("--kv-channels", lambda a: a["hidden_size"] // a["num_attention_heads"]),
    Arg("--seq-length"),
    Arg("--max-position-embeddings"),
    Arg("--make-vocab-size-divisible-by"),
    Arg("--normalization"),
    Arg("--layernorm-epsilon", 1e-5),
    on("--apply-layernorm-1p"),
    on("--apply-residual-connection-post-layernorm"),
    on("--fp32-residual-connection"),
    on("--embedding-weights-in-fp32"),
    on("--openai-gelu"),
    Arg("--onnx-safe", (None, False)),
    on("--squared-relu"),
    on("--swiglu"),
    off("--no-bias-gelu-fusion", "bias_gelu_fusion"),
    off("--disable-bias-linear", "add_bias_linear"),
    off("--no-position-embedding", "add_position_embedding"),
    on("--use-rotary-position-embeddings"),
    Arg("--rotary-percent", 1.0),
    Arg(
        "--rotary-position-embeddings-theta", lambda a: 10000 if _rotary(a) else a["rope_theta"], saved_as="rope_theta"
    ),
    on("--untie-embeddings-and-output-weights"),
    Arg("--num-experts", ([1],)),
    Arg("--num-layers-per-virtual-pipeline-stage"),
    *saved_flags.INIT_AND_DROPOUT_ARGS,
)
"""What shapes the model (and its dropout and init), in Megatron-DeepSpeed's spelling."""
MOE_ARGS = (
    Arg("--expert-interval", 2),
    Arg("--mlp-type", "standard"),
    Arg("--topk", 1),
    Arg("--moe-train-capacity-factor", 1.0),
    Arg("--moe-eval-capacity-factor", 1.0),
    Arg("--moe-min-capacity", 4),
    Arg("--moe-loss-coeff", 0.1),
    off("--disable-moe-token-dropping", "moe_token_dropping"),
    off("--disable-moe-top2-2nd-expert-sampling", "moe_top2_2nd_expert_sampling"),
    on("--create-moe-param-group"),
    Arg("--moe-expert-parallel-size", 1),
    on("--enable-expert-tensor-parallelism"),
    on("--use-tutel"),
    Arg("--num-experts-switch"),
)
"""A mixture-of-experts run's routing, experts and their parallelism (rendered only when it has experts: a dense run
saves them at upstream's defaults, which mean nothing there)."""
TRAINING_ARGS = (
    *saved_flags.SCHEDULE_ARGS,
    Arg("--lr-decay-tokens"),
    Arg("--lr-warmup-iters", 0),
    Arg("--lr-warmup-samples", 0),
    Arg("--lr-warmup-fraction"),
    Arg("--lr-warmup-tokens"),
    Arg("--weight-decay", 0.01),
    Arg("--start-weight-decay", lambda a: _constant_wd(a, "start_weight_decay")),
    Arg("--end-weight-decay", lambda a: _constant_wd(a, "end_weight_decay")),
    *saved_flags.ADAM_AND_PRECISION_ARGS,
)
"""What a resume compares (batch sizes, optimizer, schedule) and records."""
TOKENIZER_FILES = {**saved_flags.TOKENIZER_FILES, "HFTokenizer": ("tokenizer_model",)}
"""Tokenizers of upstream's we build, and the files each needs (recorded only if they still exist; HFTokenizer's
`--tokenizer-model` is a Hugging Face directory)."""


def _rotary(a: dict[str, Any]) -> bool:
    return bool(a.get("use_rotary_position_embeddings"))


NULL_TOKENIZER = "NullTokenizer"


def _constant_wd(a: dict[str, Any], dest: str) -> Any:
    """Megatron sets start and end weight decay to --weight-decay when no schedule was asked for."""
    same = a.get("start_weight_decay") == a.get("end_weight_decay") == a.get("weight_decay")
    return a.get(dest) if same or a.get("start_weight_decay") is None else None


def tokenizer_flags(
    ckpt: MegatronDeepSpeedCheckpoint, overrides: dict[str, str | None]
) -> tuple[list[str], str | None]:
    """Our tokenizer flags for the run's tokenizer, and a note when it cannot be recorded. A NullTokenizer needs no
    files: ours with `vocab_size`'s ids is upstream's."""
    if _null_tokenizer_ids(ckpt.args) and not any(overrides.values()):
        return ["--tokenizer-type", NULL_TOKENIZER], None
    flags, note = saved_flags.tokenizer_flags(ckpt.args, overrides, TOKENIZER_FILES)
    return flags, note or _sentencepiece_note(flags)


def _sentencepiece_note(flags: list[str]) -> str | None:
    """A note when the recorded tokenizer is `SentencePieceTokenizer`: ours is Megatron-DeepSpeed's
    GPTSentencePieceTokenizer, and the run's own had special pieces more (`megatron_deepspeed_sentencepiece`)."""
    if "--tokenizer-type" not in flags or "--tokenizer-model" not in flags:  # overrides may give files alone
        return None
    if flags[flags.index("--tokenizer-type") + 1] != "SentencePieceTokenizer":
        return None
    from megatron_ds.data.tokenizer import build_tokenizer, megatron_deepspeed_sentencepiece

    model = flags[flags.index("--tokenizer-model") + 1]
    here = build_tokenizer("SentencePieceTokenizer", model)
    ids, eod, added = megatron_deepspeed_sentencepiece(model)
    more = f"{', '.join(added)} added, " if added else ""
    unused = f"the embedding keeps every row, but ids from {here.vocab_size} are never produced here; " if added else ""
    return (
        f"tokenizer SentencePieceTokenizer recorded as ours, Megatron-DeepSpeed's GPTSentencePieceTokenizer: "
        f"{here.vocab_size} ids, end-of-document {here.eod}; the run's had {ids} ({more}end-of-document <EOD> {eod}): "
        f"{unused}data Megatron-DeepSpeed preprocessed ends documents with {eod}, so preprocess it again with "
        f"tools/preprocess_data.py"
    )


def vocab_size(ckpt: MegatronDeepSpeedCheckpoint) -> int:
    """The tokenizer's vocabulary (unpadded): a NullTokenizer's ids; else upstream records it since universal
    checkpoints exist; older checkpoints: the padded size itself (padding then counts as vocabulary)."""
    info = ckpt.checkpoint_info
    return int(_null_tokenizer_ids(ckpt.args) or info.get("original_vocab_size") or ckpt.args["padded_vocab_size"])


def _null_tokenizer_ids(args: dict[str, Any]) -> int | None:
    """Megatron-DeepSpeed's NullTokenizer has --vocab-size + 1 ids, the last its end-of-document."""
    if args.get("tokenizer_type") != NULL_TOKENIZER or not args.get("vocab_size"):
        return None
    return int(args["vocab_size"]) + 1


def config_from_args(ckpt: MegatronDeepSpeedCheckpoint, tokenizer: list[str]) -> Config:
    """Our Config of the run (T and P as saved; one data-parallel rank: DP is free on resume)."""
    from megatron_ds.flags.parser import parse_config

    a = ckpt.args
    if ckpt.zero_stage >= 3:
        raise CheckpointError(
            f"{ckpt.directory}: a ZeRO-3 checkpoint (parameters partitioned over data-parallel ranks) cannot be "
            f"converted; convert it to full weights upstream first (DeepSpeed's zero_to_fp32.py) or save it with ZeRO 0-2"
        )
    moe = is_moe(ckpt)
    if moe:
        check_moe(ckpt)
    flags = [
        *render(a, MODEL_ARGS),
        *(render(a, MOE_ARGS) if moe else []),
        *render(a, TRAINING_ARGS),
        f"--vocab-size={vocab_size(ckpt)}",
        f"--tensor-model-parallel-size={ckpt.tensor_parallel}",
        f"--pipeline-model-parallel-size={ckpt.pipeline_parallel}",
        f"--zero-stage={min(ckpt.zero_stage, 1)}",  # ZeRO-2 keeps ZeRO-1's files: the state converts the same
        *tokenizer,
    ]
    try:
        # one data-parallel rank per expert-parallel one: the fewest ranks the experts' split allows (DP is free)
        world_size = ckpt.tensor_parallel * ckpt.pipeline_parallel * (expert_parallel_size(ckpt) if moe else 1)
        config, _ = parse_config(flags, world_size=world_size)
    except UserError as err:
        raise CheckpointError(f"{ckpt.directory}: its saved args, as flags, are refused here: {err}") from None
    padded = int(a.get("padded_vocab_size") or 0)
    if padded and config.model.vocab_size != padded:
        raise CheckpointError(
            f"{ckpt.directory}: its padded vocabulary has {padded} rows, our padding of {vocab_size(ckpt)} gives "
            f"{config.model.vocab_size}; the checkpoint's args are inconsistent"
        )
    return config


def is_moe(ckpt: MegatronDeepSpeedCheckpoint) -> bool:
    """The run had a mixture-of-experts layer (upstream's `is_moe_model`: some --num-experts count above 1)."""
    return any(int(n) > 1 for n in ckpt.args.get("num_experts") or [1])


def expert_parallel_size(ckpt: MegatronDeepSpeedCheckpoint) -> int:
    return int(ckpt.args.get("moe_expert_parallel_size") or 1)


def check_moe(ckpt: MegatronDeepSpeedCheckpoint) -> None:
    """A mixture-of-experts checkpoint converts when it is what upstream's MoE examples save: GPTModel
    (`--no-pipeline-parallel`) on DeepSpeed's plain engine at T = 1, in fp32, ZeRO 0-2; else one line saying so."""
    experts = " ".join(map(str, ckpt.args.get("num_experts") or []))
    why = None
    if not ckpt.no_pipeline:
        why = "saved by GPTModelPipe (without --no-pipeline-parallel), whose MoE files are not read here"
    elif ckpt.tensor_parallel > 1:
        why = f"saved at --tensor-model-parallel-size {ckpt.tensor_parallel}; MoE models are built at T = 1 here"
    elif ckpt.precision != "fp32":
        why = f"saved in {ckpt.precision}, whose MoE optimizer files are not read here"
    if why:
        raise CheckpointError(
            f"{ckpt.directory}: a mixture-of-experts checkpoint (--num-experts {experts}) {why}; only --no-pipeline-parallel "
            f"MoE checkpoints at T = 1 in fp32 (ZeRO 0-2) convert"
        )


def train_state(ckpt: MegatronDeepSpeedCheckpoint) -> dict[str, Any]:
    a = ckpt.args
    state = TrainState(
        iteration=int(ckpt.states.get("iteration") or a.get("iteration") or 0),
        consumed_train_samples=int(a.get("consumed_train_samples") or 0),
        consumed_valid_samples=int(a.get("consumed_valid_samples") or 0),
        # upstream saves args.consumed_train_tokens as the checkpoint's `tokens` (megatron/checkpointing.py)
        consumed_train_tokens=int(ckpt.states.get("tokens") or a.get("consumed_train_tokens") or 0),
    )
    saved = asdict(state)
    del saved["floating_point_operations_so_far"]  # not saved upstream: estimated from the samples at --load
    return saved


def lr_schedule_state(ckpt: MegatronDeepSpeedCheckpoint, config: Config) -> dict[str, Any] | None:
    """Megatron's OptimizerParamScheduler state as our `LRSchedule`'s (see `megatron_scheduler`)."""
    saved = ckpt.states.get("lr_scheduler")
    return megatron_scheduler.schedule_state(saved, config, ckpt.directory) if isinstance(saved, dict) else None
