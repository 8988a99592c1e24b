"""Megatron-compatible command-line flags, mapped onto the config tree and validated once.

`parse_config(argv)` returns `(Config, Namespace)`; every user error is a `ConfigError` whose
message names the flag, the bad value and the fix, raised before any process group exists.
Megatron-DeepSpeed flags that change nothing here, or that we refuse, come from the table in
`megatron_ds.compat`; a refused flag is an error that says why, an unknown one "unrecognized".
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from megatron_ds import compat
from megatron_ds.config import DEDICATED_CHOICES, Config
from megatron_ds.pipeline.methods import partition_method_help
from megatron_ds.validation import ConfigError, build_config

__all__ = ["ConfigError", "build_parser", "parse_config"]


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message}; see `python pretrain_gpt.py --help`")


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, help="transformer layers")
    g.add_argument("--hidden-size", type=int, help="model width")
    g.add_argument("--num-attention-heads", type=int, help="attention heads")
    g.add_argument("--ffn-hidden-size", type=int, help="MLP inner width (default 4 x hidden)")
    g.add_argument("--seq-length", type=int, help="tokens per sample")
    g.add_argument("--max-position-embeddings", type=int, help="position embedding rows (default seq length)")
    g.add_argument("--vocab-size", type=int, help="vocabulary size (else from the tokenizer); padded, see below")
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the vocabulary to a multiple of this x tensor-parallel size",
    )
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    g.add_argument("--normalization", choices=("layernorm", "rmsnorm"), default="layernorm")
    g.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="the post stage gets its own LM head instead of the tied word embedding",
    )
    g.add_argument(
        "--num-key-value-heads",
        type=int,
        default=None,
        help="grouped-query attention: key/value heads (divides --num-attention-heads)",
    )
    g.add_argument("--kv-channels", type=int, default=None, help="head size; only hidden / heads is built")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP instead of GeLU")
    g.add_argument("--use-rotary-position-embeddings", action="store_true", help="rotary embeddings on q and k")
    g.add_argument(
        "--no-position-embedding",
        dest="add_position_embedding",
        action="store_false",
        help="no learned absolute position embedding",
    )
    g.add_argument(
        "--disable-bias-linear",
        dest="add_bias_linear",
        action="store_false",
        help="no biases in the attention and MLP linear layers",
    )
    g.add_argument("--num-experts", type=int, nargs="+", default=[1], help="only 1 (a dense model)")


def _parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism and pipeline layout")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument(
        "--pp-dedicated-embedding-stages",
        nargs="?",
        const="both",
        default="none",
        choices=DEDICATED_CHOICES,
        help="reserve the first (pre), last (post) or both stages for the embedding / LM head "
        "groups; the bare flag means both",
    )
    g.add_argument(
        "--pp-layout",
        default=None,
        help="explicit layout in Megatron-LM's grammar, e.g. 'E|t*3|t*3|L' (E embedding, t layer, "
        "L loss head, | stage boundary, x*N and (...)*N repeat)",
    )
    g.add_argument(
        "--pp-partition-method",
        default=None,
        help=partition_method_help(),
    )
    g.add_argument(
        "--print-layout", action="store_true", help="print the stage layout and exit without starting any process group"
    )
    g.add_argument(
        "--standalone-embedding-stage",
        action="store_true",
        help="Megatron's name for --pp-dedicated-embedding-stages pre",
    )
    g.add_argument(
        "--no-pipeline-parallel",
        action="store_true",
        help="Megatron-DeepSpeed's P=1 switch; needs --pipeline-model-parallel-size 1 (a 1-stage "
        "pipeline engine is still used)",
    )
    g.add_argument(
        "--distributed-backend",
        default=None,
        choices=("nccl", "gloo", *compat.refused_value_choices("--distributed-backend")),
    )
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="total ranks for --print-layout/validation (default: WORLD_SIZE or P x T)",
    )


def _data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="+", default=[], help="PREFIX, or a blend 'W1 PREFIX1 W2 PREFIX2 ...'")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--mock-data", action="store_true", help="seeded synthetic tokens, no files needed")
    g.add_argument(
        "--tokenizer-type",
        default=None,
        choices=(*compat.TOKENIZER_TYPES, *compat.refused_value_choices("--tokenizer-type")),
    )
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--num-workers", type=int, default=2)
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--data-impl", default="mmap", choices=("mmap", *compat.refused_value_choices("--data-impl")))
    g.add_argument(
        "--dataloader-type", default="single", choices=("single", *compat.refused_value_choices("--dataloader-type"))
    )
    g.add_argument("--vocab-extra-ids", type=int, default=0, help="only 0")


def _optimizer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer and schedule")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clip; 0 disables")
    g.add_argument(
        "--weight-decay-incr-style",
        default="constant",
        choices=("constant", *compat.refused_value_choices("--weight-decay-incr-style")),
    )
    g.add_argument(
        "--lr-decay-style", choices=("constant", "linear", "cosine", "inverse-square-root"), default="linear"
    )
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-decay-tokens", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-tokens", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument(
        "--override-opt_param-scheduler",
        "--override-lr-scheduler",
        dest="override_opt_param_scheduler",
        action="store_true",
        help="on resume, use the flags' lr schedule, not the checkpoint's",
    )
    g.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        "--use-checkpoint-lr-scheduler",
        dest="use_checkpoint_opt_param_scheduler",
        action="store_true",
        help="on resume, keep the checkpoint's lr schedule",
    )


def _training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--train-tokens", type=int, default=None, help="also stop once this many tokens are consumed")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--seed", type=int, default=1234)
    prec = g.add_mutually_exclusive_group()
    prec.add_argument("--fp16", action="store_true")
    prec.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="fp16: static loss scale (default dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=None, help="fp16: a power of 2 (default 2^16)")
    g.add_argument("--min-loss-scale", type=float, default=None, help="fp16 (default 1)")
    g.add_argument("--loss-scale-window", type=int, default=None, help="fp16 (default 1000)")
    g.add_argument("--hysteresis", type=int, default=None, help="fp16 (default 2)")
    g.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    g.add_argument("--checkpoint-activations", action="store_true", help="recompute transformer layers")
    g.add_argument("--checkpoint-num-layers", type=int, default=None, help="layers per recomputed chunk (1)")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--activations-checkpoint-method", choices=("uniform", "block"), default=None)
    g.add_argument("--activations-checkpoint-num-layers", type=int, default=None)
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None)
    g.add_argument("--deepspeed", action="store_true", help="accepted for Megatron-DeepSpeed scripts (always on)")
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument(
        "--exit-duration-in-mins",
        type=float,
        default=None,
        help="save (with --save) and stop after the iteration that passes this many minutes",
    )


def _checkpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoints")
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None)
    g.add_argument(
        "--load-optional", action="store_true", help="start fresh (with a warning) when --load holds no checkpoint yet"
    )
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")


def _logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument(
        "--log-memory",
        dest="log_memory",
        action="store_true",
        default=True,
        help="print each stage's memory once after the first log interval (default on)",
    )
    g.add_argument("--no-log-memory", dest="log_memory", action="store_false")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000)
    g.add_argument("--log-timers-to-tensorboard", action="store_true", help="time per iteration")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true")
    g.add_argument(
        "--no-log-learnig-rate-to-tensorboard",
        dest="log_learning_rate_to_tensorboard",
        action="store_false",
        help="(Megatron's spelling)",
    )
    g.add_argument("--no-log-loss-scale-to-tensorboard", dest="log_loss_scale_to_tensorboard", action="store_false")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument(
        "--log-optimizer-states-to-tensorboard",
        action="store_true",
        help="norms of the Adam moments held by the logging rank",
    )
    g.add_argument("--log-memory-to-tensorboard", action="store_true")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")


class _Refused(argparse.Action):
    """Records a refused Megatron-DeepSpeed flag; `parse_config` reports all of them in one line."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        namespace.refused_flags = *getattr(namespace, "refused_flags", ()), option_string


_NARGS = {compat.SWITCH: 0, compat.VALUE: "?", compat.VALUES: "*"}


def _compat_args(p: argparse.ArgumentParser) -> None:
    """The no-op and refused Megatron-DeepSpeed flags of `megatron_ds.compat`."""
    g = p.add_argument_group("Megatron-DeepSpeed flags that change nothing here (see README)")
    for f in compat.FLAGS:
        if f.status == compat.NO_OP and f.kind == compat.SWITCH:
            g.add_argument(f.name, action="store_true", help=f.note)
        elif f.status == compat.NO_OP:
            g.add_argument(f.name, nargs=_NARGS[f.kind], help=f.note)
        elif f.status == compat.REFUSED:
            p.add_argument(f.name, action=_Refused, nargs=_NARGS[f.kind], help=argparse.SUPPRESS)
    p.set_defaults(refused_flags=())


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="pretrain_gpt.py", description="GPT pretraining on DeepSpeed's pipeline engine", allow_abbrev=False
    )
    for add in (
        _model_args,
        _parallel_args,
        _data_args,
        _optimizer_args,
        _training_args,
        _checkpoint_args,
        _logging_args,
        _compat_args,
    ):
        add(p)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def parse_config(argv: Sequence[str] | None = None, world_size: int | None = None) -> tuple[Config, argparse.Namespace]:
    """Parse and validate; raises ConfigError with a one-line message on bad input."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.refused_flags:
        raise ConfigError(compat.refused_flags_message(list(args.refused_flags)))
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return build_config(args, world_size), args
