"""`.bin/.idx` writing (tools/preprocess_data.py) and validation."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_ds.data import DataError
from megatron_ds.data.demo_corpus import _load_tool
from megatron_ds.data.documents import read_documents, sized_documents
from megatron_ds.data.indexed import (
    HEADER_BYTES,
    INDEX_HEADER,
    TOKEN_DTYPES,
    load_indexed_dataset,
    read_index,
    read_tokens,
    write_indexed_dataset,
)
from megatron_ds.data.tokenizer import _bytes_to_unicode, build_tokenizer

REPO = Path(__file__).resolve().parents[2]
DOCS = [f"Document {i}: " + " ".join(f"word{j % 13} and more text" for j in range(i % 7 + 1)) for i in range(40)]
DOCS[5] = ""  # recorded in the .idx as upstream's tools record it; no sample reads it


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(JSONL corpus, SentencePiece model trained on it)."""
    d = tmp_path_factory.mktemp("indexed")
    path = d / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(DOCS)))
    tool = _load_tool("train_tokenizer")
    assert (
        tool.main(["--input", str(path), "--model-prefix", str(d / "tok"), "--vocab-size", "120", "--num-threads", "1"])
        == 0
    )
    return path, str(d / "tok.model")


def _preprocess(argv: list[str]) -> int:
    return _load_tool("preprocess_data").main(argv)


def test_format_constants_match_megatron_core() -> None:
    from megatron.core.datasets import indexed_dataset as mc

    assert INDEX_HEADER == mc._INDEX_HEADER
    for code, dtype in TOKEN_DTYPES.items():
        assert mc.DType.dtype_from_code(code) is dtype


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("append_eod", [False, True])
def test_preprocess_round_trip(corpus: tuple[Path, str], tmp_path: Path, workers: int, append_eod: bool) -> None:
    path, model = corpus
    prefix = tmp_path / "out"
    argv = [
        "--input",
        str(path),
        "--output-prefix",
        str(prefix),
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        model,
        "--workers",
        str(workers),
    ]
    assert _preprocess(argv + (["--append-eod"] if append_eod else [])) == 0
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    expected = [tok.tokenize(t) + ([tok.eod] if append_eod else []) for t in DOCS if t]
    got = read_tokens(f"{prefix}_text_document")
    assert [g.tolist() for g in got] == expected
    info = read_index(f"{prefix}_text_document")
    assert info.dtype is np.uint16 and info.num_documents == len(DOCS) and info.num_sequences == len(DOCS) - 1
    mc = load_indexed_dataset(f"{prefix}_text_document")  # megatron-core reads the same
    assert [mc[i].tolist() for i in range(len(mc))] == expected


def test_preprocess_txt_and_gpt2_and_keys(tmp_path: Path) -> None:
    vocab, merges = _tiny_gpt2_files(tmp_path)
    txt = tmp_path / "a.txt"
    txt.write_text("hello world\nsecond line\n\n\nhello again\n")
    argv = [
        "--input",
        str(txt),
        "--output-prefix",
        str(tmp_path / "g"),
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        vocab,
        "--merge-file",
        merges,
        "--append-eod",
    ]
    assert _preprocess(argv) == 0
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    got = [t.tolist() for t in read_tokens(str(tmp_path / "g_text_document"))]
    assert got == [tok.tokenize("hello world\nsecond line") + [tok.eod], tok.tokenize("hello again") + [tok.eod]]
    jsonl = tmp_path / "two.jsonl"
    jsonl.write_text(json.dumps({"title": "hello", "body": "world"}) + "\n")
    argv[1], argv[-1:] = str(jsonl), ["--json-keys", "title", "body"]
    assert _preprocess(argv) == 0
    assert read_tokens(str(tmp_path / "g_title_document"))[0].tolist() == tok.tokenize("hello")
    assert read_tokens(str(tmp_path / "g_body_document"))[0].tolist() == tok.tokenize("world")


@pytest.mark.parametrize("append_eod", [False, True])
def test_preprocess_records_empty_documents_as_upstream(tmp_path: Path, capsys, append_eod: bool) -> None:
    """Both upstreams' tools/preprocess_data.py call builder.add_document(ids, lens) for every document, an empty
    one with [] and []: a repeated document boundary. Ours skipped it, so the .idx (its document count and
    boundaries) differed; now both files are byte-identical to what their loop writes (Megatron-LM's counts each
    EOD in the lengths; an empty document gets none)."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    jsonl = tmp_path / "in.jsonl"
    texts = ["1 2 3", "", "4 5", ""]
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    argv = ["--input", str(jsonl), "--output-prefix", str(tmp_path / "ours"), "--tokenizer-type", "NullTokenizer"]
    assert _preprocess([*argv, "--vocab-size", "1000", *(["--append-eod"] if append_eod else [])]) == 0
    assert "4 documents (2 empty, recorded as upstream's tools record them), " in capsys.readouterr().out
    tok = build_tokenizer("NullTokenizer", vocab_size=1000)
    builder = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=DType.optimal_dtype(tok.vocab_size))
    for text in texts:  # upstream's encode() and its write loop
        ids = tok.tokenize(text)
        lens = [len(ids)] if ids else []
        if ids and append_eod:
            ids, lens = [*ids, tok.eod], [lens[0] + 1]
        builder.add_document(np.asarray(ids, dtype=np.int64), lens)
    builder.finalize(str(tmp_path / "ref.idx"))
    for ext in ("bin", "idx"):
        assert (tmp_path / f"ours_text_document.{ext}").read_bytes() == (tmp_path / f"ref.{ext}").read_bytes(), ext
    info = read_index(str(tmp_path / "ours_text_document"))
    assert (info.num_documents, info.num_sequences) == (4, 2)
    assert info.document_indices.tolist() == [0, 1, 1, 2, 2]


def _tiny_gpt2_files(tmp_path: Path) -> tuple[str, str]:
    """All 256 byte symbols plus two merges and <|endoftext|>."""
    vocab = {s: i for i, s in enumerate(_bytes_to_unicode().values())}
    vocab.update({"he": 256, "hel": 257, "<|endoftext|>": 258})
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\nh e\nhe l\n")
    return str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")


def test_read_documents_errors(tmp_path: Path) -> None:
    p = tmp_path / "c.jsonl"
    p.write_text('{"text": "a"}\n\n{"body": "b"}\n')
    with pytest.raises(DataError, match=r"c.jsonl:3: no key 'text' \(keys: body\); pass --json-keys"):
        list(read_documents(str(p)))
    p.write_text('{"text": 3}\n')
    with pytest.raises(DataError, match=r"c.jsonl:1: key 'text' holds int"):
        list(read_documents(str(p)))
    with pytest.raises(DataError, match="--input /nope.jsonl: file not found"):
        list(read_documents("/nope.jsonl"))


def test_sized_documents_add_up_to_the_file(tmp_path: Path) -> None:
    """Each document's bytes of the input (its lines, the blank lines before it) sum to the file's size but for
    trailing blank lines: the progress line's fraction (it stopped at 88% on JSONL, counting only the text)."""
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text('{"text": "caf\u00e9", "id": 1}\n\n{"text": "b\\nc", "id": 2}\n\n', encoding="utf-8")
    txt = tmp_path / "c.txt"
    txt.write_text("one\ntwo\n\n\nthré\n", encoding="utf-8")
    for path, docs, trailing in ((jsonl, ["café", "b\nc"], 1), (txt, ["one\ntwo", "thré"], 0)):
        sized = list(sized_documents(str(path)))
        assert [d["text"] for d, _ in sized] == docs == [d["text"] for d in read_documents(str(path))]
        assert sum(n for _, n in sized) == path.stat().st_size - trailing


def test_preprocess_progress_ends_at_100_percent(corpus: tuple[Path, str], tmp_path: Path, capsys) -> None:
    path, model = corpus
    argv = ["--input", str(path), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type"]
    argv += ["SentencePieceTokenizer", "--tokenizer-model", model, "--log-interval", "7"]
    assert _preprocess(argv) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == len(DOCS) // 7 + 1  # one per 7 documents, then the last one
    assert " 100% 40 docs " in lines[-1] and all("%" in line for line in lines)
    assert int(lines[-2].split("%")[0].split()[-1]) < 100


def _write(prefix: Path, docs: list[list[int]], vocab_size: int = 1000) -> str:
    write_indexed_dataset(str(prefix), docs, vocab_size)
    return str(prefix)


def test_writer_dtype_and_atomicity(tmp_path: Path) -> None:
    big = _write(tmp_path / "big", [[70000, 1]], vocab_size=70001)
    assert read_index(big).dtype is np.int32
    with pytest.raises(DataError, match="token id 5 outside"):
        write_indexed_dataset(str(tmp_path / "bad"), [[1, 2], [5]], vocab_size=5)
    assert sorted(os.listdir(tmp_path)) == ["big.bin", "big.idx"]  # no partial files left
    (tmp_path / "half.idx").mkdir()  # a directory in the way of one of the pair: neither is written
    with pytest.raises(DataError, match=r"half\.idx: is a directory; remove it or give another --output-prefix"):
        write_indexed_dataset(str(tmp_path / "half"), [[1, 2]], vocab_size=5)
    assert sorted(os.listdir(tmp_path)) == ["big.bin", "big.idx", "half.idx"]


def test_preprocess_says_it_replaced_a_pair(corpus: tuple[Path, str], tmp_path: Path, capsys) -> None:
    path, model = corpus
    argv = ["--input", str(path), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type"]
    argv += ["SentencePieceTokenizer", "--tokenizer-model", model]
    assert _preprocess(argv) == 0
    assert "(replacing" not in capsys.readouterr().out
    assert _preprocess(argv) == 0  # as upstream's tool, it replaces the pair, and says so
    assert f"wrote {tmp_path / 'out'}_text_document.bin/.idx (replacing the pair that was there):" in (
        capsys.readouterr().out
    )
    assert _preprocess([*argv[:1], str(tmp_path), *argv[2:]]) == 2
    assert capsys.readouterr().err.strip() == f"error: --input {tmp_path}: a directory; give a file"


@pytest.mark.parametrize(
    "damage, message",
    [
        ("bin_short", r"\.bin: truncated \(\d+ tokens, but .*\.idx describes \d+ tokens in 3 documents\)"),
        (
            "bin_long",
            r"\.bin holds 7 tokens but its index .*\.idx describes 6 tokens in 3 documents: 1 more, not one per document \(3\)",
        ),
        ("idx_short", r"\.idx: truncated or corrupt \(header says 3 sequences"),
        ("idx_tiny", r"\.idx: truncated \(10 bytes"),
        ("magic", r"\.idx: bad magic header"),
        ("legacy", r"\.idx: a legacy \(lazy/cached\) index, not the mmap format read here"),
        ("version", r"\.idx: index version 7 is not supported"),
        ("dtype", r"\.idx: dtype code 6 is not a token dtype"),
        ("offsets", r"\.idx: corrupt \(sequence offsets"),
        ("no_bin", r"\.bin not found"),
    ],
)
def test_validation_errors(tmp_path: Path, damage: str, message: str) -> None:
    prefix = _write(tmp_path / "d", [[1, 2, 3], [4, 5], [6]])
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    raw = bytearray(idx.read_bytes())
    if damage == "bin_short":
        bin_.write_bytes(bin_.read_bytes()[:-2])
    elif damage == "bin_long":
        bin_.write_bytes(bin_.read_bytes() + b"\0\0")
    elif damage == "idx_short":
        idx.write_bytes(raw[:-4])
    elif damage == "idx_tiny":
        idx.write_bytes(raw[:10])
    elif damage == "magic":
        idx.write_bytes(b"XXXXXXXXX" + raw[9:])
    elif damage == "legacy":  # Megatron-DeepSpeed's IndexedDataset header (`--data-impl lazy/cached`)
        idx.write_bytes(b"TNTIDX\x00\x00" + raw[8:])
    elif damage == "version":
        idx.write_bytes(raw[:9] + struct.pack("<Q", 7) + raw[17:])
    elif damage == "dtype":
        idx.write_bytes(raw[:17] + bytes([6]) + raw[18:])
    elif damage == "offsets":
        raw[HEADER_BYTES + 12 + 8 : HEADER_BYTES + 12 + 16] = struct.pack("<q", 4)
        idx.write_bytes(raw)
    elif damage == "no_bin":
        bin_.unlink()
    with pytest.raises(DataError, match=message) as err:
        load_indexed_dataset(prefix)  # checked before megatron-core maps anything
    assert "\n" not in str(err.value)
    assert damage == "no_bin" or "re-run tools/preprocess_data.py" in str(err.value)


def test_missing_prefix(tmp_path: Path) -> None:
    with pytest.raises(
        DataError,
        match=r"--data-path .*/nothing: no .*nothing.bin/.idx found; "
        r"give the prefix without the extension",
    ):
        read_index(str(tmp_path / "nothing"))


def test_preprocess_cli_errors(corpus: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Exit code 2, one `error:` line, no traceback, no partial output files: the process's own for a missing input
    (what a shell sees), in process for inputs that fail part-way (their error comes after the tool's imports)."""
    _, model = corpus
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": broken\n')
    no_key = tmp_path / "nokey.jsonl"
    no_key.write_text('{"body": "x"}\n')

    def argv(path: str, i: int) -> list[str]:
        out = ["--output-prefix", str(tmp_path / f"out{i}"), "--tokenizer-type", "SentencePieceTokenizer"]
        return ["--input", path, *out, "--tokenizer-model", model]

    missing = str(tmp_path / "missing.jsonl")
    run = subprocess.run(
        [sys.executable, str(REPO / "tools" / "preprocess_data.py"), *argv(missing, 0)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("error: ") and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "file not found" in run.stderr and "Traceback" not in run.stderr
    for i, (path, expected) in enumerate(
        {str(bad_json): "bad.jsonl:3: invalid JSON", str(no_key): "nokey.jsonl:1: no key 'text'"}.items(), start=1
    ):
        assert _preprocess(argv(path, i)) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and expected in err, err
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]


def test_preprocess_bad_tokenizer_in_process(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    p = tmp_path / "c.jsonl"
    p.write_text('{"text": "x"}\n')
    code = _preprocess(
        [
            "--input",
            str(p),
            "--output-prefix",
            str(tmp_path / "o"),
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            str(tmp_path / "none.model"),
        ]
    )
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --tokenizer-model {tmp_path / 'none.model'}: file not found; train one with "
        f"tools/train_tokenizer.py or fix the path"
    )


@pytest.mark.parametrize(
    ("content", "extra", "needle"),
    [
        ("", [], "no documents (empty, or every one empty); give text"),
        ('{"text": ""}\n', [], "no documents (empty, or every one empty); give text"),
        ('{"text": "a b"}\n', ["--log-interval", "0"], "--log-interval 0: must be >= 1"),
        ("plain words\n", [], "invalid JSON (Expecting value, column 1); fix or drop the line (only a .txt file"),
    ],
)
def test_preprocess_refuses_what_would_fail_later(tmp_path: Path, capsys, content, extra, needle) -> None:
    """An empty dataset (which only training would trip on), a zero log interval (was taken as 1), and a
    plain-text file not named .txt (the error says which files are read as plain text)."""
    source = tmp_path / ("in.md" if content.startswith("plain") else "in.jsonl")
    source.write_text(content)
    argv = ["--input", str(source), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer"]
    assert _preprocess([*argv, "--vocab-size", "100", *extra]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err
    assert not list(tmp_path.glob("out*"))
