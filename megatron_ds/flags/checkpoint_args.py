"""Flags taken from the `--load` checkpoint: `--use-checkpoint-args`, and an import's dropout.

`--use-checkpoint-args` (Megatron's flag) takes the architecture from the checkpoint: every model
flag not given on the line gets the checkpoint's value, and with no tokenizer flag, its tokenizer
(files an import copied beside the checkpoint are found there). A flag given with another value
than the checkpoint's is then the usual one-line "another architecture" error at `--load`
(Megatron-DeepSpeed would let the checkpoint win over switches silently). Unlike Megatron, T and P
stay this run's: `--load` resumes into any layout (a NOTICE names the checkpoint's when they differ).

An imported Hugging Face model (a weights-only checkpoint) keeps its dropout when it is continued:
`--hidden-dropout` / `--attention-dropout` not given take the checkpoint's values (Llama's 0.0, not
Megatron's default 0.1). Our own checkpoints resume with the flags' dropout, as in Megatron.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from megatron_ds.config import Config, ModelConfig
from megatron_ds.errors import ConfigError
from megatron_ds.flags import megatron_lm_moe
from megatron_ds.flags.declare import ACCEPTED, flag_of
from megatron_ds.flags.notices import notice
from megatron_ds.flags.registry import FLAGS
from megatron_ds.flags.to_model_config import ACTIVATION_FLAGS
from megatron_ds.training.checkpoint.directory import TOKENIZER_DIR, load_tag, read_meta, recorded_vocab_size

DERIVED_MODEL_DESTS = (
    "ffn_hidden_size",
    "max_position_embeddings",
    "vocab_size",
    "add_position_embedding",
    "num_key_value_heads",
    "use_rotary_position_embeddings",
    "normalization",
    "window_size",
    "window_attn_skip_freq",
)
"""Model fields whose flag is derived (`Flag.derived`) but copies the value when given."""
TOKENIZER_DESTS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")
DROPOUT_DESTS = ("hidden_dropout", "attention_dropout")


def model_dests(model: ModelConfig) -> dict[str, Any]:
    """argparse dest -> value of every model flag that rebuilds `model`."""
    out: dict[str, Any] = {}
    for f in FLAGS:
        fields = [x for x in f.fields if x.startswith("model.")]  # --vocab-size also sets the NullTokenizer's
        if f.status == ACCEPTED and len(fields) == 1:
            name = fields[0].split(".", 1)[1]
            if not f.derived or f.attr in DERIVED_MODEL_DESTS:
                out[f.attr] = getattr(model, name)
    out.update(ACTIVATION_FLAGS[model.activation])
    unset, routing = megatron_lm_moe.checkpoint_dests(model)
    out = {dest: value for dest, value in out.items() if dest not in unset}
    return {dest: value for dest, value in {**out, **routing}.items() if value is not None}


def apply(args: argparse.Namespace, given: set[str]) -> None:
    """Fill `args` from `--load`'s checkpoint as described above (flags in `given` are kept)."""
    if args.load_optional and args.exit_on_missing_checkpoint:
        raise ConfigError(
            "--load-optional and --exit-on-missing-checkpoint were both given (start from scratch, or stop, when "
            "--load holds no checkpoint yet); keep one"
        )
    if args.use_checkpoint_args and not args.load:
        raise ConfigError("--use-checkpoint-args takes the architecture from --load's checkpoint; add --load DIR")
    if args.load_tag and not args.load:
        raise ConfigError(f"--load-tag {args.load_tag} names a checkpoint of --load; add --load DIR")
    meta, where = _latest(args.load, args.load_tag) if args.load else (None, "")
    if meta is None:
        if args.use_checkpoint_args:
            notice(f"--use-checkpoint-args: --load {args.load} holds no checkpoint yet; the flags give the model")
        return
    saved = Config.from_dict(meta["config"])
    if args.use_checkpoint_args:
        _take_architecture(args, given, saved, where, args.load, recorded_vocab_size(meta))
    if meta.get("weights_only"):
        _keep_dropout(args, given, saved, where)


def _latest(load_dir: str, tag: str | None) -> tuple[dict[str, Any] | None, str]:
    """The metadata of the checkpoint a launch resumes from (`--load-tag`, else `latest`) and where it is."""
    tag = load_tag(load_dir, tag)
    return (None, "") if tag is None else (read_meta(load_dir, tag), f"--load {load_dir} ({tag})")


def _take_architecture(
    args: argparse.Namespace, given: set[str], saved: Config, where: str, root: str, recorded: int | None
) -> None:
    """`recorded`: the unpadded vocabulary the checkpoint records (`directory.recorded_vocab_size`)."""
    taken = {d: v for d, v in model_dests(saved.model).items() if d not in given}
    if (
        args.use_tokenizer_model_from_checkpoint_args
        and not any(d in given for d in TOKENIZER_DESTS)
        and saved.data.tokenizer_type
    ):
        for dest in TOKENIZER_DESTS:
            path = getattr(saved.data, dest)
            if dest != "tokenizer_type" and path and not os.path.isfile(path):
                moved = os.path.join(root, TOKENIZER_DIR, os.path.basename(path))
                path = moved if os.path.isfile(moved) else path
            taken[dest] = path
    if "vocab_size" in taken and "make_vocab_size_divisible_by" not in given:
        rows, t = saved.model.vocab_size, args.tensor_model_parallel_size or 1
        if recorded and recorded < rows and rows % t == 0:  # the tokens, padded to the stored rows at this run's T
            taken["vocab_size"], taken["make_vocab_size_divisible_by"] = recorded, rows // t
        else:  # the stored size is padded already, as Megatron's padded_vocab_size
            taken["make_vocab_size_divisible_by"] = 1
    for dest, value in taken.items():
        setattr(args, dest, value)
    parts = [p for d, v in taken.items() for p in _rendered(d, v)]
    layout = ""
    ours = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    theirs = (saved.parallel.tensor_model_parallel_size, saved.parallel.pipeline_model_parallel_size)
    if ours != theirs:
        layout = (
            f"; T and P stay this run's ({ours[0]} and {ours[1]}; the checkpoint's are {theirs[0]} and {theirs[1]}, "
            f"which Megatron-DeepSpeed would also take): --load resumes into them"
        )
    notice(f"--use-checkpoint-args: from {where}: {', '.join(parts) or 'nothing (every model flag is given)'}{layout}")


def _rendered(dest: str, value: Any) -> list[str]:
    """How a dest's value is spelled on a command line (nothing for a default value)."""
    out = []
    for f in FLAGS:
        if f.attr != dest or f.status != ACCEPTED:
            continue
        if f.is_switch:
            out += [f.name] if value == f.const and value != f.resolved_default() else []
        elif value != f.resolved_default():
            out.append(f"{f.name} {value}")
    return out[:1]


def _keep_dropout(args: argparse.Namespace, given: set[str], saved: Config, where: str) -> None:
    kept = {d: getattr(saved.regularization, d) for d in DROPOUT_DESTS if d not in given}
    changed = {d: v for d, v in kept.items() if getattr(args, d) != v}
    for dest, value in kept.items():
        setattr(args, dest, value)
    if changed:
        shown = ", ".join(f"{flag_of(d)} {v:g}" for d, v in changed.items())
        notice(f"{where} is an imported model: continuing with its dropout ({shown}); give the flag to change it")
