"""finetune_llama.py's prompt data (`data/prompt_data.py`), Megatron-DeepSpeed's HFTokenizer, the repeated loader
and the launch checks of `--prompt-data`. Upstream's own samples: test_prompt_data_upstream.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_ds.data import DataError
from megatron_ds.data.batches import pipeline_batches, samples_per_pass
from megatron_ds.data.prompt_data import (
    PROMPT_WITH_INPUT,
    PROMPT_WITHOUT_INPUT,
    PromptData,
    check_length,
    read_examples,
)
from megatron_ds.data.tokenizer import build_tokenizer
from megatron_ds.errors import UserError

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
GPT2 = ROOT / "tests" / "fixtures" / "megatron_deepspeed"
EXAMPLES = [
    {"instruction": "Name a colour.", "input": "", "output": "Blue."},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    {"instruction": "Say hi.", "output": "hi"},  # no "input" key: the template without input
]


def tokenizer_dir(tmp_path: Path, **config: str) -> Path:
    """A GPT-2 byte-level BPE directory (377 tokens, eos <|endoftext|>, no pad unless given)."""
    out = tmp_path / "tok"
    out.mkdir(exist_ok=True)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(GPT2 / name, out / name)
    eos = "<|endoftext|>"
    settings = {"tokenizer_class": "GPT2Tokenizer", "bos_token": eos, "eos_token": eos, "unk_token": eos, **config}
    (out / "tokenizer_config.json").write_text(json.dumps(settings))
    return out


def write_examples(tmp_path: Path, examples: object) -> str:
    path = tmp_path / "examples.json"
    path.write_text(json.dumps(examples))
    return str(path)


def test_hftokenizer_adds_a_pad_token_outside_the_base_vocabulary(tmp_path: Path) -> None:
    tok = build_tokenizer("HFTokenizer", tokenizer_model=str(tokenizer_dir(tmp_path)))
    assert (tok.vocab_size, tok.pad, tok.eod) == (377, 377, 376)  # [PAD] added after the 377 base tokens
    assert tok.hf_tokenizer.convert_ids_to_tokens(tok.pad) == "[PAD]" and len(tok.hf_tokenizer) == 378
    assert tok.detokenize(tok.tokenize("a cat")) == "a cat"
    # Megatron-LM's HuggingFaceTokenizer of the same directory counts the added tokens (none here) and has no pad
    core = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tokenizer_dir(tmp_path)))
    assert (core.vocab_size, core.pad) == (377, -1)


def test_hftokenizer_keeps_a_pad_token_the_directory_has(tmp_path: Path) -> None:
    tok = build_tokenizer("HFTokenizer", tokenizer_model=str(tokenizer_dir(tmp_path, pad_token="a")))
    assert (tok.vocab_size, tok.pad) == (377, tok.hf_tokenizer.convert_tokens_to_ids("a"))


def test_hftokenizer_names_itself_in_its_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="--tokenizer-model is required with --tokenizer-type HFTokenizer"):
        build_tokenizer("HFTokenizer")
    with pytest.raises(DataError, match="not a directory; HFTokenizer reads"):
        build_tokenizer("HFTokenizer", tokenizer_model=str(tmp_path / "missing"))


def test_examples_take_alpacas_templates(tmp_path: Path) -> None:
    pairs = read_examples(write_examples(tmp_path, EXAMPLES))
    assert pairs[0] == (PROMPT_WITHOUT_INPUT.format(instruction="Name a colour."), "Blue.")
    assert pairs[1] == (PROMPT_WITH_INPUT.format(instruction="Add the numbers.", input="2 and 3"), "5")
    assert pairs[2][0].endswith("### Instruction:\nSay hi.\n\n### Response:")
    assert pairs[1][0].endswith("### Input:\n2 and 3\n\n### Response:")


@pytest.mark.parametrize(
    ("examples", "says"),
    [
        ({"a": 1}, "expected a non-empty JSON list"),
        ([], "expected a non-empty JSON list"),
        ([EXAMPLES[0], "text"], "example 1 is a str, not an object"),
        ([{"instruction": "x"}], 'example 0 has no "output" string'),
        ([{"output": "x"}], 'example 0 has no "instruction" string'),
        ([{"instruction": "x", "input": 3, "output": "y"}], 'example 0: "input" is a int, not a string'),
    ],
)
def test_bad_examples_are_one_line_errors_naming_the_file(tmp_path: Path, examples: object, says: str) -> None:
    path = write_examples(tmp_path, examples)
    with pytest.raises(DataError, match=f"--data-path {path}") as err:
        read_examples(path)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file; finetune_llama.py reads a JSON list"):
        read_examples(str(tmp_path / "none.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    with pytest.raises(DataError, match=r"--data-path .*bad.json: not valid JSON \(.* at line 1\); fix the file"):
        read_examples(str(bad))


def test_the_prompt_is_masked_and_the_response_and_eos_are_trained(tmp_path: Path) -> None:
    tok = build_tokenizer("HFTokenizer", tokenizer_model=str(tokenizer_dir(tmp_path)))
    data = PromptData(write_examples(tmp_path, EXAMPLES), tok, 256, 384)
    hf = tok.hf_tokenizer
    for k, (prompt, output) in enumerate(read_examples(write_examples(tmp_path, EXAMPLES))):
        item = data[k]
        whole, alone = hf.encode(prompt + output + hf.eos_token), hf.encode(prompt)
        assert len(whole) < 257 and whole[: len(alone)] == alone  # nothing truncated; the prompt's ids lead
        trained = item["labels"][item["loss_mask"].bool()].tolist()
        assert trained == whole[len(alone) :]  # the response's ids, then eos
        assert trained[-1] == tok.eod and hf.decode(trained[:-1]) == output
        n = len(whole)
        assert item["tokens"][:n].tolist() == whole[:n] and item["tokens"][n:].eq(tok.pad).all()  # in range
        assert item["position_ids"].tolist() == list(range(256))
    assert data.untrained() == []


def test_a_pad_id_outside_the_model_is_fed_as_eos(tmp_path: Path) -> None:
    """The model of --make-vocab-size-divisible-by 1 has 377 rows; [PAD] is 377: the padding reads eos instead."""
    tok = build_tokenizer("HFTokenizer", tokenizer_model=str(tokenizer_dir(tmp_path)))
    outside = PromptData(write_examples(tmp_path, EXAMPLES), tok, 256, 377)
    inside = PromptData(write_examples(tmp_path, EXAMPLES), tok, 256, 384)
    for k in range(len(EXAMPLES)):
        a, b = outside[k], inside[k]
        padding = b["tokens"] == tok.pad
        assert padding.any() and torch.equal(a["tokens"][padding], torch.full_like(a["tokens"][padding], tok.eod))
        assert torch.equal(a["tokens"][~padding], b["tokens"][~padding])
        assert all(torch.equal(a[key], b[key]) for key in ("labels", "loss_mask"))
        assert int(a["tokens"].max()) < 377


def test_an_out_of_vocabulary_token_in_an_example_is_refused(tmp_path: Path) -> None:
    tok = build_tokenizer("HFTokenizer", tokenizer_model=str(tokenizer_dir(tmp_path)))
    path = write_examples(tmp_path, [*EXAMPLES, {"instruction": "Pad [PAD] here", "input": "", "output": "x"}])
    with pytest.raises(DataError, match=r"example 3 contains the pad token '\[PAD\]' \(id 377"):
        PromptData(path, tok, 256, 377)
    PromptData(path, tok, 256, 384)  # in the model's vocabulary, as upstream: masked only where it is a label


def test_a_prompt_longer_than_the_sequence_trains_nothing(tmp_path: Path) -> None:
    tok = build_tokenizer("HFTokenizer", tokenizer_model=str(tokenizer_dir(tmp_path)))
    data = PromptData(write_examples(tmp_path, EXAMPLES), tok, 32, 384)
    assert data.untrained() == [0, 1, 2] and all(not data[k]["loss_mask"].any() for k in range(3))
    assert all(not data[k]["tokens"].eq(tok.pad).any() for k in range(3))  # truncated: no padding


def test_samples_per_pass_and_the_length_check() -> None:
    assert samples_per_pass(13, 2, 1) == 12 and samples_per_pass(13, 2, 2) == 12 and samples_per_pass(13, 4, 2) == 8
    assert "(2.67 passes)" in check_length("x.json", 13, 12, 32, 4, repeated=True)
    with pytest.raises(DataError, match="gives 12 samples per pass, the run trains on 32; add --repeated-dataloader"):
        check_length("x.json", 13, 12, 32, 4, repeated=False)
    assert "lower --train-iters to 3" in _message(lambda: check_length("x.json", 13, 12, 32, 4, repeated=False))
    with pytest.raises(DataError, match="fewer than one micro-batch on every data-parallel rank"):
        check_length("x.json", 3, 0, 8, 4, repeated=True)


def _message(call) -> str:
    try:
        call()
    except DataError as err:
        return str(err)
    raise AssertionError("no error")


class Numbered(torch.utils.data.Dataset):
    """Sample i is [i]: the loader's order, readable."""

    def __len__(self) -> int:
        return 13

    def __getitem__(self, i: int) -> dict:
        return {"tokens": [i], "labels": [i], "loss_mask": [1.0]}


def order(dp_rank: int, dp_size: int, start: int, micro_batches: int) -> list[int]:
    batches = pipeline_batches(Numbered(), 2, dp_rank, dp_size, start, 0, 1234, repeat=True)
    return [int(t) for _ in range(micro_batches) for t in next(batches)[0][:, 0]]


def test_the_repeated_loader_wraps_after_whole_micro_batch_groups() -> None:
    # 13 samples in groups of 2: 0..11 each pass, the 13th (12) never read, as Megatron's sampler drops it
    assert order(0, 1, 0, 14) == [*range(12), *range(12), 0, 1, 2, 3]
    # two data-parallel ranks: groups of 4, each rank its half; 12 per pass
    assert order(0, 2, 0, 8) == [0, 1, 4, 5, 8, 9, 0, 1, 4, 5, 8, 9, 0, 1, 4, 5]
    assert order(1, 2, 0, 4) == [2, 3, 6, 7, 10, 11, 2, 3]


def test_a_resumed_repeated_loader_reads_what_an_uninterrupted_one_would() -> None:
    whole = order(0, 1, 0, 20)
    for consumed in (4, 12, 16, 28):  # inside a pass, at a boundary, in later passes
        assert order(0, 1, consumed, 20 - consumed // 2) == whole[consumed:]
    assert order(1, 2, 16, 3) == order(1, 2, 0, 7)[8:]  # 16 samples: 4 groups, 4 micro-batches of rank 1


def launch(tmp_path: Path, *extra: str) -> list[str]:
    """`check_launch` of a finetune line (what finetune_llama.py runs before any process group)."""
    from megatron_ds.flags.parser import parse_config
    from megatron_ds.training.launch_checks import check_launch

    argv = [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "256",
        "--max-position-embeddings", "256", "--micro-batch-size", "1", "--global-batch-size", "2",
        "--train-iters", "1", "--lr", "1e-4", "--tokenizer-type", "HFTokenizer",
        "--tokenizer-model", str(tokenizer_dir(tmp_path)), "--data-path", write_examples(tmp_path, EXAMPLES),
        "--prompt-data", *extra,
    ]  # fmt: skip
    config, _ = parse_config(argv)
    return check_launch(config)


def test_launch_checks_read_the_examples(tmp_path: Path) -> None:
    lines = launch(tmp_path, "--split", "100,0,0")
    assert (
        lines[0]
        == f"prompt data: 3 examples in {tmp_path / 'examples.json'}, 3 samples per pass; the run trains on 2 (0.67 passes)"
    )
    with pytest.raises(UserError, match="add --repeated-dataloader"):
        launch(tmp_path, "--train-iters", "2")
    assert launch(tmp_path, "--repeated-dataloader", "--train-iters", "3")[0].endswith("trains on 6 (2.00 passes)")
    assert any("--split 969,30,1 is not used" in ln for ln in launch(tmp_path, "--repeated-dataloader"))
    short = launch(tmp_path, "--seq-length", "32", "--max-position-embeddings", "32")
    assert (
        f"NOTICE: --data-path {tmp_path / 'examples.json'}: examples 0, 1, 2 (counting from 0) have no response"
        in (short[1])
    )


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (
            ["--tokenizer-type", "HuggingFaceTokenizer"],
            "finetune_llama.py tokenizes its prompts with --tokenizer-type HFTokenizer",
        ),
        (["--mock-data"], "--mock-data and --data-path were both given"),
        (["--trust-remote-code"], "--trust-remote-code is not supported: code from a tokenizer directory is never run"),
    ],
)
def test_prompt_data_refusals(tmp_path: Path, extra: list[str], says: str) -> None:
    with pytest.raises(UserError, match=says):
        launch(tmp_path, *extra)


def test_finetune_llama_names_itself_in_help_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_ds.flags.parser import build_parser, parse_config

    monkeypatch.setattr("sys.argv", ["/somewhere/finetune_llama.py"])
    assert build_parser().prog == "finetune_llama.py"
    with pytest.raises(UserError, match=r"unrecognized arguments: --bogus; see `python finetune_llama.py --help`"):
        parse_config(["--bogus"])
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py"])
    assert build_parser().prog == "pretrain_gpt.py"


@pytest.mark.parametrize("kind", ["HFTokenizer", "HuggingFaceTokenizer"])
def test_an_export_copies_a_tokenizer_directory_and_its_own_ids(tmp_path: Path, kind: str) -> None:
    """Both Hugging Face directory tokenizers export the directory's files and its own special ids, not HFTokenizer's
    added [PAD] (id 377, no embedding row)."""
    from megatron_ds.interop.hf_tokenizer import export_tokenizer, special_ids

    tok = build_tokenizer(kind, tokenizer_model=str(tokenizer_dir(tmp_path)))
    assert special_ids(tok) == {"bos_token_id": 376, "eos_token_id": 376}
    out = tmp_path / "out"
    out.mkdir()
    assert export_tokenizer(tok, str(out), 64) == ["tokenizer_config.json", "vocab.json", "merges.txt"]
    assert (out / "vocab.json").read_bytes() == (GPT2 / "vocab.json").read_bytes()
