"""Megatron's `<prefix>.bin/.idx` token files: read corpora, write them, and validate them.

The files are written by megatron-core's own `IndexedDatasetBuilder`, so data made by Megatron-LM's
`tools/preprocess_data.py` and by ours are interchangeable. Validation re-reads the `.idx` layout
with plain numpy *before* megatron-core maps it: megatron-core asserts or reads garbage through
mmap on a truncated or foreign file, and it costs ~6 s to import, which a typo should not.

`.idx` layout (little endian): magic `MMIDIDX\\0\\0`, u64 version 1, u8 dtype code, u64 sequence
count S, u64 document count D, i32[S] sequence lengths, i64[S] byte offsets into `.bin`,
i64[D] document boundaries (sequence indices, first 0, last S).
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_ds.data import DataError

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8
TOKEN_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
"""megatron-core's `DType` codes that can hold token ids."""
REWRITE = "re-run tools/preprocess_data.py to rewrite it"


@dataclass(frozen=True)
class IndexInfo:
    """What a valid `.idx` says about its dataset."""

    prefix: str
    dtype: type
    sequence_lengths: np.ndarray
    """Tokens per sequence (one sequence per document when written by our tools), int32."""
    num_documents: int

    @property
    def num_sequences(self) -> int:
        return int(self.sequence_lengths.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def _check_files(prefix: str, flag: str) -> None:
    missing = [p for p in (idx_path(prefix), bin_path(prefix)) if not os.path.isfile(p)]
    if len(missing) == 2:
        raise DataError(
            f"{flag} {prefix}: no {prefix}.bin/.idx found; give the prefix without the "
            f"extension (e.g. data/corpus_text_document) or create it with "
            f"tools/preprocess_data.py"
        )
    if missing:
        raise DataError(f"{flag} {prefix}: {missing[0]} not found; {REWRITE}")
    for p in (idx_path(prefix), bin_path(prefix)):
        if not os.access(p, os.R_OK):
            raise DataError(f"{flag} {prefix}: {p} is not readable; fix its permissions")


def _read_header(path: str) -> tuple[type, int, int]:
    """(dtype, sequence count, document count) of an `.idx`, or a DataError."""
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if not head[: len(INDEX_HEADER)] == INDEX_HEADER[: len(head)]:
        raise DataError(f"{path}: bad magic header (not a Megatron index file); {REWRITE}")
    if len(head) < HEADER_BYTES:
        raise DataError(f"{path}: truncated ({len(head)} bytes, header alone is {HEADER_BYTES}); {REWRITE}")
    version, code, num_seq, num_docs = struct.unpack("<QBQQ", head[len(INDEX_HEADER) :])
    if version != INDEX_VERSION:
        raise DataError(f"{path}: index version {version} is not supported (expected {INDEX_VERSION}); {REWRITE}")
    if code not in TOKEN_DTYPES:
        raise DataError(f"{path}: dtype code {code} is not a token dtype; {REWRITE}")
    return TOKEN_DTYPES[code], num_seq, num_docs


def read_index(prefix: str, flag: str = "--data-path") -> IndexInfo:
    """Validate `<prefix>.idx/.bin` against each other; DataError names the file and the fix."""
    _check_files(prefix, flag)
    path = idx_path(prefix)
    dtype, num_seq, num_docs = _read_header(path)
    size = os.path.getsize(path)
    expected = HEADER_BYTES + 12 * num_seq + 8 * num_docs
    if size not in (expected, expected + num_seq):  # + S: the optional per-sequence mode bytes
        raise DataError(
            f"{path}: truncated or corrupt (header says {num_seq} sequences and "
            f"{num_docs - 1} documents, i.e. {expected} bytes; the file has {size}); "
            f"{REWRITE}"
        )
    # Memory-mapped and checked in chunks: an index of 100M documents is GBs.
    lengths = np.memmap(path, np.int32, "r", HEADER_BYTES, (num_seq,)) if num_seq else np.zeros(0, np.int32)
    pointers_at = HEADER_BYTES + 4 * num_seq
    docs = np.memmap(path, np.int64, "r", pointers_at + 8 * num_seq, (num_docs,)) if num_docs else np.zeros(0, np.int64)
    if docs.size == 0 or docs[0] != 0 or docs[-1] != num_seq or np.any(np.diff(docs) < 0):
        raise DataError(f"{path}: corrupt document boundaries; {REWRITE}")
    num_tokens = _check_offsets(path, lengths, pointers_at, np.dtype(dtype).itemsize)
    _check_bin_size(prefix, num_tokens * np.dtype(dtype).itemsize)
    return IndexInfo(prefix, dtype, lengths, num_docs - 1)


def _check_offsets(path: str, lengths: np.ndarray, pointers_at: int, itemsize: int, chunk: int = 1 << 22) -> int:
    """Byte offsets must be the running sum of the lengths; returns the total token count."""
    total = 0
    for lo in range(0, lengths.size, chunk):
        part = np.asarray(lengths[lo : lo + chunk], dtype=np.int64)
        if np.any(part < 0):
            raise DataError(f"{path}: corrupt (negative sequence length); {REWRITE}")
        starts = (total + np.concatenate(([0], np.cumsum(part[:-1])))) * itemsize
        pointers = np.fromfile(path, np.int64, part.size, offset=pointers_at + 8 * lo)
        if not np.array_equal(starts, pointers):
            raise DataError(f"{path}: corrupt (sequence offsets do not match lengths); {REWRITE}")
        total += int(part.sum())
    return total


def _check_bin_size(prefix: str, expected: int) -> None:
    path = bin_path(prefix)
    size = os.path.getsize(path)
    if size < expected:
        raise DataError(f"{path}: truncated ({size} bytes; its index {idx_path(prefix)} needs {expected}); {REWRITE}")
    if size > expected:
        raise DataError(
            f"{path}: {size} bytes but its index {idx_path(prefix)} describes "
            f"{expected}: the pair comes from different runs; {REWRITE}"
        )


def is_valid(prefix: str) -> bool:
    """Whether `<prefix>.bin/.idx` exist and pass `read_index`."""
    try:
        read_index(prefix)
        return True
    except DataError:
        return False


def megatron_indexed_dataset_module() -> Any:
    """`megatron.core.datasets.indexed_dataset`, imported without its warnings about missing
    optional GPU kernels (Transformer Engine, Apex): noise on every run of a data tool."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex", category=UserWarning)
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def load_indexed_dataset(prefix: str, flag: str = "--data-path") -> Any:
    """megatron-core's `IndexedDataset` for a prefix that passed validation first."""
    read_index(prefix, flag)
    return megatron_indexed_dataset_module().IndexedDataset(prefix, multimodal=False, mmap=True)


@dataclass
class WriteStats:
    """What an `IndexedWriter` wrote."""

    num_documents: int = 0
    num_tokens: int = 0
    num_empty: int = 0
    """Documents with no tokens: skipped, because a zero-length sequence is not a sample."""


class IndexedWriter:
    """Writes `<prefix>.bin/.idx` with megatron-core's builder, one sequence per document.

    The dtype is megatron-core's choice for `vocab_size` (uint16 below 65500, else int32). Files
    appear atomically on `close()`: a failure leaves any previous pair in place, never half a new
    one. megatron-core is imported at the first document, so bad input fails fast.
    """

    def __init__(self, prefix: str, vocab_size: int) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self.prefix = prefix
        self.vocab_size = vocab_size
        self.stats = WriteStats()
        self._tmp = f"{prefix}.tmp{os.getpid()}"
        self._builder = None

    def add(self, ids: Sequence[int]) -> None:
        """Append one document."""
        if len(ids) == 0:
            self.stats.num_empty += 1
            return
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.vocab_size:
            raise DataError(
                f"token id {hi if hi >= self.vocab_size else lo} outside "
                f"[0, {self.vocab_size}) while writing {self.prefix}; the tokenizer "
                f"does not match its vocabulary size"
            )
        self._start().add_document(np.asarray(ids, dtype=np.int64), [len(ids)])
        self.stats.num_documents += 1
        self.stats.num_tokens += len(ids)

    def _start(self) -> Any:
        if self._builder is None:
            mc = megatron_indexed_dataset_module()
            self._builder = mc.IndexedDatasetBuilder(bin_path(self._tmp), dtype=mc.DType.optimal_dtype(self.vocab_size))
        return self._builder

    def close(self) -> WriteStats:
        """Finish the files and move them into place."""
        builder = self._start()
        builder.finalize(idx_path(self._tmp))
        os.replace(bin_path(self._tmp), bin_path(self.prefix))
        os.replace(idx_path(self._tmp), idx_path(self.prefix))
        return self.stats

    def abort(self) -> None:
        """Drop the partial files."""
        if self._builder is not None:
            self._builder.data_file.close()
        for p in (bin_path(self._tmp), idx_path(self._tmp)):
            if os.path.exists(p):
                os.remove(p)

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_indexed_dataset(prefix: str, documents: Iterable[Sequence[int]], vocab_size: int) -> WriteStats:
    """Write token-id documents to `<prefix>.bin/.idx`; see `IndexedWriter`."""
    with IndexedWriter(prefix, vocab_size) as writer:
        for ids in documents:
            writer.add(ids)
    return writer.stats


def read_tokens(prefix: str) -> list[np.ndarray]:
    """All sequences of a validated dataset, for tests and inspection (small data only)."""
    info = read_index(prefix)
    flat = np.fromfile(bin_path(prefix), dtype=info.dtype)
    return np.split(flat, np.cumsum(info.sequence_lengths[:-1], dtype=np.int64))


def read_documents(path: str, json_keys: Sequence[str] = ("text",)) -> Iterator[dict[str, str]]:
    """Documents of one input file as `{key: text}`.

    `.txt`: documents are separated by one or more blank lines (paragraph style), stored under the
    single json key. Anything else: JSON lines, one object per line, blank lines ignored.
    """
    if not os.path.isfile(path):
        raise DataError(f"--input {path}: file not found; fix the path")
    if path.endswith(".txt"):
        if len(json_keys) != 1:
            raise DataError(
                f"--input {path}: a .txt file holds one field, but --json-keys names "
                f"{len(json_keys)}; pass one key or use JSONL"
            )
        yield from ({json_keys[0]: doc} for doc in _text_blocks(path))
        return
    with open(path, encoding="utf-8", errors="strict") as f:
        for line_no, line in enumerate(_lines(f, path), 1):
            if line.strip():
                yield _parse_json_line(path, line_no, line, json_keys)


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


def _text_blocks(path: str) -> Iterator[str]:
    block: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in _lines(f, path):
            if line.strip():
                block.append(line)
            elif block:
                yield "".join(block).rstrip("\n")
                block = []
    if block:
        yield "".join(block).rstrip("\n")
