"""Train a SentencePiece model (what `tools/train_tokenizer.py` and the CPU demo run): sentencepiece's own ranges
checked first with messages naming the flag, its errors turned into one line, the model written atomically."""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterable, Iterator
from typing import Any

from megatron_ds.data import DataError


def train_sentencepiece(
    sentences: Iterable[str],
    model_prefix: str,
    vocab_size: int,
    model_type: str = "bpe",
    character_coverage: float = 1.0,
    input_sentence_size: int = 0,
    seed: int = 1234,
    num_threads: int = 1,
    keep_whitespace: bool = True,
    byte_fallback: bool = False,
) -> str:
    """Train a SentencePiece model on `sentences` (lines of text); return `<model_prefix>.model`.

    Ids: 0 `<unk>`, 1 `<s>`, 2 `</s>` (end of document), 3 `<pad>`. With `keep_whitespace`
    newlines and runs of spaces survive a tokenize/detokenize round trip (code, docstrings).
    """
    import sentencepiece as spm

    if model_type not in ("bpe", "unigram", "char", "word"):
        raise DataError(f"--model-type {model_type}: unknown; choose bpe or unigram")
    for flag, value, low, high in (  # sentencepiece's own ranges, checked first for a message naming the flag
        ("--vocab-size", vocab_size, 1, math.inf),
        ("--character-coverage", character_coverage, 0.98, 1.0),
        ("--num-threads", num_threads, 1, 1024),
        ("--input-sentence-size", input_sentence_size, 0, math.inf),
    ):
        if not low <= value <= high:
            span = f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
            raise DataError(f"{flag} {value:g}: must be {span} (sentencepiece's range)")
    out_dir = os.path.dirname(os.path.abspath(model_prefix))
    os.makedirs(out_dir, exist_ok=True)
    options: dict[str, Any] = dict(
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=input_sentence_size > 0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        num_threads=num_threads,
        byte_fallback=byte_fallback,
        minloglevel=2,
    )
    if keep_whitespace:
        # Training input is line based, so "\n" must be declared to exist as a piece.
        options.update(user_defined_symbols=["\n"], remove_extra_whitespaces=False)
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    failures: list[Exception] = []
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=_recording(sentences, failures), model_writer=model, **options)
    except RuntimeError as err:
        if failures:  # sentencepiece turns an error of the input iterator into a RuntimeError
            raise failures[0] from None
        first = str(err).splitlines()[0] if str(err) else ""
        reason = first.split("] ")[-1].strip() or first.split("[")[-1].rstrip("] ")  # the message, else the check
        if "sentences_.empty()" in first:
            raise DataError("--input: no training text (empty input or every line blank); give text") from None
        advice = "raise --vocab-size" if "Increase vocab_size" in first else "lower --vocab-size or give more text"
        raise DataError(f"--vocab-size {vocab_size}: sentencepiece could not train ({reason}); {advice}") from None
    path = model_prefix + ".model"
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(model.getvalue())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # a crash never leaves a half-written model behind
    return path


def _recording(items: Iterable[str], failures: list[Exception]) -> Iterator[str]:
    try:
        yield from items
    except Exception as err:
        failures.append(err)
        raise
