"""Tokenizers: SentencePiece training and loading, GPT-2 byte-level BPE, errors."""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm

from megatron_ds.data import DataError
from megatron_ds.data.demo_corpus import _load_tool
from megatron_ds.data.tokenizer import (
    GPT2BPETokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    _bytes_to_unicode,
    build_tokenizer,
    megatron_deepspeed_sentencepiece,
)
from megatron_ds.data.tokenizer_training import train_sentencepiece

REPO = Path(__file__).resolve().parents[2]
TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs!",
    "def add(a, b):\n    return a + b",
    "Numbers like 12345 and 678 appear in text; so do symbols: #, %, &.",
] * 20


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("sp")
    corpus = d / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXT))
    tool = _load_tool("train_tokenizer")
    code = tool.main(
        ["--input", str(corpus), "--model-prefix", str(d / "tok"), "--vocab-size", "200", "--num-threads", "1"]
    )
    assert code == 0
    return str(d / "tok.model")


def test_sentencepiece_ids_and_round_trip(sp_model: str) -> None:
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    assert (tok.vocab_size, tok.eod, tok.pad) == (200, 2, 3)
    text = "def add(a, b):\n    return a + b"
    ids = tok.tokenize(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.detokenize(ids) == text  # newlines and indentation survive
    assert tok.unique_identifiers["class"] == "SentencePieceTokenizer"
    again = pickle.loads(pickle.dumps(tok))  # DataLoader workers under spawn
    assert again.tokenize(text) == ids
    assert build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=sp_model).eod == 2


def test_train_tokenizer_is_deterministic(sp_model: str, tmp_path: Path) -> None:
    lines = [line for t in TEXT for line in t.split("\n")]
    path = train_sentencepiece(lines, str(tmp_path / "again"), 200, seed=1234)
    assert Path(path).read_bytes() == Path(sp_model).read_bytes()


def test_sentencepiece_errors(tmp_path: Path) -> None:
    with pytest.raises(
        DataError,
        match=r"--tokenizer-model /no/such.model: file not found; "
        r"train one with tools/train_tokenizer.py",
    ):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model="/no/such.model")
    junk = tmp_path / "junk.model"
    junk.write_text("not a model")
    with pytest.raises(DataError, match="not a SentencePiece model"):
        SentencePieceTokenizer(str(junk))
    with pytest.raises(DataError, match="--tokenizer-model is required"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(DataError, match="--tokenizer-type BertWordPiece: unknown"):
        build_tokenizer("BertWordPiece")


def test_sentencepiece_without_eos_is_rejected(tmp_path: Path) -> None:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT), model_writer=model, vocab_size=60, eos_id=-1, minloglevel=2
    )
    path = tmp_path / "noeos.model"
    path.write_bytes(model.getvalue())
    with pytest.raises(DataError, match="no end-of-document"):
        SentencePieceTokenizer(str(path))


def test_megatron_deepspeeds_sentencepiece_ids(sp_model: str, tmp_path: Path) -> None:
    """Megatron-DeepSpeed's SentencePieceTokenizer (its _SentencePieceTokenizer._initalize, checked against its
    tokenizer.py at 4efb479 on these models): <CLS>, <SEP>, <EOD>, <MASK> appended, and <PAD>/<BOS> where the model
    has no pad or bos piece; its eod is <EOD>."""
    assert megatron_deepspeed_sentencepiece(sp_model) == (204, 202, ["<CLS>", "<SEP>", "<EOD>", "<MASK>"])
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT), model_writer=model, vocab_size=60, bos_id=-1, minloglevel=2
    )
    path = tmp_path / "nopad.model"  # sentencepiece's defaults: no pad piece; and no bos
    path.write_bytes(model.getvalue())
    assert megatron_deepspeed_sentencepiece(str(path)) == (
        66,
        62,
        ["<CLS>", "<SEP>", "<EOD>", "<MASK>", "<PAD>", "<BOS>"],
    )


def test_tokenizer_notices_say_where_upstream_differs(sp_model: str) -> None:
    """A Megatron-DeepSpeed line with SentencePieceTokenizer is told its ids and eod; a --vocab-size beside a real
    tokenizer (kept here: imported models have more rows than their tokenizer) is told upstream's padded size."""
    from megatron_ds.flags.parser import parse_config
    from megatron_ds.training.resolve_layout import sentencepiece_notice, tokenizer_notices, vocab_size_notice

    base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --lr 1e-3 --train-iters 4"
    base += f" --mock-data --tokenizer-model {sp_model}"

    def config(extra: str):
        return parse_config([*base.split(), *extra.split()])[0]

    sp = config("--tokenizer-type SentencePieceTokenizer")
    assert sentencepiece_notice(sp) == (
        "NOTICE: --tokenizer-type SentencePieceTokenizer is Megatron-DeepSpeed's GPTSentencePieceTokenizer here: 200 "
        "ids, end-of-document 2 (the model's eos); its SentencePieceTokenizer adds <CLS>, <SEP>, <EOD>, <MASK>: 204 "
        "ids, end-of-document <EOD> 202, so data it preprocessed ends documents with 202, not an end-of-document "
        "here: preprocess the data again with tools/preprocess_data.py, or give --tokenizer-type "
        "GPTSentencePieceTokenizer (this tokenizer, without this notice)"
    )
    assert vocab_size_notice(sp) is None  # the tokenizer sizes the vocabulary, as upstream
    assert tokenizer_notices(config("--tokenizer-type GPTSentencePieceTokenizer")) == [None, None, None]
    assert sentencepiece_notice(config("--tokenizer-type SentencePieceTokenizer --data-upstream megatron-lm")) is None
    given = config("--tokenizer-type SentencePieceTokenizer --vocab-size 300")
    assert given.model.vocab_size == 384  # --vocab-size keeps sizing the model here
    assert vocab_size_notice(given) == (
        "NOTICE: --vocab-size 300 sizes the vocabulary here (384 rows), not --tokenizer-type SentencePieceTokenizer's "
        "200 tokens; Megatron-DeepSpeed ignores --vocab-size with a tokenizer and sizes it from the tokenizer: 204 "
        "tokens padded to 256 rows, not this model's 384; drop --vocab-size for upstream's model (keep it for an "
        "imported model whose embedding has more rows than its tokenizer)"
    )
    lm = vocab_size_notice(
        config("--tokenizer-type GPTSentencePieceTokenizer --vocab-size 250 --data-upstream megatron-lm")
    )
    assert (
        lm is not None
        and "Megatron-LM ignores --vocab-size with a tokenizer" in lm
        and "200 tokens padded to 256 rows;" in lm
    )
    assert vocab_size_notice(config("--tokenizer-type SentencePieceTokenizer --vocab-size 200")) is None


def test_train_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"--vocab-size 5000: .*lower --vocab-size"):
        train_sentencepiece(["tiny text"] * 3, str(tmp_path / "t"), 5000)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "fine"}\n{"text": oops}\n')
    tool = _load_tool("train_tokenizer")
    with pytest.raises(DataError, match=r"bad.jsonl:3: invalid JSON"):
        tool.run(tool.parse_args(["--input", str(bad), "--model-prefix", str(tmp_path / "m"), "--vocab-size", "50"]))


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"character_coverage": 5.0}, "--character-coverage 5: must be in [0.98, 1] (sentencepiece's range)"),
        ({"num_threads": 0}, "--num-threads 0: must be in [1, 1024] (sentencepiece's range)"),
        ({"input_sentence_size": -1}, "--input-sentence-size -1: must be >= 0 (sentencepiece's range)"),
        ({"byte_fallback": True}, "Increase vocab_size or decrease character_coverage"),
    ],
)
def test_train_errors_name_the_flag_at_fault(tmp_path: Path, options, needle) -> None:
    """Not "--vocab-size ...: could not train ()" for every sentencepiece failure; with --byte-fallback (260+
    pieces) a small vocabulary is to be raised, not lowered."""
    with pytest.raises(DataError) as err:
        train_sentencepiece(["the quick brown fox jumps"] * 20, str(tmp_path / "t"), 64, **options)
    assert needle in str(err.value) and "()" not in str(err.value), str(err.value)
    if options.get("byte_fallback"):
        assert str(err.value).endswith("; raise --vocab-size")
    with pytest.raises(DataError, match=r"^--input: no training text"):
        train_sentencepiece([], str(tmp_path / "t"), 64)


def test_train_tokenizer_cli_error(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "train_tokenizer.py"),
            "--input",
            str(tmp_path / "missing.jsonl"),
            "--model-prefix",
            str(tmp_path / "m"),
            "--vocab-size",
            "100",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: --input {tmp_path / 'missing.jsonl'}: file not found; fix the path"
    ]


def _tiny_gpt2_files(tmp_path: Path, extra_merges: tuple[str, ...] = ()) -> tuple[str, str]:
    """A byte-level vocabulary: all 256 byte symbols, a few merges, and <|endoftext|>."""
    symbols = list(_bytes_to_unicode().values())
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", *extra_merges]
    vocab = {s: i for i, s in enumerate(symbols)}
    for m in merges[:9]:
        vocab["".join(m.split(" "))] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")


def test_gpt2_bpe_tiny_vocab(tmp_path: Path) -> None:
    vocab_file, merge_file = _tiny_gpt2_files(tmp_path)
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    vocab = json.loads(Path(vocab_file).read_text())
    assert tok.vocab_size == len(vocab) == 256 + 9 + 1
    assert tok.eod == vocab["<|endoftext|>"] and tok.pad == -1
    assert tok.tokenize("hello world") == [vocab["hello"], vocab["Ġworld"]]
    assert tok.tokenize("don't") == [vocab["d"], vocab["o"], vocab["n"], vocab["'"], vocab["t"]]
    for text in ("hello world", "héllo,  世界!\n\tdone_x 42", "don't stop"):
        assert tok.detokenize(tok.tokenize(text)) == text


def test_gpt2_bpe_errors(tmp_path: Path) -> None:
    vocab_file, merge_file = _tiny_gpt2_files(tmp_path, extra_merges=("w o",))
    tok = GPT2BPETokenizer(vocab_file, merge_file)
    with pytest.raises(DataError, match="piece 'wo' .* is not in the vocabulary"):
        tok.tokenize("two")
    with pytest.raises(DataError, match="--merge-file is required"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file)
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(DataError, match="--vocab-file .*bad.json: expected a JSON object"):
        GPT2BPETokenizer(str(tmp_path / "bad.json"), merge_file)
    (tmp_path / "m2.txt").write_text("#version: 0.2\na b\nc d e\n")
    with pytest.raises(DataError, match=r"m2.txt:3: expected two"):
        GPT2BPETokenizer(vocab_file, str(tmp_path / "m2.txt"))
    vocab = json.loads(Path(vocab_file).read_text())
    del vocab["<|endoftext|>"]
    (tmp_path / "v2.json").write_text(json.dumps(vocab))
    with pytest.raises(DataError, match="no '<\\|endoftext\\|>' token"):
        GPT2BPETokenizer(str(tmp_path / "v2.json"), merge_file)


def test_null_tokenizer() -> None:
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert (tok.vocab_size, tok.eod, tok.pad) == (100, 99, -1)
    assert tok.tokenize("1 2 3") == [1, 2, 3] and tok.detokenize([4, 5]) == "4 5"
    with pytest.raises(DataError, match="outside"):
        NullTokenizer(10).tokenize("11")
    with pytest.raises(DataError, match="--vocab-size is required"):
        build_tokenizer("NullTokenizer")


def test_llama2_tokenizer_is_megatron_lms_bos_before_each_text(sp_model: str) -> None:
    """Megatron-LM's `_Llama2Tokenizer`: the SentencePiece model's ids (eod its eos, pad its pad) and `tokenize` with its
    default bos=True, eos=False, so preprocessed documents are bos, text (and eos with --append-eod) as upstream's."""
    llama, plain = (build_tokenizer(t, tokenizer_model=sp_model) for t in ("Llama2Tokenizer", "SentencePieceTokenizer"))
    assert (llama.vocab_size, llama.eod, llama.pad, llama.bos) == (plain.vocab_size, plain.eod, plain.pad, 1)
    text = "Pack my box with five dozen liquor jugs!"
    assert (
        llama.tokenize(text)
        == [1, *plain.tokenize(text)]
        == [1, *spm.SentencePieceProcessor(model_file=sp_model).encode(text)]
    )
    assert llama.detokenize(llama.tokenize(text)) == text  # decode drops the bos piece
    assert pickle.loads(pickle.dumps(llama)).tokenize(text) == llama.tokenize(text)
    with pytest.raises(DataError, match="--tokenizer-model is required with --tokenizer-type Llama2Tokenizer"):
        build_tokenizer("Llama2Tokenizer")
