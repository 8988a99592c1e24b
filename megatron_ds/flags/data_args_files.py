"""Megatron-LM's `--data-args-path` and `--per-split-data-args-path`: the data paths read from files, as its
`get_blend_and_blend_per_split` reads them (whitespace-split text; a JSON object of the three splits whose values
are a string, split on whitespace, or a list). Where Megatron-LM silently prefers one source over another
(`--per-split-data-args-path` over `--train-data-path`, `--data-path` over both) the pair is refused here."""

from __future__ import annotations

import argparse
import json
from typing import Any

from megatron_ds.errors import ConfigError

SPLITS = ("train", "valid", "test")


def data_paths_from_files(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    """{DataConfig field: value} for the files given ({} when neither flag is); ConfigError naming the file."""
    out: dict[str, tuple[str, ...]] = {}
    if args.data_args_path is not None:
        if args.data_path:
            raise ConfigError(
                f"--data-args-path {args.data_args_path} and --data-path were both given (Megatron-LM asserts); keep one"
            )
        tokens = tuple(_read(args.data_args_path, "--data-args-path").split())
        if not tokens:
            raise ConfigError(
                f"--data-args-path {args.data_args_path}: the file is empty; write --data-path's value in it"
            )
        out["data_path"] = tokens
    if args.per_split_data_args_path is not None:
        out.update(_per_split(args))
    return out


def _per_split(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    path = args.per_split_data_args_path
    flag = f"--per-split-data-args-path {path}"
    beside = [f for f, v in (("--data-path", args.data_path), ("--data-args-path", args.data_args_path)) if v]
    beside += [f"--{s}-data-path" for s in SPLITS if getattr(args, f"{s}_data_path")]
    if beside:
        raise ConfigError(
            f"{flag} and {beside[0]} were both given (Megatron-LM would read only "
            f"{'--data-path' if beside[0].startswith('--data') else 'the file'}); keep one"
        )
    try:
        doc = json.loads(_read(path, "--per-split-data-args-path"))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{flag}: not JSON ({err.msg} at line {err.lineno}); write an object with {_KEYS}") from None
    if not isinstance(doc, dict) or any(s not in doc for s in SPLITS):
        missing = [s for s in SPLITS if not isinstance(doc, dict) or s not in doc]
        raise ConfigError(f"{flag}: no {missing[0]!r} key (Megatron-LM needs all three); write an object with {_KEYS}")
    return {f"{s}_data_path": _split_value(doc[s], flag, s) for s in SPLITS}


_KEYS = '"train", "valid" and "test" (each a prefix, a weighted blend, or null)'


def _split_value(value: Any, flag: str, split: str) -> tuple[str, ...]:
    if value is None:
        return ()
    items = value.split() if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(x, (str, int, float)) for x in items):
        raise ConfigError(f"{flag}: {split!r} is {json.dumps(value)}; give a string or a list of prefixes and weights")
    if not items:
        raise ConfigError(f"{flag}: {split!r} names no data; give its prefix (or blend), or null for no {split} split")
    return tuple(str(x) for x in items)


def _read(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else type(err).__name__
        raise ConfigError(f"{flag} {path}: cannot read it ({reason}); give the file's path") from None
