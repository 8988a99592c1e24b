"""Megatron-compatible command-line flags, mapped onto the config tree and validated once.

`parse_config(argv)` returns `(Config, Namespace)`; every user error is a `ConfigError` whose
message names the flag, the bad value and the fix, raised before any process group exists.
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

from megatron_ds.config import DEDICATED_CHOICES, Config
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
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x tensor-parallel size")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    g.add_argument("--normalization", choices=("layernorm", "rmsnorm"), default="layernorm")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="the post stage gets its own LM head instead of the tied word embedding")


def _parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism and pipeline layout")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pp-dedicated-embedding-stages", nargs="?", const="both", default="none",
                   choices=DEDICATED_CHOICES,
                   help="reserve the first (pre), last (post) or both stages for the embedding / LM head "
                        "groups; the bare flag means both")
    g.add_argument("--pp-layout", default=None,
                   help="explicit layout in Megatron-LM's grammar, e.g. 'E|t*3|t*3|L' (E embedding, t layer, "
                        "L loss head, | stage boundary, x*N and (...)*N repeat)")
    g.add_argument("--pp-partition-method", default=None,
                   help="DeepSpeed-style partition: uniform, parameters, type:REGEX, type:NAME:W|NAME:W "
                        "(default type:transformer)")
    g.add_argument("--print-layout", action="store_true",
                   help="print the stage layout and exit without starting any process group")
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None)
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument("--world-size", type=int, default=None,
                   help="total ranks for --print-layout/validation (default: WORLD_SIZE or P x T)")


def _data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="+", default=[], help="PREFIX, or a blend 'W1 PREFIX1 W2 PREFIX2 ...'")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--mock-data", action="store_true", help="seeded synthetic tokens, no files needed")
    g.add_argument("--tokenizer-type", choices=("SentencePieceTokenizer", "GPT2BPETokenizer"), default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--num-workers", type=int, default=2)
    g.add_argument("--eod-mask-loss", action="store_true")


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
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)


def _training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--seed", type=int, default=1234)
    prec = g.add_mutually_exclusive_group()
    prec.add_argument("--fp16", action="store_true")
    prec.add_argument("--bf16", action="store_true")
    g.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    g.add_argument("--checkpoint-activations", action="store_true", help="recompute transformer layers")
    g.add_argument("--checkpoint-num-layers", type=int, default=1)
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None)
    g.add_argument("--deepspeed", action="store_true", help="accepted for Megatron-DeepSpeed scripts (always on)")
    g.add_argument("--exit-interval", type=int, default=None)


def _checkpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoints")
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--load-optional", action="store_true",
                   help="start fresh (with a warning) when --load holds no checkpoint yet")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")


def _logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--log-memory", dest="log_memory", action="store_true", default=True,
                   help="print each stage's memory once after the first log interval (default on)")
    g.add_argument("--no-log-memory", dest="log_memory", action="store_false")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pretrain_gpt.py", description="GPT pretraining on DeepSpeed's pipeline engine",
                allow_abbrev=False)
    for add in (_model_args, _parallel_args, _data_args, _optimizer_args, _training_args, _checkpoint_args,
                _logging_args):
        add(p)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def parse_config(argv: Optional[Sequence[str]] = None,
                 world_size: Optional[int] = None) -> tuple[Config, argparse.Namespace]:
    """Parse and validate; raises ConfigError with a one-line message on bad input."""
    args = build_parser().parse_args(argv)
    return build_config(args, world_size), args
