"""Train a SentencePiece tokenizer from JSONL or text files.

    python tools/train_tokenizer.py --input corpus.jsonl --model-prefix data/tok --vocab-size 8000

Writes `<model-prefix>.model`. Ids: 0 `<unk>`, 1 `<s>`, 2 `</s>` (the end-of-document token that
`tools/preprocess_data.py --append-eod` appends), 3 `<pad>`. Input formats are those of
`tools/preprocess_data.py` (JSONL, or `.txt` with blank-line separated documents); training
sentences are the non-blank lines of the documents. Bad input: one `error:` line, exit code 2 (as pretrain_gpt.py and the other tools).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator, Sequence

try:
    import megatron_ds  # noqa: F401
except ImportError:  # run from a source checkout without installing the package
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_ds import files
from megatron_ds.data import DataError
from megatron_ds.data.documents import check_input_file, read_documents
from megatron_ds.data.tokenizer import SentencePieceTokenizer
from megatron_ds.data.tokenizer_training import train_sentencepiece
from megatron_ds.errors import OneLineArgumentParser, UserError, stop_cleanly_on_sigterm, tool_main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = OneLineArgumentParser(description=__doc__.splitlines()[0], command="python tools/train_tokenizer.py")
    p.add_argument("--input", nargs="+", required=True, help="JSONL or .txt files")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSON fields holding text")
    p.add_argument("--model-prefix", required=True, help="writes <prefix>.model")
    p.add_argument("--vocab-size", type=int, required=True, help="number of pieces")
    p.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    p.add_argument(
        "--character-coverage",
        type=float,
        default=1.0,
        help="fraction of characters covered; 0.9995 for large CJK alphabets",
    )
    p.add_argument("--input-sentence-size", type=int, default=0, help="sample at most this many lines (0: use all)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the line sampling")
    p.add_argument("--num-threads", type=int, default=os.cpu_count() or 1)
    p.add_argument(
        "--byte-fallback", action="store_true", help="spell unknown characters as bytes (needs vocab-size > 260)"
    )
    p.add_argument(
        "--collapse-whitespace",
        action="store_true",
        help="sentencepiece's default normalisation: runs of spaces and newlines "
        "become one space (by default they are kept)",
    )
    return p.parse_args(argv)


def training_lines(paths: Sequence[str], json_keys: Sequence[str]) -> Iterator[str]:
    """Non-blank lines of every document field, in file order."""
    for path in paths:
        for doc in read_documents(path, json_keys):
            for text in doc.values():
                yield from (line for line in text.split("\n") if line.strip())


def run(args: argparse.Namespace) -> str:
    """Train and return the model path; raises DataError on bad input."""
    t0 = time.time()
    for path in args.input:
        check_input_file(path)
    replaced = os.path.exists(args.model_prefix + ".model")
    if args.vocab_size < 8:
        raise DataError(f"--vocab-size {args.vocab_size}: too small; use at least 8")
    model = [args.model_prefix + ".model"]  # checked before the training, not after it
    files.check_output_prefix("--model-prefix", args.model_prefix, model, DataError, inputs=args.input)
    num_lines = 0

    def counted() -> Iterator[str]:
        nonlocal num_lines
        for line in training_lines(args.input, args.json_keys):
            num_lines += 1
            yield line

    path = train_sentencepiece(
        counted(),
        args.model_prefix,
        args.vocab_size,
        model_type=args.model_type,
        character_coverage=args.character_coverage,
        input_sentence_size=args.input_sentence_size,
        seed=args.seed,
        num_threads=args.num_threads,
        keep_whitespace=not args.collapse_whitespace,
        byte_fallback=args.byte_fallback,
    )
    tok = SentencePieceTokenizer(path)
    if replaced:
        print(f"NOTICE: replaced the model that was at {path}; data tokenized with it no longer matches this one")
    print(
        f"trained {args.model_type} tokenizer {path}: {tok.vocab_size} pieces, eod id {tok.eod} "
        f"(</s>), pad id {tok.pad}, from {num_lines} lines of {len(args.input)} file(s) in "
        f"{time.time() - t0:.1f} s"
    )
    return path


def main(argv: Sequence[str] | None = None) -> int:
    return tool_main(lambda: run(parse_args(argv)), (UserError, OSError))


if __name__ == "__main__":
    stop_cleanly_on_sigterm()
    sys.exit(main())
