"""The built-in demo corpus and `prepare_demo_data`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megatron_ds.data import DataError
from megatron_ds.data.demo_corpus import demo_documents, prepare_demo_data, write_demo_corpus
from megatron_ds.data.indexed import read_tokens
from megatron_ds.data.tokenizer import build_tokenizer


def test_corpus_is_deterministic_jsonl(tmp_path: Path) -> None:
    n = write_demo_corpus(str(tmp_path / "a.jsonl"))
    write_demo_corpus(str(tmp_path / "b.jsonl"))
    a = (tmp_path / "a.jsonl").read_bytes()
    assert a == (tmp_path / "b.jsonl").read_bytes()
    assert 300_000 < len(a) < 2_500_000 and n > 500
    docs = [json.loads(line) for line in a.decode().splitlines()]
    assert len(docs) == n and all(list(d) == ["text"] and d["text"] for d in docs)
    assert len(list(demo_documents(max_bytes=10_000))) < 50


def test_prepare_demo_data(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    demo = prepare_demo_data(str(out), vocab_size=256, quiet=True)
    assert demo.tokenizer_model == str(out / "demo.model")
    assert demo.data_prefix == str(out / "demo_text_document")
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=demo.tokenizer_model)
    assert tok.vocab_size == 256
    texts = [json.loads(line)["text"] for line in (out / "demo_corpus.jsonl").read_text().splitlines()]
    docs = read_tokens(demo.data_prefix)
    assert len(docs) == len(texts)
    for text, ids in list(zip(texts, docs))[:50]:  # what tools/preprocess_data.py --append-eod wrote
        assert ids.tolist() == tok.tokenize(text) + [tok.eod]

    stamps = {p: os.path.getmtime(out / p) for p in os.listdir(out)}
    prepare_demo_data(str(out), vocab_size=256, quiet=True)  # everything valid: nothing rewritten
    assert {p: os.path.getmtime(out / p) for p in os.listdir(out)} == stamps

    bin_path = out / "demo_text_document.bin"
    bin_path.write_bytes(bin_path.read_bytes()[:-10])  # truncated: the data is rebuilt
    prepare_demo_data(str(out), vocab_size=256, quiet=True)
    assert [d.tolist() for d in read_tokens(demo.data_prefix)] == [d.tolist() for d in docs]
    assert os.path.getmtime(out / "demo.model") == stamps["demo.model"]

    prepare_demo_data(str(out), vocab_size=300, quiet=True)  # new vocabulary: retrain + rebuild
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=demo.tokenizer_model)
    assert tok.vocab_size == 300
    assert read_tokens(demo.data_prefix)[0].tolist() == tok.tokenize(texts[0]) + [tok.eod]


def test_prepare_demo_data_reports_tool_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="--vocab-size 100000"):
        prepare_demo_data(str(tmp_path), vocab_size=100_000, max_bytes=20_000, quiet=True)
