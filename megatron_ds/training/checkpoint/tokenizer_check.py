"""The run's tokenizer against the checkpoint's, before launch.

The same files at another path (an import's copy in `<checkpoint>/tokenizer/`) are the same
tokenizer. Other files with the same vocabulary (the same token behind every id, e.g. other merges)
are a NOTICE; another vocabulary would feed the trained embeddings other tokens, so it is an error
naming the first difference. A run without a tokenizer (`--mock-data
--vocab-size N`) or a checkpoint without one compares nothing: the architecture check already holds
the vocabulary rows.
"""

from __future__ import annotations

import filecmp
import os
from typing import Any

from megatron_ds.config import Config, DataConfig
from megatron_ds.data.tokenizer import Tokenizer, build_tokenizer
from megatron_ds.errors import UserError
from megatron_ds.training.checkpoint.directory import TOKENIZER_DIR, CheckpointError

FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")


def tokenizer_notice(meta: dict[str, Any], config: Config, load_dir: str, tag: str) -> str | None:
    """None when the tokenizers are the same; a NOTICE when only their names or files differ; raises
    CheckpointError when their vocabularies differ."""
    saved, ours = _fields(Config.from_dict(meta["config"]).data), _fields(config.data)
    if saved == ours or not saved["tokenizer_type"] or not ours["tokenizer_type"]:
        return None
    if "NullTokenizer" in (saved["tokenizer_type"], ours["tokenizer_type"]):
        return None  # ids without tokens: the vocabulary rows are the architecture check's
    where = f"--load {load_dir} ({tag})"
    theirs = _resolved(saved, load_dir)
    if theirs["tokenizer_type"] == ours["tokenizer_type"] and _same_files(theirs, ours):
        return None  # the same files at another path (an import's copy): nothing differs
    try:
        old = build_tokenizer(theirs.pop("tokenizer_type"), **theirs)
    except (UserError, OSError) as err:
        return f"NOTICE: {where} was trained with tokenizer {_name(saved)}, which cannot be read to compare ({err})"
    new = build_tokenizer(ours["tokenizer_type"], **{k: v for k, v in ours.items() if k != "tokenizer_type"})
    difference = _first_difference(old, new)
    if difference:
        raise CheckpointError(
            f"{where} was trained with tokenizer {_name(saved)}, this run's {_name(ours)} has another vocabulary "
            f"({difference}); give the checkpoint's tokenizer, or --finetune from the weights with a matching one"
        )
    return (
        f"NOTICE: {where} was trained with tokenizer {_name(saved)}; this run's {_name(ours)} has the same vocabulary"
    )


def _fields(data: DataConfig) -> dict[str, Any]:
    return {k: getattr(data, k) for k in FIELDS}


def _resolved(fields: dict[str, Any], load_dir: str) -> dict[str, Any]:
    """Recorded files that moved are looked for in `<load>/tokenizer/` (where an import copies them)."""
    out = dict(fields)
    for key in FIELDS[1:]:
        path = out[key]
        if path and not os.path.isfile(path):
            beside = os.path.join(load_dir, TOKENIZER_DIR, os.path.basename(path))
            out[key] = beside if os.path.isfile(beside) else path
    return out


def _same_files(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Both name the same tokenizer files by content (cheap: no vocabulary walk)."""
    for key in FIELDS[1:]:
        x, y = a[key], b[key]
        if bool(x) != bool(y):
            return False
        if x and not (os.path.isfile(x) and os.path.isfile(y) and filecmp.cmp(x, y, shallow=False)):
            return False
    return True


def _name(fields: dict[str, Any]) -> str:
    files = [fields[k] for k in FIELDS[1:] if fields[k]]
    return f"{fields['tokenizer_type']} ({', '.join(files)})" if files else str(fields["tokenizer_type"])


def _first_difference(a: Tokenizer, b: Tokenizer) -> str | None:
    """The first way two vocabularies differ (size, an id whose token differs, eod), or None. Tokens are compared as
    the vocabulary's strings when both have them (`Tokenizer.piece`: a SentencePiece model and the Hugging Face
    tokenizer made from it decode `<unk>` and control tokens differently but hold the same pieces), else decoded."""
    if a.vocab_size != b.vocab_size:
        return f"{a.vocab_size} vs {b.vocab_size} tokens"
    by_piece = a.piece(0) is not None and b.piece(0) is not None
    for i in range(a.vocab_size):
        x, y = (a.piece(i), b.piece(i)) if by_piece else (a.detokenize([i]), b.detokenize([i]))
        if x != y:
            return f"id {i} is {x!r} vs {y!r}"
    return f"end-of-document id {a.eod} vs {b.eod}" if a.eod != b.eod else None
