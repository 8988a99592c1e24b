"""An upstream run's saved `args` as command-line flags: each saved value that differs from its
upstream default becomes the flag that sets it, so our own parser reads it (and refuses what is not
built here, in one line naming the flag). The tables live with each upstream's import
(`megatron_deepspeed_args`, `megatron_lm_args`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_ds.training.checkpoint.directory import CheckpointError


class SavedArgs:
    """What both upstreams' saved args say of the run's parallel sizes and precision (a mixin of the
    checkpoint records, which hold `args`: `vars()` of the saved Namespace)."""

    args: dict[str, Any]

    @property
    def tensor_parallel(self) -> int:
        return int(self.args["tensor_model_parallel_size"])

    @property
    def pipeline_parallel(self) -> int:
        return int(self.args["pipeline_model_parallel_size"])

    @property
    def precision(self) -> str:
        return "bf16" if self.args.get("bf16") else "fp16" if self.args.get("fp16") else "fp32"


REQUIRED_INTEGERS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers", "hidden_size")


def check_saved_args(args: dict[str, Any], path: str) -> None:
    """The saved args every conversion reads are there (else the file is damaged)."""
    for key in REQUIRED_INTEGERS:
        if not isinstance(args.get(key), int):
            raise CheckpointError(f"{path}: its saved args have no integer {key}; the checkpoint is damaged")


Neutral = Any
"""What is not rendered: a value, a tuple of values, or a function of the args giving one (e.g. the
number of heads for the key/value heads)."""


@dataclass(frozen=True)
class Arg:
    """One saved value and the upstream flag that sets it."""

    flag: str
    neutral: Neutral = None
    switch: bool = False
    saved_as: str | None = None
    """Its `args` attribute when not the flag's name (`--disable-bias-linear` sets add_bias_linear)."""
    spelled: Callable[[Any], str] | None = None
    """The one command-line value upstream's parser reads back as the saved value (a tuple's "5,0"); None: one
    value per item of a list, else `str`."""

    @property
    def dest(self) -> str:
        return self.saved_as or self.flag.lstrip("-").replace("-", "_")


def on(flag: str, saved_as: str | None = None) -> Arg:
    """A switch that sets its value True (store_true): given when the run had it on."""
    return Arg(flag, False, switch=True, saved_as=saved_as)


def off(flag: str, saved_as: str) -> Arg:
    """A `--no-...`-style switch that sets `saved_as` False: given when the run had it off."""
    return Arg(flag, True, switch=True, saved_as=saved_as)


SCHEDULE_ARGS = (
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
)
"""The batch sizes and the schedule's first flags, spelled alike by both upstreams."""
ADAM_AND_PRECISION_ARGS = (
    Arg("--clip-grad", 1.0),
    Arg("--adam-beta1", 0.9),
    Arg("--adam-beta2", 0.999),
    Arg("--adam-eps", 1e-8),
    Arg("--seed", 1234),
    on("--fp16"),
    on("--bf16"),
    Arg("--rampup-batch-size"),
)
"""The training flags' tail, spelled alike by both upstreams."""
TOKENIZER_FILES = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
}
"""Tokenizers of both upstreams that we build, and the `args` naming the files each needs."""
INIT_AND_DROPOUT_ARGS = (Arg("--init-method-std", 0.02), Arg("--hidden-dropout", 0.1), Arg("--attention-dropout", 0.1))


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
        elif arg.spelled is not None:
            argv += [arg.flag, arg.spelled(value)]
        elif isinstance(value, (list, tuple)):
            argv += [arg.flag, *map(str, value)]
        else:
            argv += [arg.flag, str(value)]
    return argv


def _whole_override(given: dict[str, str], saved_type: Any, files: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """The tokenizer given on the command line, its type the saved one when only files are given (a run's
    tokenizer files moved); its files are loaded here, so a bad one is the tokenizer's own one-line error (the
    conversion's flag checks would name it as the checkpoint's saved args)."""
    if "tokenizer_type" not in given:
        if saved_type not in files:
            flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in given.items())
            raise CheckpointError(
                f"{flags}: the checkpoint's tokenizer {saved_type} takes no such file; give --tokenizer-type too"
            )
        given = {"tokenizer_type": saved_type, **given}
    if given["tokenizer_type"] != "NullTokenizer":  # its ids come from the saved args' --vocab-size
        from megatron_ds.data.tokenizer import build_tokenizer

        build_tokenizer(
            given["tokenizer_type"], given.get("tokenizer_model"), given.get("vocab_file"), given.get("merge_file")
        )
    return given


def tokenizer_flags(
    args: dict[str, Any], overrides: dict[str, str | None], files: dict[str, tuple[str, ...]]
) -> tuple[list[str], str | None]:
    """Our tokenizer flags for the run's tokenizer (`files`: the tokenizer types we build and the
    `args` holding the files each needs), and a note when it cannot be recorded. Files are recorded
    only if they still exist; `overrides` (given on the command line) win."""
    given = {k: v for k, v in overrides.items() if v}
    if given:
        given = _whole_override(given, args.get("tokenizer_type"), files)
        return [x for k, v in given.items() for x in (f"--{k.replace('_', '-')}", v)], None
    kind = args.get("tokenizer_type")
    needs = files.get(kind)
    paths = {k: args.get(k) for k in needs or ()}
    if needs is not None and all(p and os.path.exists(p) for p in paths.values()):
        recorded = [x for k, v in paths.items() for x in (f"--{k.replace('_', '-')}", v)]
        return ["--tokenizer-type", kind, *recorded], None
    missing = "its files are not here" if needs else "not one of ours"
    return [], f"tokenizer {kind} not recorded ({missing}): give --tokenizer-type and its files when training from it"
