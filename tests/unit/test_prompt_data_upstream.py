"""finetune_llama.py's micro-batches equal Megatron-DeepSpeed's own, sample for sample over more than one pass: the
references in tests/fixtures/megatron_deepspeed_sft/ were written by its finetune_llama.py data path at 4efb479
(its HFTokenizer, SupervisedDataset, sampler, RepeatingLoader and get_batch_pipe)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_ds.data.batches import pipeline_batches
from megatron_ds.data.prompt_data import PromptData, build_prompt_data
from megatron_ds.data.tokenizer import build_tokenizer
from megatron_ds.flags.parser import parse_config

pytest.importorskip("transformers")

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "megatron_deepspeed_sft"
CASES = sorted(p.stem for p in (FIXTURE / "samples").glob("*.json"))


def reference(case: str) -> dict:
    return json.loads((FIXTURE / "samples" / f"{case}.json").read_text())


def our_line(ref: dict) -> list[str]:
    """The case's flags with the fixture's paths, as finetune_llama.py parses them."""
    argv = ref["command"].split()
    for k, a in enumerate(argv[:-1]):
        if a in ("--data-path", "--tokenizer-model"):
            argv[k + 1] = str(FIXTURE / argv[k + 1])
    return [*argv, "--prompt-data"]


def test_every_case_is_checked() -> None:
    assert CASES == ["gpt2", "gpt2_seq192", "llama", "pad"]


@pytest.mark.parametrize("case", CASES)
def test_micro_batches_are_upstreams(case: str) -> None:
    ref = reference(case)
    config, _ = parse_config(our_line(ref))
    assert config.model.vocab_size == ref["padded_vocab_size"]
    data = build_prompt_data(config.data, config.model.seq_length, config.model.vocab_size)
    tok = build_tokenizer("HFTokenizer", tokenizer_model=config.data.tokenizer_model)
    assert (tok.vocab_size, len(tok.hf_tokenizer), tok.pad, tok.eod) == tuple(
        ref["tokenizer"][k] for k in ("vocab_size", "len", "pad", "eod")
    )
    assert len(data) == ref["dataset_size"]
    for k, item in enumerate(ref["dataset_items"]):  # before the shift: the ids and the prompt-masked labels
        assert data.ids[k].tolist() == item["input_ids"] and data.labels[k].tolist() == item["labels"], k
    batches = pipeline_batches(data, 2, 0, 1, 0, 0, config.training.seed, repeat=True)
    for n, theirs in enumerate(ref["micro_batches"]):
        tokens, (labels, loss_mask) = next(batches)
        assert tokens.tolist() == theirs["tokens"], n
        assert loss_mask.tolist() == [[float(m) for m in row] for row in theirs["loss_mask"]], n
        trained = loss_mask.bool()
        assert torch.equal(labels[trained], torch.tensor(theirs["labels"])[trained]), n  # the rest is not read


def test_an_out_of_vocabulary_pad_differs_only_where_padding_is_read() -> None:
    """The llama case with a model of exactly the tokenizer's 700 ids ([PAD] is 700): the padding positions read eos
    (upstream would feed id 700, outside the embedding); every other id, label and mask is upstream's."""
    ref = reference("llama")
    tok = build_tokenizer("HFTokenizer", tokenizer_model=str(FIXTURE / "tok_llama"))
    data = PromptData(str(FIXTURE / "alpaca.json"), tok, 32, 700)
    batches = pipeline_batches(data, 2, 0, 1, 0, 0, 1234, repeat=True)
    padded = 0
    for theirs in ref["micro_batches"]:
        tokens, (_, loss_mask) = next(batches)
        upstream = torch.tensor(theirs["tokens"])
        padding = upstream == tok.pad
        padded += int(padding.sum())
        assert torch.equal(tokens[~padding], upstream[~padding]) and tokens[padding].eq(tok.eod).all()
        assert not loss_mask[padding].any() and loss_mask.tolist() == [
            [float(m) for m in r] for r in theirs["loss_mask"]
        ]
    assert padded > 0


def test_show_samples_prints_upstreams_samples_and_what_they_train_on(capsys: pytest.CaptureFixture) -> None:
    """tools/show_samples.py on the llama case's line: samples 10-17 (the pass wraps after 12) are upstream's
    micro-batches 5-8, each example's seq_length + 1 ids, and what it trains on is its counted labels."""
    from megatron_ds.data.demo_corpus import _load_tool

    ref = reference("llama")
    tool = _load_tool("show_samples")
    assert tool.main([*our_line(ref), "--num-samples", "8", "--consumed-samples", "10", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    theirs = ref["micro_batches"][5:9]
    tokens = [row for mb in theirs for row in mb["tokens"]]
    assert [ids[:-1] for ids in shown["samples"]] == tokens
    counted = [
        [label for label, m in zip(labels, mask) if m]
        for mb in theirs
        for labels, mask in zip(mb["labels"], mb["loss_mask"])
    ]
    assert shown["trained"] == counted
    assert [e for mb in theirs for e in mb["example"]] == [10, 11, 0, 1, 2, 3, 4, 5]
