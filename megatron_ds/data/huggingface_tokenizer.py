"""Megatron-LM's `--tokenizer-type HuggingFaceTokenizer`: transformers' `AutoTokenizer` of a local
directory (`--tokenizer-model DIR`), read with `local_files_only` so that nothing is downloaded and no
code from the directory runs (`trust_remote_code` off).

As megatron-core's HuggingFaceTokenizer: `vocab_size` is `len(tokenizer)` (added tokens included),
eod is the eos token, pad the pad token (or none), and text becomes `tokenizer(text).input_ids`
(special tokens included, its `include_special_tokens` default).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from megatron_ds.data import DataError

NO_PAD = -1
"""megatron-core's "no padding token" (`data.tokenizer.NO_PAD`; this module sits beside that one and
does not import it, since `build_tokenizer` there imports this)."""


class HuggingFaceTokenizer:
    """A Hugging Face tokenizer directory (tokenizer.json, or vocab.json + merges.txt, ...); the
    interface of `megatron_ds.data.tokenizer.Tokenizer`."""

    def __init__(self, directory: str | None) -> None:
        if not directory:
            raise DataError(
                "--tokenizer-model is required with --tokenizer-type HuggingFaceTokenizer; give its directory"
            )
        if not os.path.isdir(directory):
            raise DataError(
                f"--tokenizer-model {directory}: not a directory; HuggingFaceTokenizer reads a local tokenizer "
                f"directory (nothing is downloaded)"
            )
        self.directory = directory
        self._load()

    def _load(self) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise DataError(
                "--tokenizer-type HuggingFaceTokenizer needs the transformers package; pip install transformers"
            ) from None
        try:
            tok = AutoTokenizer.from_pretrained(self.directory, local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise DataError(f"--tokenizer-model {self.directory}: not a Hugging Face tokenizer ({first})") from None
        if tok.eos_token_id is None:
            raise DataError(
                f"--tokenizer-model {self.directory}: the tokenizer has no eos token to end documents; set eos_token"
            )
        self._tok = tok
        self.vocab_size = len(tok)
        self.eod = int(tok.eos_token_id)
        self.pad = NO_PAD if tok.pad_token_id is None else int(tok.pad_token_id)
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("tokenizer_path", [os.path.abspath(self.directory)])]
        )

    @property
    def eos(self) -> int:
        return self.eod

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok(text).input_ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    # DataLoader workers under the spawn start method pickle the dataset and its tokenizer.
    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.directory = state["directory"]
        self._load()
