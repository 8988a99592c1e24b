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

    TYPE = "HuggingFaceTokenizer"
    """Its `--tokenizer-type` (messages name it)."""

    def __init__(self, directory: str | None) -> None:
        if not directory:
            raise DataError(f"--tokenizer-model is required with --tokenizer-type {self.TYPE}; give its directory")
        if not os.path.isdir(directory):
            raise DataError(
                f"--tokenizer-model {directory}: not a directory; {self.TYPE} reads a local tokenizer "
                f"directory (nothing is downloaded)"
            )
        self.directory = directory
        self._load()

    LOAD_OPTIONS: dict[str, Any] = {}
    """`AutoTokenizer.from_pretrained` options beyond `local_files_only` and `trust_remote_code` off."""

    def _load(self) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise DataError(
                f"--tokenizer-type {self.TYPE} needs the transformers package; pip install transformers"
            ) from None
        try:
            tok = AutoTokenizer.from_pretrained(
                self.directory, local_files_only=True, trust_remote_code=False, **self.LOAD_OPTIONS
            )
        except (OSError, ValueError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise DataError(f"--tokenizer-model {self.directory}: not a Hugging Face tokenizer ({first})") from None
        self._tok = tok
        self._adopt(tok)
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("tokenizer_path", [os.path.abspath(self.directory)])]
        )

    def _adopt(self, tok: Any) -> None:
        """vocab_size, eod and pad from the loaded tokenizer (megatron-core's reading)."""
        if tok.eos_token_id is None:
            raise DataError(
                f"--tokenizer-model {self.directory}: the tokenizer has no eos token to end documents; set eos_token"
            )
        self.vocab_size = len(tok)
        self.eod = int(tok.eos_token_id)
        self.pad = NO_PAD if tok.pad_token_id is None else int(tok.pad_token_id)

    @property
    def hf_tokenizer(self) -> Any:
        """The transformers tokenizer itself (prompt data calls it with padding and truncation; an export reads its
        special ids)."""
        return self._tok

    @property
    def eos(self) -> int:
        return self.eod

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok(text).input_ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def piece(self, token_id: int) -> str | None:
        """The tokenizer's token string for one id (`convert_ids_to_tokens`: a SentencePiece piece, a BPE token)."""
        return self._tok.convert_ids_to_tokens(int(token_id))

    # DataLoader workers under the spawn start method pickle the dataset and its tokenizer.
    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.directory = state["directory"]
        self._load()


MEGATRON_DEEPSPEED_SPECIALS = (
    ("pad_token", "[PAD]"),
    ("eos_token", "</s>"),
    ("bos_token", "<s>"),
    ("unk_token", "<unk>"),
)
"""What Megatron-DeepSpeed's HFTokenizer adds to a tokenizer that lacks them (Stanford Alpaca's defaults)."""


class MegatronDeepSpeedHFTokenizer(HuggingFaceTokenizer):
    """Megatron-DeepSpeed's `--tokenizer-type HFTokenizer` (its `_HFTokenizer`, which finetune_llama.py's
    prompt data tokenizes with): `AutoTokenizer` with `use_fast=False` and right padding, and a pad, eos,
    bos or unk token the directory lacks added as a new token (`[PAD]`, `</s>`, `<s>`, `<unk>`). Unlike
    Megatron-LM's HuggingFaceTokenizer, `vocab_size` is the tokenizer's base vocabulary (`tok.vocab_size`,
    the added tokens left out), so the model of a Llama directory keeps its 32000 rows, and Llama's added
    `[PAD]` (id 32000) lies outside it: `data/prompt_data.py` keeps it out of the model's input.
    Read with `local_files_only` and no remote code, as HuggingFaceTokenizer."""

    TYPE = "HFTokenizer"
    LOAD_OPTIONS = {"padding_side": "right", "use_fast": False}

    def _adopt(self, tok: Any) -> None:
        tok.add_special_tokens({role: text for role, text in MEGATRON_DEEPSPEED_SPECIALS if getattr(tok, role) is None})
        self.vocab_size = int(tok.vocab_size)
        self.eod = int(tok.eos_token_id)
        self.pad = int(tok.pad_token_id)

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok.encode(text))
