"""Tokenize documents into Megatron's `.bin/.idx` format (Megatron-LM compatible flags and files).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model data/tok.model --append-eod

writes `data/corpus_text_document.bin/.idx` (`{prefix}_{key}_document` for each `--json-keys` key),
which `--data-path data/corpus_text_document` reads. Input: JSONL (one `{"text": ...}` object per
line) or `.txt`, where documents are separated by blank lines. Documents keep their input order
for any `--workers`; an empty document is recorded in the `.idx` as both upstreams' tools record it (a
document boundary without tokens; no sample reads it). Progress goes to stderr, one summary line to
stdout. Bad input: one `error:` line naming the file (and line), exit code 2 (as pretrain_gpt.py and the other tools).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

try:
    import megatron_ds  # noqa: F401
except ImportError:  # run from a source checkout without installing the package
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_ds import files
from megatron_ds.data import DataError
from megatron_ds.data.documents import check_input_file, sized_documents
from megatron_ds.data.indexed import IndexedWriter
from megatron_ds.data.tokenizer import TOKENIZER_TYPES, Tokenizer, build_tokenizer
from megatron_ds.errors import OneLineArgumentParser, UserError, stop_cleanly_on_sigterm, tool_main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = OneLineArgumentParser(description=__doc__.splitlines()[0], command="python tools/preprocess_data.py")
    g = p.add_argument_group("input")
    g.add_argument("--input", nargs="+", required=True, help="JSONL or .txt files")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="JSON fields to tokenize")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, help=f"one of {', '.join(TOKENIZER_TYPES)}")
    g.add_argument("--tokenizer-model", help="SentencePiece model file")
    g.add_argument("--vocab-file", help="GPT-2 vocab.json")
    g.add_argument("--merge-file", help="GPT-2 merges.txt")
    g.add_argument("--vocab-size", type=int, help="NullTokenizer only")
    g.add_argument("--append-eod", action="store_true", help="end every document with eod")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--log-interval", type=int, default=10000, help="documents between progress lines")
    return p.parse_args(argv)


def _make_tokenizer(args: argparse.Namespace) -> Tokenizer:
    return build_tokenizer(
        args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file, vocab_size=args.vocab_size
    )


def worker_pool(args: argparse.Namespace) -> Any:
    """`--workers` tokenizing processes (a multiprocessing Pool), or None for one: the tool tokenizes itself."""
    return multiprocessing.Pool(args.workers, initializer=Encoder(args).initializer) if args.workers > 1 else None


class Encoder:
    """Turns a `{key: text}` document into `{key: ids}`; one per worker process."""

    tokenizer: Tokenizer | None = None

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def initializer(self) -> None:
        # A forked worker inherits the tool's SIGTERM handler (`stop_cleanly_on_sigterm`), which raises there instead
        # of ending it: Pool.terminate() then waited for ever on a worker stuck in a lock (seen under load). Only the
        # parent cleans up, so a worker ends on SIGTERM and leaves Ctrl-C to the parent, which terminates it.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        Encoder.tokenizer = _make_tokenizer(self.args)

    def encode(self, sized: tuple[dict[str, str], int]) -> tuple[dict[str, list[int]], int]:
        """Token ids per key of a document; its size in the input file passes through (for the progress line)."""
        doc, num_bytes = sized
        tok = Encoder.tokenizer
        assert tok is not None, "initializer() runs first"
        out = {}
        for key, text in doc.items():
            ids = tok.tokenize(text)
            if ids and self.args.append_eod:  # as Megatron-LM: empty documents stay empty
                ids.append(tok.eod)
            out[key] = ids
        return out, num_bytes


def _documents(paths: Sequence[str], json_keys: Sequence[str]) -> Iterator[tuple[dict[str, str], int]]:
    return itertools.chain.from_iterable(sized_documents(p, json_keys) for p in paths)


def _encoded(
    args: argparse.Namespace, docs: Iterable[tuple[dict[str, str], int]], tokenizer: Tokenizer, pool: Any
) -> Iterator[tuple[dict[str, list[int]], int]]:
    encoder = Encoder(args)
    if pool is None:
        Encoder.tokenizer = tokenizer
        return map(encoder.encode, docs)
    return pool.imap(encoder.encode, docs, chunksize=32)  # imap keeps the input order


class Progress:
    """A plain-text progress line on stderr: redrawn on a terminal, one line per interval if not."""

    def __init__(self, total_bytes: int, interval: int) -> None:
        self.total_bytes = max(total_bytes, 1)
        self.interval = max(interval, 1)
        self.tty = sys.stderr.isatty()
        self.t0 = 0.0
        self.docs = self.tokens = self.bytes = 0

    def update(self, num_tokens: int, num_bytes: int) -> None:
        if self.docs == 0:  # the rate leaves out start-up (imports, worker processes)
            self.t0 = time.time()
        self.docs += 1
        self.tokens += num_tokens
        self.bytes += num_bytes
        if self.docs % self.interval == 0:
            self.draw()

    def draw(self, end: str = "", done: bool = False) -> None:
        frac = 1.0 if done else min(self.bytes / self.total_bytes, 1.0)
        bar = "#" * int(frac * 30)
        mb_s = self.bytes / 1e6 / max(time.time() - self.t0, 1e-9)
        line = f"[{bar:<30}] {frac:4.0%} {self.docs} docs {self.tokens} tokens {mb_s:.2f} MB/s"
        print(("\r" + line + end) if self.tty else line, file=sys.stderr, end="" if self.tty else "\n", flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Tokenize and write; return the per-key write stats. Raises DataError on bad input."""
    t0 = time.time()
    for path in args.input:
        check_input_file(path)
    if args.workers < 1:
        raise DataError(f"--workers {args.workers}: must be >= 1")
    if args.log_interval < 1:
        raise DataError(f"--log-interval {args.log_interval}: must be >= 1 (documents between progress lines)")
    outputs = [f"{args.output_prefix}_{key}_document{ext}" for key in args.json_keys for ext in (".bin", ".idx")]
    files.check_output_prefix("--output-prefix", args.output_prefix, outputs, DataError, inputs=args.input)
    tokenizer = _make_tokenizer(args)  # fails fast on a bad tokenizer, before any worker starts
    writers = {
        key: IndexedWriter(f"{args.output_prefix}_{key}_document", tokenizer.vocab_size) for key in args.json_keys
    }
    replaced = {  # as upstream's tool, an existing pair is replaced; the summary says so
        key for key in args.json_keys if os.path.exists(f"{args.output_prefix}_{key}_document.bin")
    }
    progress = Progress(sum(os.path.getsize(p) for p in args.input), args.log_interval)
    pool = worker_pool(args)
    try:
        for ids_by_key, num_bytes in _encoded(args, _documents(args.input, args.json_keys), tokenizer, pool):
            for key, ids in ids_by_key.items():
                writers[key].add(ids)
            progress.update(sum(len(i) for i in ids_by_key.values()), num_bytes)
        if not any(w.stats.num_tokens for w in writers.values()):  # an empty dataset fails only in training
            raise DataError(f"--input {' '.join(args.input)}: no documents (empty, or every one empty); give text")
        stats = {key: w.close() for key, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
    if progress.tty or progress.docs % progress.interval:  # the last line says 100%, once
        progress.draw(end="\n" if progress.tty else "", done=True)
    _summary(args, stats, time.time() - t0, replaced)
    return stats


def _summary(args: argparse.Namespace, stats: dict[str, Any], seconds: float, replaced: set[str]) -> None:
    for key, s in stats.items():
        empty = f" ({s.num_empty} empty, recorded as upstream's tools record them)" if s.num_empty else ""
        note = " (replacing the pair that was there)" if key in replaced else ""
        print(
            f"wrote {args.output_prefix}_{key}_document.bin/.idx{note}: {s.num_documents} documents{empty}, "
            f"{s.num_tokens} tokens in {seconds:.1f} s"
        )


def main(argv: Sequence[str] | None = None) -> int:
    return tool_main(lambda: run(parse_args(argv)), (UserError, OSError))


if __name__ == "__main__":
    stop_cleanly_on_sigterm()
    sys.exit(main())
