"""Megatron-DeepSpeed's `--append-eod` files (see `indexed`): the notice a run prints for them, and
`rewrite_index`, which writes a corrected `.idx` next to the original once (`tools/fix_append_eod_index.py`).

A run reads such files with each document's EOD included by default, holding the corrected lengths
and offsets in memory (12 bytes per document). The rewritten index is memory-mapped instead, and
megatron-core or Megatron-LM read it as it is.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from megatron_ds import files
from megatron_ds.data import DataError
from megatron_ds.data.indexed import (
    CHUNK,
    HEADER_BYTES,
    INDEX_HEADER,
    INDEX_VERSION,
    TOKEN_DTYPES,
    IndexInfo,
    bin_path,
    eod_included_lengths,
    idx_path,
    read_index,
)

MISALIGNED_FLAG = "--misaligned-append-eod"


def notice(info: IndexInfo, misaligned: bool) -> str:
    """The one line a run prints for an append-eod pair: what was found and how it is read."""
    num_ends = int(np.count_nonzero(np.diff(info.document_indices) > 0))
    found = (
        f"NOTICE: {idx_path(info.prefix)} is Megatron-DeepSpeed's --append-eod layout: its lengths leave out "
        f"the end-of-document token {info.eod_id} that {bin_path(info.prefix)} holds after each of its "
        f"{num_ends} non-empty documents"
    )
    if misaligned:
        return (
            f"{found}; read as Megatron-DeepSpeed reads it ({MISALIGNED_FLAG}): document k starts k tokens early, "
            f"so samples mix in the neighbouring documents' tokens"
        )
    return (
        f"{found}; read with each EOD included, the tokens tools/preprocess_data.py writes "
        f"(tools/fix_append_eod_index.py rewrites the index once; {MISALIGNED_FLAG} reads it as Megatron-DeepSpeed does)"
    )


def offsets(lengths: np.ndarray, itemsize: int) -> np.ndarray:
    """Byte offset of each sequence in the `.bin`: the exclusive running sum of the lengths."""
    out = np.zeros(lengths.shape[0], dtype=np.int64)
    np.cumsum(lengths[:-1], dtype=np.int64, out=out[1:])
    return out * itemsize


def rewrite_index(prefix: str, output_prefix: str) -> IndexInfo:
    """Write `<output_prefix>.idx` with each EOD counted, and `<output_prefix>.bin` as a hard link to
    the original `.bin` (a symbolic link where the file system has none). The index appears
    atomically; the original pair is never touched. Returns the new pair's IndexInfo."""
    info = read_index(prefix, "--input")
    if info.eod_id is None:
        raise DataError(
            f"--input {prefix}: {idx_path(prefix)} already counts every token of {bin_path(prefix)}; "
            f"nothing to rewrite, train on it as it is"
        )
    if os.path.abspath(output_prefix) == os.path.abspath(prefix):
        raise DataError(f"--output-prefix {output_prefix}: the same as --input; give a new prefix")
    existing = [p for p in (idx_path(output_prefix), bin_path(output_prefix)) if os.path.lexists(p)]
    if existing:
        raise DataError(f"--output-prefix {output_prefix}: {existing[0]} exists; remove it or give a new prefix")
    files.check_output_prefix("--output-prefix", output_prefix, error=DataError)
    tmp = f"{idx_path(output_prefix)}.tmp{os.getpid()}"
    linked = False
    try:
        _write_index(info, tmp)
        _link(bin_path(prefix), bin_path(output_prefix))
        linked = True
        files.fsync_file(tmp)
        os.replace(tmp, idx_path(output_prefix))
        files.fsync_directory(os.path.dirname(os.path.abspath(output_prefix)))
    except BaseException:
        if linked and not os.path.lexists(idx_path(output_prefix)):  # no half pair left to block a rerun
            os.remove(bin_path(output_prefix))
        raise
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return read_index(output_prefix, "--output-prefix")


def _write_index(info: IndexInfo, path: str) -> None:
    code = next(c for c, t in TOKEN_DTYPES.items() if t is info.dtype)
    lengths = eod_included_lengths(info)
    with open(path, "wb") as f:
        f.write(INDEX_HEADER + struct.pack("<QBQQ", INDEX_VERSION, code, info.num_sequences, info.num_documents + 1))
        f.write(lengths.tobytes())
        f.write(offsets(lengths, np.dtype(info.dtype).itemsize).tobytes())
        docs = info.document_indices
        for lo in range(0, docs.size, CHUNK):
            f.write(np.ascontiguousarray(docs[lo : lo + CHUNK]).tobytes())
        size = HEADER_BYTES + 12 * info.num_sequences + 8 * docs.size
        with open(idx_path(info.prefix), "rb") as src:  # the optional per-sequence mode bytes
            src.seek(size)
            f.write(src.read())
        f.flush()
        os.fsync(f.fileno())


def _link(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        os.symlink(os.path.relpath(os.path.abspath(source), os.path.dirname(os.path.abspath(target))), target)
