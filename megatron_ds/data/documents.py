"""Documents of the input files of `tools/preprocess_data.py` and `tools/train_tokenizer.py`:
JSON lines, or `.txt` with blank-line separated documents."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence

from megatron_ds.data import DataError


def check_input_file(path: str) -> None:
    """An `--input` that is no file is a one-line error saying what it is."""
    if not os.path.isfile(path):
        what = "a directory; give a file" if os.path.isdir(path) else "file not found; fix the path"
        raise DataError(f"--input {path}: {what}")


def read_documents(path: str, json_keys: Sequence[str] = ("text",)) -> Iterator[dict[str, str]]:
    """Documents of one input file as `{key: text}`.

    `.txt`: documents are separated by one or more blank lines (paragraph style), stored under the
    single json key. Anything else: JSON lines, one object per line, blank lines ignored.
    """
    return (doc for doc, _ in sized_documents(path, json_keys))


def sized_documents(path: str, json_keys: Sequence[str] = ("text",)) -> Iterator[tuple[dict[str, str], int]]:
    """`read_documents`, each document with the bytes of the file it took (its lines and the blank lines before
    it): their sum is the file's size but for trailing blank lines, so progress can reach 100%."""
    check_input_file(path)
    if path.endswith(".txt"):
        if len(json_keys) != 1:
            raise DataError(
                f"--input {path}: a .txt file holds one field, but --json-keys names "
                f"{len(json_keys)}; pass one key or use JSONL"
            )
        yield from (({json_keys[0]: doc}, size) for doc, size in _text_blocks(path))
        return
    with open(path, encoding="utf-8", errors="strict") as f:
        size = 0
        for line_no, line in enumerate(_lines(f, path), 1):
            size += len(line.encode("utf-8"))
            if line.strip():
                yield _parse_json_line(path, line_no, line, json_keys), size
                size = 0


def _lines(f, path: str) -> Iterator[str]:
    try:
        yield from f
    except UnicodeDecodeError as err:
        raise DataError(
            f"--input {path}: not UTF-8 text ({err.reason} at byte {err.start} of a chunk); convert it to UTF-8"
        ) from None


def _parse_json_line(path: str, line_no: int, line: str, json_keys: Sequence[str]) -> dict[str, str]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(
            f"--input {path}:{line_no}: invalid JSON ({err.msg}, column {err.colno}); fix or drop the line"
            + ("" if path.endswith((".json", ".jsonl")) else " (only a .txt file is read as plain text)")
        ) from None
    if not isinstance(obj, dict):
        raise DataError(
            f"--input {path}:{line_no}: expected a JSON object per line, got "
            f'{type(obj).__name__}; write one {{"text": ...}} object per line'
        )
    doc = {}
    for key in json_keys:
        if key not in obj:
            keys = ", ".join(sorted(obj)) or "none"
            raise DataError(
                f"--input {path}:{line_no}: no key {key!r} (keys: {keys}); pass --json-keys with the right name"
            )
        if not isinstance(obj[key], str):
            raise DataError(
                f"--input {path}:{line_no}: key {key!r} holds {type(obj[key]).__name__}, not text; fix the line"
            )
        doc[key] = obj[key]
    return doc


def _text_blocks(path: str) -> Iterator[tuple[str, int]]:
    """Paragraphs and the bytes each took (its lines and the blank lines before it)."""
    block: list[str] = []
    size = 0
    with open(path, encoding="utf-8") as f:
        for line in _lines(f, path):
            if line.strip():
                block.append(line)
            elif block:
                yield "".join(block).rstrip("\n"), size
                block, size = [], 0
            size += len(line.encode("utf-8"))
    if block:
        yield "".join(block).rstrip("\n"), size
