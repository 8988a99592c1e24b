"""Tokenizers: text <-> token ids, plus what megatron-core's `GPTDataset` reads from them.

megatron-core touches `vocab_size` (token dtype), `eod` (loss mask with `--eod-mask-loss`), `pad`
(padding, masked out of the loss; -1 means "none") and `unique_identifiers` (hashed into the names
of its index caches). Every tokenizer here provides exactly those, plus `tokenize`/`detokenize`.
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from megatron_ds.data import DataError
from megatron_ds.errors import first_line

TOKENIZER_TYPES = (
    "SentencePieceTokenizer",
    "Llama2Tokenizer",
    "GPT2BPETokenizer",
    "NullTokenizer",
    "HuggingFaceTokenizer",
    "HFTokenizer",
)
# Megatron-LM's name for a SentencePiece model used as a GPT tokenizer (eod = eos); same thing here.
_ALIASES = {"GPTSentencePieceTokenizer": "SentencePieceTokenizer"}
GPT2_EOD_TOKEN = "<|endoftext|>"
NO_PAD = -1
"""`pad` of tokenizers without a padding token; megatron-core's own "no pad" value."""


class Tokenizer:
    """The interface every tokenizer implements."""

    vocab_size: int
    """Number of token ids; every id is in [0, vocab_size)."""
    eod: int
    """End-of-document id, appended after each document by `tools/preprocess_data.py --append-eod`."""
    pad: int = NO_PAD
    """Padding id, or -1 when the tokenizer has none."""
    unique_identifiers: OrderedDict[str, Any]
    """Identifies the tokenizer in megatron-core's cache names."""

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`."""
        raise NotImplementedError

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of token ids."""
        raise NotImplementedError

    @property
    def eos(self) -> int:
        """megatron-core checks `pad` against `eos` and `eod`; they are the same token here."""
        return self.eod

    def piece(self, token_id: int) -> str | None:
        """The vocabulary's own string for one id (a SentencePiece piece, a byte-level BPE token), comparable across
        tokenizer types that read the same vocabulary; None when there is no such string (ids only)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod}, pad={self.pad})"


def _identifiers(tokenizer: Tokenizer, *paths: str) -> OrderedDict[str, Any]:
    ids: OrderedDict[str, Any] = OrderedDict()
    ids["class"] = type(tokenizer).__name__
    ids["tokenizer_path"] = [os.path.abspath(p) for p in paths]
    return ids


def _require_file(path: str | None, flag: str, fix: str) -> str:
    if not path:
        raise DataError(f"{flag} is required; {fix}")
    if not os.path.isfile(path):
        raise DataError(f"{flag} {path}: file not found; {fix}")
    if not os.access(path, os.R_OK):
        raise DataError(f"{flag} {path}: file not readable; fix its permissions")
    return path


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; its `eos` piece is the end-of-document token."""

    def __init__(self, model_file: str) -> None:
        _require_file(model_file, "--tokenizer-model", "train one with tools/train_tokenizer.py or fix the path")
        self.model_file = model_file
        self._load()
        self.unique_identifiers = _identifiers(self, model_file)

    def _load(self) -> None:
        import sentencepiece as spm

        try:
            self._sp = spm.SentencePieceProcessor(model_file=self.model_file)
        except (RuntimeError, OSError) as err:
            reason = first_line(err)
            raise DataError(
                f"--tokenizer-model {self.model_file}: not a SentencePiece model "
                f"({reason}); train one with tools/train_tokenizer.py"
            ) from None
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise DataError(
                f"--tokenizer-model {self.model_file}: the model has no end-of-document "
                f"(eos) piece; retrain it with tools/train_tokenizer.py"
            )
        pad = self._sp.pad_id()
        self.pad = pad if pad >= 0 else NO_PAD

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(int(token_id))

    # DataLoader workers under the spawn start method pickle the dataset and its tokenizer.
    def __getstate__(self) -> dict[str, Any]:
        return {"model_file": self.model_file}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.model_file = state["model_file"]
        self._load()
        self.unique_identifiers = _identifiers(self, self.model_file)


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron-LM's `--tokenizer-type Llama2Tokenizer` (`_Llama2Tokenizer`): the SentencePiece model's own pieces, eod
    its eos, pad its pad; `tokenize` puts its bos before the text (Megatron-LM's default `bos=True`), so
    `tools/preprocess_data.py` writes each document as Megatron-LM's does: bos, the text, and eos with --append-eod."""

    def _load(self) -> None:
        super()._load()
        self.bos = self._sp.bos_id()
        if self.bos < 0:
            raise DataError(
                f"--tokenizer-model {self.model_file}: the model has no bos piece, which Llama2Tokenizer puts before "
                f"each text; use --tokenizer-type GPTSentencePieceTokenizer"
            )

    def tokenize(self, text: str) -> list[int]:
        return [self.bos, *super().tokenize(text)]


def megatron_deepspeed_sentencepiece(model_file: str) -> tuple[int, int, list[str]]:
    """(ids, end-of-document id, pieces it adds) of Megatron-DeepSpeed's `--tokenizer-type SentencePieceTokenizer`
    on this model (`megatron/tokenizer/tokenizer.py` `_SentencePieceTokenizer._initalize`): the model's pieces, then
    <CLS>, <SEP>, <EOD> and <MASK>, and the pad, bos and eos pieces (<PAD>, <BOS>, <EOS> for a model without one),
    each appended when the model lacks it; its eod is <EOD>. Ours is its GPTSentencePieceTokenizer (eod the eos)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model_file)
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    added: list[str] = []

    def add(piece: str) -> int:
        if piece not in vocab:
            vocab[piece] = len(vocab)
            added.append(piece)
        return vocab[piece]

    eod = [add(piece) for piece in ("<CLS>", "<SEP>", "<EOD>", "<MASK>")][2]
    for special, default in ((sp.pad_id(), "<PAD>"), (sp.bos_id(), "<BOS>"), (sp.eos_id(), "<EOS>")):
        add(sp.id_to_piece(special) if 0 <= special < sp.get_piece_size() else default)  # upstream: IndexError
    return len(vocab), eod, added


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (printable bytes map to themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _gpt2_pattern() -> Any:
    """GPT-2's pre-tokenizer. Exact with the `regex` package; without it, `re` stands in:
    letters are `[^\\W\\d_]`, numbers `\\d` (same on ASCII and ordinary scripts)."""
    try:
        import regex

        return regex.compile(
            r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"""
            r"""|\s+(?!\S)|\s+"""
        )
    except ImportError:
        return re.compile(
            r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+"""
            r"""|\s+(?!\S)|\s+"""
        )


class GPT2BPETokenizer(Tokenizer):
    """GPT-2's byte-level BPE from `vocab.json` and `merges.txt`; eod is `<|endoftext|>`."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        fix = "give the GPT-2 vocab.json / merges.txt pair"
        _require_file(vocab_file, "--vocab-file", fix)
        _require_file(merge_file, "--merge-file", fix)
        self.vocab_file, self.merge_file = vocab_file, merge_file
        self._encoder = _read_vocab(vocab_file)
        self._decoder = {i: t for t, i in self._encoder.items()}
        self._ranks = {pair: rank for rank, pair in enumerate(_read_merges(merge_file))}
        if GPT2_EOD_TOKEN not in self._encoder:
            raise DataError(
                f"--vocab-file {vocab_file}: no {GPT2_EOD_TOKEN!r} token to end documents; add it to the vocabulary"
            )
        self.eod = self._encoder[GPT2_EOD_TOKEN]
        self.vocab_size = max(self._encoder.values()) + 1
        self.pad = NO_PAD
        self._byte_encoder = _bytes_to_unicode()
        self._byte_decoder = {c: b for b, c in self._byte_encoder.items()}
        self._pattern = _gpt2_pattern()
        self._cache: dict[str, list[int]] = {}
        self.unique_identifiers = _identifiers(self, vocab_file, merge_file)

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        for word in self._pattern.findall(text):
            cached = self._cache.get(word)
            if cached is None:
                cached = self._word_ids(word)
                if len(self._cache) < 100_000:  # bound memory on huge corpora
                    self._cache[word] = cached
            ids.extend(cached)
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        chars = "".join(self._decoder[int(i)] for i in ids)
        return bytes(self._byte_decoder[c] for c in chars).decode("utf-8", errors="replace")

    def piece(self, token_id: int) -> str | None:
        return self._decoder.get(int(token_id))

    def _word_ids(self, word: str) -> list[int]:
        symbols = "".join(self._byte_encoder[b] for b in word.encode("utf-8"))
        ids = []
        for piece in self._bpe(symbols):
            if piece not in self._encoder:
                raise DataError(
                    f"--vocab-file {self.vocab_file}: piece {piece!r} from --merge-file "
                    f"{self.merge_file} is not in the vocabulary; use a matching pair"
                )
            ids.append(self._encoder[piece])
        return ids

    def _bpe(self, symbols: str) -> list[str]:
        """Repeatedly merge the adjacent pair of lowest merge rank (left to right, no overlap)."""
        parts = list(symbols)
        while len(parts) > 1:
            pairs = {(a, b) for a, b in zip(parts, parts[1:])}
            best = min(pairs, key=lambda p: self._ranks.get(p, len(self._ranks)))
            if best not in self._ranks:
                break
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts


def _read_vocab(path: str) -> dict[str, int]:
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"--vocab-file {path}: not valid JSON ({err}); give GPT-2's vocab.json") from None
    if (
        not isinstance(vocab, dict)
        or not vocab
        or not all(isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in vocab.items())
    ):
        raise DataError(
            f"--vocab-file {path}: expected a JSON object of token -> id (int >= 0); give GPT-2's vocab.json"
        )
    return vocab


def _read_merges(path: str) -> list[tuple[str, str]]:
    merges = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line or (line_no == 1 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise DataError(
                    f"--merge-file {path}:{line_no}: expected two space-separated "
                    f"symbols, got {line!r}; give GPT-2's merges.txt"
                )
            merges.append((parts[0], parts[1]))
    return merges


class NullTokenizer(Tokenizer):
    """Token ids as they are, written as space-separated integers: megatron-core's (since Megatron-LM's April 2026
    change; before it, and in Megatron-DeepSpeed, `--vocab-size V` gave V + 1 ids with eod V). eod is the last id
    unless `eod_id` (`--null-tokenizer-eod-id`) says; `pad_id` (`--null-tokenizer-pad-id`, -1: none) is masked out
    of the loss by megatron-core's dataset."""

    def __init__(self, vocab_size: int, eod_id: int | None = None, pad_id: int = NO_PAD) -> None:
        if vocab_size < 2:
            raise DataError(f"--vocab-size {vocab_size}: the null tokenizer needs at least 2 ids")
        if eod_id is not None and not 0 <= eod_id < vocab_size:
            raise DataError(
                f"--null-tokenizer-eod-id {eod_id}: outside the tokenizer's ids [0, {vocab_size}); give an id below "
                "--vocab-size, or drop it for the last one"
            )
        if pad_id < NO_PAD:
            raise DataError(f"--null-tokenizer-pad-id {pad_id}: give -1 (no padding token) or an id >= 0")
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1 if eod_id is None else eod_id
        self.pad = pad_id
        self.unique_identifiers = OrderedDict([("class", type(self).__name__), ("vocab_size", vocab_size)])
        if (self.eod, self.pad) != (vocab_size - 1, NO_PAD):  # new keys only where they change the samples
            self.unique_identifiers.update(eod_id=self.eod, pad_id=self.pad)

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            raise DataError(f"NullTokenizer: {text[:40]!r} is not space-separated integers") from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise DataError(f"NullTokenizer: id {bad[0]} is outside [0, {self.vocab_size}); raise --vocab-size")
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(
    tokenizer_type: str | None,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    vocab_size: int | None = None,
    null_eod_id: int | None = None,
    null_pad_id: int = NO_PAD,
) -> Tokenizer:
    """The tokenizer named by `--tokenizer-type`; `vocab_size`, `null_eod_id` and `null_pad_id` are only for
    `NullTokenizer`, and `tokenizer_model` is HuggingFaceTokenizer's (or HFTokenizer's) directory."""
    kind = _ALIASES.get(tokenizer_type or "", tokenizer_type)
    if kind in ("SentencePieceTokenizer", "Llama2Tokenizer"):
        if not tokenizer_model:
            raise DataError(
                f"--tokenizer-model is required with --tokenizer-type {kind}; train one with tools/train_tokenizer.py"
            )
        return (Llama2Tokenizer if kind == "Llama2Tokenizer" else SentencePieceTokenizer)(tokenizer_model)
    if kind == "GPT2BPETokenizer":
        for flag, value in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not value:
                raise DataError(f"{flag} is required with --tokenizer-type GPT2BPETokenizer")
        return GPT2BPETokenizer(vocab_file, merge_file)  # type: ignore[arg-type]
    if kind == "NullTokenizer":
        if vocab_size is None:
            raise DataError("--vocab-size is required with --tokenizer-type NullTokenizer")
        return NullTokenizer(vocab_size, null_eod_id, null_pad_id)
    if kind == "HuggingFaceTokenizer":
        from megatron_ds.data.huggingface_tokenizer import HuggingFaceTokenizer

        return HuggingFaceTokenizer(tokenizer_model)
    if kind == "HFTokenizer":
        from megatron_ds.data.huggingface_tokenizer import MegatronDeepSpeedHFTokenizer

        return MegatronDeepSpeedHFTokenizer(tokenizer_model)
    raise DataError(f"--tokenizer-type {tokenizer_type}: unknown; choose one of {', '.join(TOKENIZER_TYPES)}")


def check_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    """The embedding must have a row for every token id the tokenizer can produce."""
    if tokenizer.vocab_size > vocab_size:
        source = (
            getattr(tokenizer, "model_file", None) or getattr(tokenizer, "vocab_file", None) or type(tokenizer).__name__
        )
        raise DataError(
            f"tokenizer model {source} has {tokenizer.vocab_size} tokens but "
            f"--vocab-size is {vocab_size}; raise --vocab-size to at least "
            f"{tokenizer.vocab_size} or use a smaller tokenizer"
        )
