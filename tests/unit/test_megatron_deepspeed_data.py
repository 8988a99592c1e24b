"""Megatron-DeepSpeed's preprocessed data as it is: its `--append-eod` files, its split, its sample order.

The references in tests/fixtures/megatron_deepspeed/ were made by Megatron-DeepSpeed's own code
(4efb479) on CPU and by megatron-core 0.16.1 as Megatron-LM drives it; its README and
make_fixtures.sh give the exact commands. Each `samples/<case>.json` holds the command line and
every training sample upstream's loader yielded, over two or more epochs.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from megatron_ds.data import DataError
from megatron_ds.data.batches import pipeline_batches
from megatron_ds.data.demo_corpus import _load_tool
from megatron_ds.data.gpt_data import build_gpt_datasets
from megatron_ds.data.indexed import read_index, read_tokens
from megatron_ds.data.splits import requested_samples
from megatron_ds.data.tokenizer import build_tokenizer
from megatron_ds.flags.parser import parse_config

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_deepspeed"
GPT2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(FIXTURE / "vocab.json")]
GPT2 += ["--merge-file", str(FIXTURE / "merges.txt")]
SP = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(FIXTURE / "sp.model")]
UPSTREAM_A = str(FIXTURE / "mds_gpt2_a_eod_text_document")
UPSTREAM_B = str(FIXTURE / "mds_gpt2_b_eod_text_document")


def _case(name: str) -> dict:
    return json.loads((FIXTURE / "samples" / f"{name}.json").read_text())


def _line(command: str, cache: Path) -> list[str]:
    """The fixture's command line on the committed files: the references were made over the pair our
    tool writes (each EOD counted); here the same line reads Megatron-DeepSpeed's own append-eod pair."""
    argv = command.replace("vocab.json", str(FIXTURE / "vocab.json")).replace("merges.txt", str(FIXTURE / "merges.txt"))
    argv = argv.replace("CACHE", str(cache)).split()
    names = {"gpt2_a_eod_text_document": UPSTREAM_A, "gpt2_b_eod_text_document": UPSTREAM_B}
    names["mds_gpt2_a_eod_text_document"] = UPSTREAM_A
    return [names.get(a, a) for a in argv]


def _samples(
    argv: list[str], first: int = 0, count: int | None = None, split: int = 0
) -> tuple[list[list[int]], object]:
    """Samples [first, first + count) of the training split (or of `split`), and that dataset."""
    config, _ = parse_config(argv, world_size=1)
    tok = build_tokenizer(
        config.data.tokenizer_type, vocab_file=config.data.vocab_file, merge_file=config.data.merge_file
    )
    with contextlib.redirect_stdout(io.StringIO()):
        train = build_gpt_datasets(
            config.data, config.model.seq_length, config.training.seed, requested_samples(config.training), tok, 384
        )[split]
    end = len(train) if count is None else first + count
    return [train[i]["tokens"].tolist() + [int(train[i]["labels"][-1])] for i in range(first, end)], train


def _preprocess(tmp_path: Path, corpus: str, tokenizer: list[str], *extra: str) -> str:
    out = tmp_path / f"{corpus}_{tokenizer[1]}"
    argv = ["--input", str(FIXTURE / f"{corpus}.jsonl"), "--output-prefix", str(out), *tokenizer, *extra]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert _load_tool("preprocess_data").main(argv) == 0
    return f"{out}_text_document"


@pytest.mark.parametrize(
    "corpus, tokenizer, upstream",
    [
        ("corpus_a", GPT2, UPSTREAM_A),
        ("corpus_b", GPT2, UPSTREAM_B),
        ("corpus_a", SP, str(FIXTURE / "mds_sp_a_eod_text_document")),
    ],
)
def test_upstream_append_eod_files_give_our_tokens(tmp_path: Path, corpus: str, tokenizer: list, upstream: str) -> None:
    """Same .bin, an .idx without the EODs: recognised, and read as our tool's documents."""
    ours = _preprocess(tmp_path, corpus, tokenizer, "--append-eod")
    assert Path(upstream + ".bin").read_bytes() == Path(ours + ".bin").read_bytes()
    assert Path(upstream + ".idx").read_bytes() != Path(ours + ".idx").read_bytes()
    tok = build_tokenizer(tokenizer[1], tokenizer_model=str(FIXTURE / "sp.model"), **_gpt2_files(tokenizer))
    info = read_index(upstream)
    assert info.eod_id == tok.eod and read_index(ours).eod_id is None
    assert [t.tolist() for t in read_tokens(upstream)] == [t.tolist() for t in read_tokens(ours)]
    from megatron_ds.data.corpus import open_corpus

    as_read = open_corpus(info, misaligned=False)
    assert [as_read[i].tolist() for i in range(len(as_read))] == [t.tolist() for t in read_tokens(ours)]
    again = pickle.loads(pickle.dumps(as_read))  # DataLoader workers under spawn read the same
    assert [again[i].tolist() for i in range(len(again))] == [as_read[i].tolist() for i in range(len(as_read))]
    misread = open_corpus(info, misaligned=True)  # Megatron-DeepSpeed's own view: document k starts k early
    assert misread[1].tolist() != as_read[1].tolist()[:-1] and misread[0].tolist() == as_read[0].tolist()[:-1]


def _gpt2_files(tokenizer: list) -> dict:
    if tokenizer is not GPT2:
        return {}
    return {"vocab_file": str(FIXTURE / "vocab.json"), "merge_file": str(FIXTURE / "merges.txt")}


def test_files_without_append_eod_are_byte_identical(tmp_path: Path) -> None:
    ours = _preprocess(tmp_path, "corpus_a", GPT2)
    for ext in (".bin", ".idx"):
        assert Path(ours + ext).read_bytes() == (FIXTURE / f"mds_gpt2_a_text_document{ext}").read_bytes()


def test_mismatched_pairs_say_which_file_disagrees(tmp_path: Path) -> None:
    shutil.copy(UPSTREAM_A + ".idx", tmp_path / "x.idx")
    shutil.copy(UPSTREAM_B + ".bin", tmp_path / "x.bin")  # another corpus's tokens: too few
    with pytest.raises(DataError, match=r"x\.bin: truncated \(577 tokens, but .*x\.idx describes 851 tokens in 75"):
        read_index(str(tmp_path / "x"))
    data = bytearray(Path(UPSTREAM_A + ".bin").read_bytes())
    (tmp_path / "x.bin").write_bytes(bytes(data) + b"\x01\x00" * 3)
    with pytest.raises(DataError, match=r"x\.bin holds 929 tokens but .* 78 more, not one per document \(75\)"):
        read_index(str(tmp_path / "x"))
    data[-2:] = b"\x05\x00"  # the last document's EOD replaced: not the append-eod layout
    (tmp_path / "x.bin").write_bytes(bytes(data))
    with pytest.raises(
        DataError,
        match=r"x\.bin holds 926 tokens but its index .*x\.idx describes 851 tokens in 75 documents: 75 more, one "
        r"per document, but the tokens after the documents are 2 different ids, so not Megatron-DeepSpeed's "
        r"--append-eod layout either; the \.bin and \.idx come from different runs",
    ) as err:
        read_index(str(tmp_path / "x"))
    assert "\n" not in str(err.value)


def test_an_empty_document_is_recorded_as_upstream_records_it(tmp_path: Path) -> None:
    """Corpus B has an empty document, which Megatron-DeepSpeed's tool records (a repeated boundary): the index
    tools/fix_append_eod_index.py writes of its append-eod pair is byte-identical to what our tool writes (ours
    skipped the empty document: 39 documents against 40)."""
    for ext in (".bin", ".idx"):
        shutil.copy(UPSTREAM_B + ext, tmp_path / f"up{ext}")
    with contextlib.redirect_stdout(io.StringIO()):
        assert _load_tool("fix_append_eod_index").main(["--input", str(tmp_path / "up")]) == 0
    ours = _preprocess(tmp_path, "corpus_b", GPT2, "--append-eod")
    assert (tmp_path / "up_eod.idx").read_bytes() == Path(ours + ".idx").read_bytes()
    assert read_index(ours).num_documents == read_index(UPSTREAM_B).num_documents == 40


def test_rewrite_index_once_next_to_the_original(tmp_path: Path) -> None:
    for ext in (".bin", ".idx"):
        shutil.copy(UPSTREAM_A + ext, tmp_path / f"up{ext}")
    before = {ext: (tmp_path / f"up{ext}").read_bytes() for ext in (".bin", ".idx")}
    tool = _load_tool("fix_append_eod_index")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert tool.main(["--input", str(tmp_path / "up")]) == 0
    assert "wrote" in out.getvalue() and f"--data-path {tmp_path / 'up'}_eod" in out.getvalue()
    ours = _preprocess(tmp_path, "corpus_a", GPT2, "--append-eod")
    assert (tmp_path / "up_eod.idx").read_bytes() == Path(ours + ".idx").read_bytes()
    assert os.path.samefile(tmp_path / "up_eod.bin", tmp_path / "up.bin")  # linked, not copied
    assert {ext: (tmp_path / f"up{ext}").read_bytes() for ext in (".bin", ".idx")} == before
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert tool.main(["--input", str(tmp_path / "up")]) == 2  # never over an existing file
        assert tool.main(["--input", str(tmp_path / "up_eod")]) == 2  # nothing to rewrite
        assert tool.main(["--input", str(tmp_path / "up"), "--output-prefix", ""]) == 2  # fell back to the default
        assert tool.main(["--input", str(tmp_path / "up"), "--output-prefix", f"{tmp_path}/"]) == 2
    assert "up_eod.idx exists; remove it or give a new prefix" in err.getvalue()
    assert "error: --output-prefix '': names no file; give a prefix such as data/corpus_eod" in err.getvalue()
    assert f"error: --output-prefix '{tmp_path}/': names no file" in err.getvalue()
    assert "already counts every token" in err.getvalue()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("up")) == [
        "up.bin",
        "up.idx",
        "up_eod.bin",
        "up_eod.idx",
    ]


CASES = sorted(p.stem for p in (FIXTURE / "samples").glob("*.json"))


@pytest.mark.parametrize("name", CASES)
def test_samples_equal_upstream(tmp_path: Path, name: str) -> None:
    """Every sample, in order, over two or more epochs; the other upstream's rules would differ."""
    case = _case(name)
    argv = _line(case["command"], tmp_path / "cache")
    if name.startswith("misaligned"):
        argv.append("--misaligned-append-eod")
    # (--mock-data alone leaves Megatron-DeepSpeed's rules, and our MockGPTData)
    if name in (
        "megatron_lm_split_98",
        "megatron_lm_split_paths_blend",
        "megatron_lm_split_paths_one_weight",
        "megatron_lm_mock",
    ):
        argv += ["--data-upstream", "megatron-lm"]
    if name == "megatron_lm_blend":
        argv += ["--rotary-base", "500000"]  # a Megatron-LM flag: --data-upstream auto picks megatron-lm
    first, ref = case["consumed_samples"], case["samples"]
    split = 1 if name.endswith("_valid") else 0  # upstream.py's MDS_SPLIT=valid: the validation split's samples
    got, train = _samples(argv, first, len(ref), split)
    assert got == ref
    if name.startswith("megatron_lm_split_paths"):  # core_samples.py reads every sample of the split
        assert len(train) == len(ref)
    elif name == "megatron_lm_mock":  # one epoch of its split's third of megatron-core's 100,000 documents
        assert len(train) > 2_000_000
    else:
        assert len(train) - len(ref) - first in (0, 1)  # upstream's loader drops an incomplete micro-batch pair
    if "split_paths" not in name and name != "split_949":  # 949,50,1 over 75 documents rounds alike in both
        other = "megatron-lm" if "megatron_lm" not in name else "megatron-deepspeed"
        argv = [a for a in argv if a != "500000" and a != "--rotary-base"] + ["--data-upstream", other]
        assert _samples(argv, first, 8)[0] != ref[:8]


def test_continuing_a_run_started_upstream(tmp_path: Path) -> None:
    """Consumed samples from an upstream checkpoint: each data-parallel rank's micro-batches from
    there are the samples upstream's loader yields after resuming at that count."""
    for name in ("resume", "misaligned_resume"):
        case = _case(name)
        argv = _line(case["command"], tmp_path / "cache") + (
            ["--misaligned-append-eod"] if "misaligned" in name else []
        )
        _, train = _samples(argv, 0, 0)
        ranks = [list(pipeline_batches(train, 1, d, 2, case["consumed_samples"], 0, seed=1234)) for d in range(2)]
        order = [row for step in zip(*ranks) for tokens, (labels, _) in step for row in _text(tokens, labels)]
        assert order == case["samples"][: len(order)] and len(order) >= len(case["samples"]) - 1


def _text(tokens, labels) -> list[list[int]]:
    return [t.tolist() + [int(lab[-1])] for t, lab in zip(tokens, labels)]


def test_show_samples_prints_the_training_order(tmp_path: Path) -> None:
    case = _case("split_98")
    argv = _line(case["command"], tmp_path / "cache")
    tool = _load_tool("show_samples")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert tool.main([*argv, "--num-samples", "5", "--consumed-samples", "3", "--json"]) == 0
    assert json.loads(out.getvalue()) == {"samples": case["samples"][3:8]}
    assert "document indices in [0, 73) total of 73 documents" in err.getvalue()  # the split report, on stderr
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert tool.main([*argv, "--num-samples", "1"]) == 0
    text = out.getvalue()
    assert f"sample 0: {' '.join(map(str, case['samples'][0]))}" in text and "  text: '" in text
    assert "Megatron-DeepSpeed's --append-eod layout" in text and "Let split_matrix" in text
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert tool.main([*argv, "--num-samples", "500"]) == 2
    assert err.getvalue().startswith("error: --consumed-samples 0 --num-samples 500: the training split has 56")


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"--seq-length": "0"}, "error: --seq-length 0 must be >= 1"),
        ({"--seq-length": "-4"}, "error: --seq-length -4 must be >= 1"),
        ({"--micro-batch-size": "0"}, "error: --micro-batch-size 0 must be >= 1"),
        (
            {"--micro-batch-size": "2", "--global-batch-size": "3"},
            "error: --global-batch-size 3 is not divisible by --micro-batch-size 2 x data-parallel size 1",
        ),
        ({"--split": "0,100,0"}, "error: --split 0,100,0 gives training no documents, but the run trains"),
    ],
)
def test_show_samples_refuses_what_the_training_launch_refuses(tmp_path: Path, change, needle) -> None:
    """Not a crash in the index builder, nor samples of a line pretrain_gpt.py would not run."""
    argv = _line(_case("split_98")["command"], tmp_path / "cache")
    for flag, value in change.items():
        argv = (
            [*argv[: argv.index(flag)], flag, value, *argv[argv.index(flag) + 2 :]]
            if flag in argv
            else [
                *argv,
                flag,
                value,
            ]
        )
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        assert _load_tool("show_samples").main([*argv, "--num-samples", "1"]) == 2
    assert err.getvalue().startswith(needle) and err.getvalue().count("\n") == 1, err.getvalue()
