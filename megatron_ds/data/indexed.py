"""Megatron's `<prefix>.bin/.idx` token files: write them, and validate a pair before reading it.

The files are written by megatron-core's own `IndexedDatasetBuilder`, so data made by Megatron-LM's
`tools/preprocess_data.py` and by ours are interchangeable. Validation re-reads the `.idx` layout
with plain numpy *before* megatron-core maps it: megatron-core asserts or reads garbage through
mmap on a truncated or foreign file, and it costs ~6 s to import, which a typo should not.

`.idx` layout (little endian): magic `MMIDIDX\\0\\0`, u64 version 1, u8 dtype code, u64 sequence
count S, u64 document count D, i32[S] sequence lengths, i64[S] byte offsets into `.bin`,
i64[D] document boundaries (sequence indices, first 0, last S).

Megatron-DeepSpeed's `tools/preprocess_data.py --append-eod` writes each document's end-of-document
token to the `.bin` but leaves it out of the lengths (and so of the offsets) in the `.idx` (the bug
Megatron-LM fixed in its PR #431). Such a pair is recognised here (the `.bin` holds one token more
per non-empty document, and that token is the same id after every document) and described by
`IndexInfo.eod_id`; `append_eod` gives the lengths with each EOD included.
"""

from __future__ import annotations

import hashlib
import os
import struct
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_ds import files
from megatron_ds.data import DataError

INDEX_HEADER = b"MMIDIDX\x00\x00"
LEGACY_INDEX_HEADER = b"TNTIDX\x00\x00"
"""Megatron-DeepSpeed's older IndexedDataset (`--data-impl lazy/cached`), which `infer` tells apart by it."""
INDEX_VERSION = 1
HEADER_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8
TOKEN_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
"""megatron-core's `DType` codes that can hold token ids."""
REWRITE = "re-run tools/preprocess_data.py to rewrite it"
CHUNK = 1 << 22
"""Sequences (or documents) per chunk when checking an index: an index of 100M documents is GBs."""


@dataclass(frozen=True)
class IndexInfo:
    """What a valid `.idx` says about its dataset."""

    prefix: str
    dtype: type
    sequence_lengths: np.ndarray
    """Tokens per sequence as the `.idx` stores them (one sequence per document when written by
    our tools), int32; memory-mapped."""
    document_indices: np.ndarray
    """Document boundaries (sequence indices, D + 1 of them), int64; memory-mapped."""
    fingerprint: str
    """A digest of the sequence lengths and document boundaries: everything the sample indices
    are built from. Part of the index-cache key, so a changed file never reuses a stale index."""
    eod_id: int | None = None
    """Set for Megatron-DeepSpeed's `--append-eod` layout: the end-of-document id that follows
    every non-empty document in the `.bin` but is not counted in the `.idx` lengths."""

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.shape[0]) - 1

    @property
    def num_sequences(self) -> int:
        return int(self.sequence_lengths.shape[0])

    @property
    def num_tokens(self) -> int:
        """Tokens the `.idx` lengths count (without the uncounted EODs of the append-eod layout)."""
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
    if head.startswith(LEGACY_INDEX_HEADER):
        raise DataError(f"{path}: a legacy (lazy/cached) index, not the mmap format read here; {REWRITE}")
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
    lengths = np.memmap(path, np.int32, "r", HEADER_BYTES, (num_seq,)) if num_seq else np.zeros(0, np.int32)
    pointers_at = HEADER_BYTES + 4 * num_seq
    docs = np.memmap(path, np.int64, "r", pointers_at + 8 * num_seq, (num_docs,)) if num_docs else np.zeros(0, np.int64)
    if docs.size == 0 or docs[0] != 0 or docs[-1] != num_seq or np.any(np.diff(docs) < 0):
        raise DataError(f"{path}: corrupt document boundaries; {REWRITE}")
    digest = hashlib.blake2b(struct.pack("<QQ", num_seq, num_docs), digest_size=16)
    num_tokens = _check_offsets(path, lengths, pointers_at, np.dtype(dtype).itemsize, digest)
    for lo in range(0, docs.size, CHUNK):
        digest.update(np.ascontiguousarray(docs[lo : lo + CHUNK]).tobytes())
    info = IndexInfo(prefix, dtype, lengths, docs, digest.hexdigest())
    eod_id = _check_bin(info, num_tokens, pointers_at)
    return info if eod_id is None else IndexInfo(prefix, dtype, lengths, docs, info.fingerprint, eod_id)


def _check_offsets(path: str, lengths: np.ndarray, pointers_at: int, itemsize: int, digest: Any) -> int:
    """Byte offsets must be the running sum of the lengths; returns the total token count."""
    total = 0
    for lo in range(0, lengths.size, CHUNK):
        part = np.asarray(lengths[lo : lo + CHUNK], dtype=np.int64)
        digest.update(np.ascontiguousarray(lengths[lo : lo + CHUNK]).tobytes())
        if np.any(part < 0):
            raise DataError(f"{path}: corrupt (negative sequence length); {REWRITE}")
        starts = (total + np.concatenate(([0], np.cumsum(part[:-1])))) * itemsize
        pointers = np.fromfile(path, np.int64, part.size, offset=pointers_at + 8 * lo)
        if not np.array_equal(starts, pointers):
            raise DataError(f"{path}: corrupt (sequence offsets do not match lengths); {REWRITE}")
        total += int(part.sum())
    return total


def _check_bin(info: IndexInfo, num_tokens: int, pointers_at: int) -> int | None:
    """The `.bin` holds exactly the tokens the `.idx` describes (None), or those plus one EOD
    after every non-empty document, Megatron-DeepSpeed's `--append-eod` layout (the EOD id)."""
    idx, path = idx_path(info.prefix), bin_path(info.prefix)
    itemsize = np.dtype(info.dtype).itemsize
    size = os.path.getsize(path)
    described = f"{idx} describes {num_tokens} tokens in {info.num_documents} documents"
    if size % itemsize:
        raise DataError(f"{path}: {size} bytes, not a whole number of {np.dtype(info.dtype).name} tokens; {REWRITE}")
    stored = size // itemsize
    if stored < num_tokens:
        raise DataError(f"{path}: truncated ({stored} tokens, but {described}); {REWRITE}")
    if stored == num_tokens:
        return None
    extra = stored - num_tokens
    num_ends = int(np.count_nonzero(np.diff(info.document_indices) > 0))
    if extra == num_ends:
        eods = _tokens_after_documents(info, pointers_at)
        if eods.size and np.all(eods == eods[0]):
            return int(eods[0])
        how = f"one per document, but the tokens after the documents are {np.unique(eods).size} different ids"
    else:
        how = f"not one per document ({num_ends})"
    raise DataError(
        f"{path} holds {stored} tokens but its index {described}: {extra} more, {how}, so not "
        f"Megatron-DeepSpeed's --append-eod layout either; the .bin and .idx come from different "
        f"runs: re-run tools/preprocess_data.py to write both"
    )


def _tokens_after_documents(info: IndexInfo, pointers_at: int) -> np.ndarray:
    """The `.bin` token right after each non-empty document, if each were followed by an uncounted
    EOD: the k-th such document's last sequence ends k tokens later in the `.bin` than its offset says."""
    itemsize = np.dtype(info.dtype).itemsize
    tokens = np.memmap(bin_path(info.prefix), info.dtype, "r")
    pointers = np.memmap(idx_path(info.prefix), np.int64, "r", pointers_at, (info.num_sequences,))
    found, seen = [], 0
    docs = info.document_indices
    for lo in range(0, docs.size - 1, CHUNK):
        bounds = np.asarray(docs[lo : lo + CHUNK + 1])
        last = bounds[1:][np.diff(bounds) > 0] - 1  # the last sequence of each non-empty document
        ends = pointers[last] // itemsize + info.sequence_lengths[last] + seen + np.arange(last.size)
        found.append(np.asarray(tokens[ends]))
        seen += last.size
    return np.concatenate(found) if found else np.zeros(0, info.dtype)


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
    """Documents the `.idx` records, the empty ones included."""
    num_tokens: int = 0
    num_empty: int = 0
    """Documents with no tokens: recorded as both upstreams' tools record them (a document boundary with no
    sequence, `builder.add_document([], [])`), so the `.idx` is theirs byte for byte; no sample reads them."""


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
        """Append one document (an empty one as a boundary without a sequence, as upstream's tools)."""
        self.stats.num_documents += 1
        if len(ids) == 0:
            self.stats.num_empty += 1
            self._start().add_document(np.zeros(0, dtype=np.int64), [])
            return
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.vocab_size:
            raise DataError(
                f"token id {hi if hi >= self.vocab_size else lo} outside "
                f"[0, {self.vocab_size}) while writing {self.prefix}; the tokenizer "
                f"does not match its vocabulary size"
            )
        self._start().add_document(np.asarray(ids, dtype=np.int64), [len(ids)])
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
        for path in (bin_path(self.prefix), idx_path(self.prefix)):  # both checked before either is replaced
            if os.path.isdir(path):
                self.abort()
                raise DataError(f"{path}: is a directory; remove it or give another --output-prefix")
        for path in (bin_path(self._tmp), idx_path(self._tmp)):  # on the device before the names say complete
            files.fsync_file(path)
        os.replace(bin_path(self._tmp), bin_path(self.prefix))
        os.replace(idx_path(self._tmp), idx_path(self.prefix))
        files.fsync_directory(os.path.dirname(os.path.abspath(self.prefix)))
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


def eod_included_lengths(info: IndexInfo) -> np.ndarray:
    """Tokens per sequence as the `.bin` holds them: for the append-eod layout, the last sequence
    of each non-empty document one longer (its EOD); in memory, int32."""
    lengths = np.array(info.sequence_lengths, dtype=np.int32)
    if info.eod_id is not None:
        bounds = np.asarray(info.document_indices)
        lengths[bounds[1:][np.diff(bounds) > 0] - 1] += 1
    return lengths


def read_lengths(info: IndexInfo, misaligned: bool = False) -> np.ndarray:
    """The lengths a run reads: each EOD included, or (`misaligned`, `--misaligned-append-eod`)
    as the `.idx` stores them, which is how Megatron-DeepSpeed reads its own append-eod files."""
    return info.sequence_lengths if misaligned or info.eod_id is None else eod_included_lengths(info)


def read_tokens(prefix: str) -> list[np.ndarray]:
    """All sequences of a validated dataset, each EOD included, for tests and inspection (small data only)."""
    info = read_index(prefix)
    flat = np.fromfile(bin_path(prefix), dtype=info.dtype)
    return np.split(flat, np.cumsum(eod_included_lengths(info)[:-1], dtype=np.int64))
