"""A SentencePiece BPE model as a Hugging Face `tokenizer.json`, without protobuf.

transformers converts `tokenizer.model` itself only with the `protobuf` package installed, and
then assumes Llama's settings (byte fallback on, no normalisation). This builds the `tokenizers`
pipeline from what the model file says: its pieces and scores, its normaliser (the precompiled
character map, dummy prefix, whitespace handling), byte fallback and user-defined symbols. The
model file is a protobuf message; the few fields needed are read from its wire format here.

Known difference: SentencePiece adds the dummy prefix `▁` even before a leading space; the HF
`Metaspace` step does not, so text that begins with a space may tokenize differently.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

# SentencePiece's enums (sentencepiece_model.proto).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
BPE_MODEL = 2
SPACE = "\u2581"


@dataclass
class SentencePieceModel:
    pieces: list[tuple[str, float, int]] = field(default_factory=list)
    """(piece, score, type) in id order."""
    model_type: int = 1
    byte_fallback: bool = False
    charsmap: bytes = b""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def _fields(buf: bytes) -> Iterator[tuple[int, Any]]:
    """(field number, value) of a protobuf message: ints, or bytes for length-delimited fields."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = buf[i : i + 8], i + 8
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i : i + n], i + n
        elif wire == 5:
            value, i = buf[i : i + 4], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, value


def parse_model(data: bytes) -> SentencePieceModel:
    """The fields of a SentencePiece `ModelProto` this conversion needs."""
    model = SentencePieceModel()
    for number, value in _fields(data):
        if number == 1:
            piece, score, kind = "", 0.0, NORMAL
            for n, v in _fields(value):
                if n == 1:
                    piece = v.decode("utf-8")
                elif n == 2:
                    score = struct.unpack("<f", v)[0]
                elif n == 3:
                    kind = v
            model.pieces.append((piece, score, kind))
        elif number == 2:
            for n, v in _fields(value):
                if n == 3:
                    model.model_type = v
                elif n == 35:
                    model.byte_fallback = bool(v)
        elif number == 3:
            for n, v in _fields(value):
                if n == 2:
                    model.charsmap = v
                elif n == 3:
                    model.add_dummy_prefix = bool(v)
                elif n == 4:
                    model.remove_extra_whitespaces = bool(v)
    return model


def _merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    # BPE merges the adjacent pair whose merged piece ranks best (lowest id); ties by the parts' ids.
    merges = []
    for piece, rank in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((rank, vocab[left], vocab[right], left, right))
    return [(m[3], m[4]) for m in sorted(merges)]


def to_tokenizers_json(model: SentencePieceModel) -> str:
    """The `tokenizer.json` text for a BPE SentencePiece model."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    assert model.model_type == BPE_MODEL, model.model_type
    vocab = {piece: i for i, (piece, _, _) in enumerate(model.pieces)}
    unk = next((p for p, _, kind in model.pieces if kind == UNKNOWN), None)
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges(_mergeable(model)),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=model.byte_fallback,
        )
    )
    steps: list[Any] = [normalizers.Precompiled(model.charsmap)] if model.charsmap else []
    if model.remove_extra_whitespaces:
        steps += [normalizers.Strip(left=True, right=True), normalizers.Replace(Regex(" {2,}"), " ")]
    steps.append(normalizers.Replace(" ", SPACE))
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE, prepend_scheme="first" if model.add_dummy_prefix else "never", split=False
    )
    decode: list[Any] = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if model.add_dummy_prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(decode)
    tok.add_special_tokens(
        [AddedToken(p, special=True, normalized=False) for p, _, kind in model.pieces if kind in (CONTROL, UNKNOWN)]
    )
    tok.add_tokens(
        [AddedToken(p, special=False, normalized=False) for p, _, kind in model.pieces if kind == USER_DEFINED]
    )
    return tok.to_str()


def _mergeable(model: SentencePieceModel) -> dict[str, int]:
    # Only ordinary pieces take part in merges (not control, user-defined, byte or unused pieces).
    return {p: i for i, (p, _, kind) in enumerate(model.pieces) if kind == NORMAL}
