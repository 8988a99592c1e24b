"""A Megatron-DeepSpeed run's saved `args` as our flags, and its schedule and counters as ours.

`config_from_args` renders the saved values that shape the model or its training as
Megatron-DeepSpeed command-line flags and parses them with our own parser, so each one means
here what it meant upstream, and one we do not build (MoE, squared ReLU, post-LN residuals,
other projection widths...) is refused in one line naming the flag. Values at upstream's neutral
setting are not rendered. The padded vocabulary comes out as upstream padded it: the tokenizer's
size (`universal_checkpoint_info`'s `original_vocab_size`) with the same divisor and T.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from megatron_ds.config import Config
from megatron_ds.errors import UserError
from megatron_ds.interop.megatron_deepspeed_files import MegatronDeepSpeedCheckpoint
from megatron_ds.training.checkpoint.directory import CheckpointError
from megatron_ds.training.lr_schedule import SAMPLES, TOKENS
from megatron_ds.training.state import TrainState

Neutral = Any
"""What is not rendered: a value, a tuple of values, or a function of the args giving one (e.g. the
number of heads for the key/value heads)."""


@dataclass(frozen=True)
class Arg:
    """One saved value and the Megatron-DeepSpeed flag that sets it."""

    flag: str
    neutral: Neutral = None
    switch: bool = False
    saved_as: str | None = None
    """Its `args` attribute when not the flag's name (`--disable-bias-linear` sets add_bias_linear)."""

    @property
    def dest(self) -> str:
        return self.saved_as or self.flag.lstrip("-").replace("-", "_")


def on(flag: str) -> Arg:
    """A switch that sets its value True (store_true): given when the run had it on."""
    return Arg(flag, False, switch=True)


def off(flag: str, saved_as: str) -> Arg:
    """A `--no-...`-style switch that sets `saved_as` False: given when the run had it off."""
    return Arg(flag, True, switch=True, saved_as=saved_as)


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
    Arg("--mlp-type", "standard"),
    Arg("--num-layers-per-virtual-pipeline-stage"),
    Arg("--init-method-std", 0.02),
    Arg("--hidden-dropout", 0.1),
    Arg("--attention-dropout", 0.1),
)
"""What shapes the model (and its dropout and init), in Megatron-DeepSpeed's spelling."""
TRAINING_ARGS = (
    Arg("--micro-batch-size"),
    Arg("--global-batch-size"),
    Arg("--train-iters"),
    Arg("--train-samples", lambda a: a["train_samples"] if a.get("train_iters") else None),
    Arg("--optimizer", "adam"),
    Arg("--lr"),
    Arg("--min-lr", 0.0),
    Arg("--lr-decay-style", "linear"),
    Arg("--lr-decay-iters"),  # explicit: a longer --train-iters keeps the run's schedule
    Arg("--lr-decay-samples"),
    Arg("--lr-decay-tokens"),
    Arg("--lr-warmup-iters", 0),
    Arg("--lr-warmup-samples", 0),
    Arg("--lr-warmup-fraction"),
    Arg("--lr-warmup-tokens"),
    Arg("--weight-decay", 0.01),
    Arg("--start-weight-decay", lambda a: _constant_wd(a, "start_weight_decay")),
    Arg("--end-weight-decay", lambda a: _constant_wd(a, "end_weight_decay")),
    Arg("--clip-grad", 1.0),
    Arg("--adam-beta1", 0.9),
    Arg("--adam-beta2", 0.999),
    Arg("--adam-eps", 1e-8),
    Arg("--seed", 1234),
    on("--fp16"),
    on("--bf16"),
    Arg("--rampup-batch-size"),
)
"""What a resume compares (batch sizes, optimizer, schedule) and records."""
TOKENIZER_FILES = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
}
"""Tokenizers of upstream's we build, and the files each needs (recorded only if they still exist)."""


def _rotary(a: dict[str, Any]) -> bool:
    return bool(a.get("use_rotary_position_embeddings"))


def _constant_wd(a: dict[str, Any], dest: str) -> Any:
    """Megatron sets start and end weight decay to --weight-decay when no schedule was asked for."""
    same = a.get("start_weight_decay") == a.get("end_weight_decay") == a.get("weight_decay")
    return a.get(dest) if same or a.get("start_weight_decay") is None else None


def render(args: dict[str, Any], table: Sequence[Arg]) -> list[str]:
    """The flags that set these values (none for a value at its neutral setting)."""
    argv: list[str] = []
    for arg in table:
        value = args.get(arg.dest)
        neutral = arg.neutral(args) if callable(arg.neutral) else arg.neutral
        if value is None or value in (neutral if isinstance(neutral, tuple) else (neutral,)):
            continue
        if arg.switch:
            argv.append(arg.flag)
        elif isinstance(value, (list, tuple)):
            argv += [arg.flag, *map(str, value)]
        else:
            argv += [arg.flag, str(value)]
    return argv


def tokenizer_flags(
    ckpt: MegatronDeepSpeedCheckpoint, overrides: dict[str, str | None]
) -> tuple[list[str], str | None]:
    """Our tokenizer flags for the run's tokenizer, and a note when it cannot be recorded."""
    given = {k: v for k, v in overrides.items() if v}
    if given:
        return [x for k, v in given.items() for x in (f"--{k.replace('_', '-')}", v)], None
    kind = ckpt.args.get("tokenizer_type")
    needs = TOKENIZER_FILES.get(kind)
    paths = {k: ckpt.args.get(k) for k in needs or ()}
    if needs and all(p and os.path.isfile(p) for p in paths.values()):
        files = [x for k, v in paths.items() for x in (f"--{k.replace('_', '-')}", v)]
        return ["--tokenizer-type", kind, *files], None
    missing = "its files are not here" if needs else "not one of ours"
    return [], f"tokenizer {kind} not recorded ({missing}): give --tokenizer-type and its files when training from it"


def vocab_size(ckpt: MegatronDeepSpeedCheckpoint) -> int:
    """The tokenizer's vocabulary (unpadded): upstream records it since universal checkpoints exist;
    older checkpoints: the padded size itself (padding then counts as vocabulary)."""
    info = ckpt.checkpoint_info
    return int(info.get("original_vocab_size") or ckpt.args["padded_vocab_size"])


def config_from_args(ckpt: MegatronDeepSpeedCheckpoint, tokenizer: list[str]) -> Config:
    """Our Config of the run (T and P as saved; one data-parallel rank: DP is free on resume)."""
    from megatron_ds.flags.parser import parse_config

    a = ckpt.args
    if ckpt.zero_stage >= 3:
        raise CheckpointError(
            f"{ckpt.directory}: a ZeRO-3 checkpoint (parameters partitioned over data-parallel ranks) cannot be "
            f"converted; convert it to full weights upstream first (DeepSpeed's zero_to_fp32.py) or save it with ZeRO 0-2"
        )
    flags = [
        *render(a, MODEL_ARGS),
        *render(a, TRAINING_ARGS),
        f"--vocab-size={vocab_size(ckpt)}",
        f"--tensor-model-parallel-size={ckpt.tensor_parallel}",
        f"--pipeline-model-parallel-size={ckpt.pipeline_parallel}",
        f"--zero-stage={min(ckpt.zero_stage, 1)}",  # ZeRO-2 keeps ZeRO-1's files: the state converts the same
        *tokenizer,
    ]
    try:
        config, _ = parse_config(flags, world_size=ckpt.tensor_parallel * ckpt.pipeline_parallel)
    except UserError as err:
        raise CheckpointError(f"{ckpt.directory}: its saved args, as flags, are refused here: {err}") from None
    padded = int(a.get("padded_vocab_size") or 0)
    if padded and config.model.vocab_size != padded:
        raise CheckpointError(
            f"{ckpt.directory}: its padded vocabulary has {padded} rows, our padding of {vocab_size(ckpt)} gives "
            f"{config.model.vocab_size}; the checkpoint's args are inconsistent"
        )
    return config


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
    """Megatron's OptimizerParamScheduler state as our `LRSchedule`'s: progress counted in samples
    (or tokens) either way; ours stores optimizer steps, upstream the samples they consumed."""
    saved = ckpt.states.get("lr_scheduler")
    if not isinstance(saved, dict):
        return None
    gbs = config.training.global_batch_size
    steps, remainder = divmod(int(saved["num_steps"]), gbs)
    if remainder:
        raise CheckpointError(
            f"{ckpt.directory}: its schedule counted {saved['num_steps']} samples, not a multiple of the global batch "
            f"size {gbs} (a batch-size ramp-up?); it cannot be continued here"
        )
    in_tokens = saved.get("lr_decay_tokens") is not None or saved.get("lr_warmup_tokens") is not None
    per_sample = config.model.seq_length if in_tokens else 1
    # A length upstream counts in samples is that many samples' tokens in a schedule counted in tokens
    # (as upstream does itself when its warm-up is in samples and its decay in tokens).
    warmup, decay = saved.get("lr_warmup_tokens"), saved.get("lr_decay_tokens")
    return {
        "num_steps": steps,
        "max_lr": float(saved["max_lr"]),
        "min_lr": float(saved["min_lr"]),
        "decay_style": saved["lr_decay_style"],
        "unit": TOKENS if in_tokens else SAMPLES,
        "warmup": int(warmup if warmup is not None else int(saved["lr_warmup_steps"]) * per_sample),
        "decay": int(decay if decay is not None else int(saved["lr_decay_steps"]) * per_sample),
    }
