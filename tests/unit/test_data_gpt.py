"""GPT datasets over megatron-core: blends, splits, mock data, sampler order, multi-rank build."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_ds.config import DataConfig
from megatron_ds.data import DataError
from megatron_ds.data.batches import PretrainingBatchSampler, pipeline_batches
from megatron_ds.data.gpt_data import build_gpt_datasets, parse_data_path
from megatron_ds.data.indexed import write_indexed_dataset
from megatron_ds.data.splits import parse_split, split_ranges
from megatron_ds.data.tokenizer import NullTokenizer
from megatron_ds.testing.launch import forked_gloo_ranks

VOCAB = 100
TOK = NullTokenizer(VOCAB)  # eod = 99
SEQ = 16


def _corpus(prefix: Path, num_docs: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    docs = [list(rng.integers(0, VOCAB - 1, rng.integers(4, 40))) + [TOK.eod] for _ in range(num_docs)]
    write_indexed_dataset(str(prefix), docs, VOCAB)
    return str(prefix)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("gpt")
    return _corpus(d / "a_text_document", 400, 1), _corpus(d / "b_text_document", 300, 2)


def test_parse_data_path() -> None:
    assert parse_data_path(("a",)) == (["a"], None)
    assert parse_data_path(("a", "b")) == (["a", "b"], None)
    assert parse_data_path(("0.7", "a", "0.3", "b")) == (["a", "b"], [0.7, 0.3])
    assert parse_data_path(("1", "a")) == (["a"], [1.0])
    with pytest.raises(DataError, match="'0.3' looks like a weight, but weights and prefixes must alternate"):
        parse_data_path(("a", "0.3", "b", "0.7"))  # weights after their prefixes
    with pytest.raises(DataError, match="weight -1.0 must be a positive number"):
        parse_data_path(("-1", "a", "2", "b"))
    with pytest.raises(DataError, match="--data-path"):
        parse_data_path(())


def test_parse_data_path_names_the_bad_weight() -> None:
    """The item that breaks the weighted list is named, not the first weight."""
    with pytest.raises(
        DataError, match=r"a 0.3: weight 0.3 has no prefix after it; give weights and prefixes in pairs"
    ):
        parse_data_path(("0.7", "a", "0.3"))
    with pytest.raises(DataError, match=r"weight 2, 'x', is not a number; give a number before each prefix"):
        parse_data_path(("0.7", "a", "x", "b"))
    with pytest.raises(DataError, match=r"weight 2, '0,3', is not a number; write it 0.3 \(a decimal point\)"):
        parse_data_path(("0.7", "a", "0,3", "b"))


def test_parse_split_matches_megatron_core() -> None:
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    for split in ("969,30,1", "949,50,1", "98,2,0", "1", "100,0,0", "1,1,1", "0.8/0.1/0.1"):
        for n in (1, 7, 20, 500, 1499):
            matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
            ours = split_ranges(n, split, "megatron-lm")
            theirs = [None if m is None else (int(round(m[0] * n)), int(round(m[1] * n))) for m in matrix]
            assert ours == theirs, (split, n)
    for bad in ("", "a,b", "1,2,3,4", "-1,2", "0,0,0"):
        with pytest.raises(DataError, match="--split"):
            parse_split(bad)


def _config(paths: tuple[str, ...], **kw) -> DataConfig:
    return DataConfig(data_path=paths, split=kw.pop("split", "90,8,2"), **kw)


def test_items_and_splits(corpora: tuple[str, str]) -> None:
    train, valid, test = build_gpt_datasets(_config((corpora[0],), eod_mask_loss=True), SEQ, 7, (50, 10, 5), TOK, 128)
    assert len(train) >= 50 and len(valid) >= 10 and len(test) >= 5
    item = train[3]
    assert item["tokens"].shape == item["labels"].shape == item["loss_mask"].shape == (SEQ,)
    assert (item["tokens"].dtype, item["labels"].dtype) == (torch.int64, torch.int64)
    assert item["loss_mask"].dtype == torch.float32
    assert torch.equal(item["tokens"][1:], item["labels"][:-1])
    assert torch.equal(item["loss_mask"] == 0, item["tokens"] == TOK.eod)  # --eod-mask-loss
    none_test = build_gpt_datasets(_config((corpora[0],), split="98,2,0"), SEQ, 7, (5, 5, 5), TOK, 128)
    assert none_test[2] is None


def test_null_tokenizer_eod_and_pad_ids_reach_the_samples(corpora: tuple[str, str]) -> None:
    # --null-tokenizer-eod-id / --null-tokenizer-pad-id: megatron-core masks the pad id out of the loss (and reads it
    # as token 0), and --eod-mask-loss masks the given end-of-document id
    tok = NullTokenizer(VOCAB, eod_id=5, pad_id=7)
    (train, _, _) = build_gpt_datasets(_config((corpora[0],), eod_mask_loss=True), SEQ, 7, (50, 0, 0), tok, 128)
    (plain, _, _) = build_gpt_datasets(_config((corpora[0],)), SEQ, 7, (50, 0, 0), TOK, 128)
    seen = 0
    for k in range(50):
        item, raw = train[k], plain[k]
        expected = ((raw["labels"] != 7) & (raw["tokens"] != 5)).float()
        assert torch.equal(item["loss_mask"], expected)
        assert torch.equal(item["tokens"], torch.where(raw["tokens"] == 7, 0, raw["tokens"]))
        seen += int((raw["labels"] == 7).sum())
    assert seen > 0


def test_empty_split_fails_instead_of_looping(tmp_path: Path, corpora: tuple[str, str]) -> None:
    small = _corpus(tmp_path / "small", 20, 3)  # 90,9,1 leaves its test split empty
    data = DataConfig(data_path=("0.5", corpora[0], "0.5", small), split="90,9,1")
    with pytest.raises(
        DataError,
        match=r"--split 90,9,1: corpus .*small has 20 documents, so its test split gets no documents "
        r"\(Megatron-DeepSpeed's rounding\), but evaluation reads 10 test samples; give test a larger share or "
        r"add documents, or --eval-iters 0 to skip it$",
    ):
        build_gpt_datasets(data, SEQ, 1, (10, 10, 10), TOK, 128)


def test_input_errors(tmp_path: Path, corpora: tuple[str, str]) -> None:
    with pytest.raises(
        DataError,
        match=r"tokenizer model NullTokenizer has 100 tokens but "
        r"--vocab-size is 64; raise --vocab-size",
    ):
        build_gpt_datasets(_config((corpora[0],)), SEQ, 1, (1, 1, 1), TOK, 64)
    with pytest.raises(DataError, match=r"--data-path .*missing: no .*missing.bin/.idx found"):
        build_gpt_datasets(_config((str(tmp_path / "missing"),)), SEQ, 1, (1, 1, 1), TOK, 128)
    with pytest.raises(DataError, match="--tokenizer-type is required"):
        build_gpt_datasets(_config((corpora[0],)), SEQ, 1, (1, 1, 1), None, 128)


def _tokens(ds, n: int) -> list[list[int]]:
    return [ds[i]["tokens"].tolist() for i in range(n)]


def test_weighted_blend_with_cache_path(tmp_path: Path, corpora: tuple[str, str]) -> None:
    """Without torch.distributed, megatron-core's BlendedDataset would crash on a cache path."""
    assert not torch.distributed.is_initialized()
    data = _config(("0.75", corpora[0], "0.25", corpora[1]), data_cache_path=str(tmp_path / "cache"))
    train, _, _ = build_gpt_datasets(data, SEQ, 5, (200, 20, 8), TOK, 128)
    ids = np.array([train[i]["dataset_id"] for i in range(len(train))])
    assert len(train) >= 200 and abs((ids == 0).mean() - 0.75) < 0.02
    assert any(p.endswith("GPTDataset-train-sample_index.npy") for p in os.listdir(tmp_path / "cache"))
    again, _, _ = build_gpt_datasets(data, SEQ, 5, (200, 20, 8), TOK, 128)  # from the cache
    assert _tokens(again, 30) == _tokens(train, 30)


def test_mock_data_is_deterministic_per_seed() -> None:
    mock, seq = DataConfig(mock_data=True), 256
    a = build_gpt_datasets(mock, seq, 1, (20, 4, 4), None, 128)[0]
    b = build_gpt_datasets(mock, seq, 1, (20, 4, 4), None, 128)[0]
    c = build_gpt_datasets(mock, seq, 2, (20, 4, 4), None, 128)[0]
    assert _tokens(a, 20) == _tokens(b, 20) and _tokens(a, 20) != _tokens(c, 20)
    assert max(max(t) for t in _tokens(a, 20)) < 128
    assert a[0]["loss_mask"].dtype == torch.float32
    assert torch.equal(a[3]["labels"][:-1], a[3]["tokens"][1:]) and len(a) == 20
    valid = build_gpt_datasets(mock, seq, 1, (20, 4, 4), None, 128)[1]
    assert _tokens(valid, 4) != _tokens(a, 4)  # the splits are different samples


@pytest.mark.parametrize("split, built", [("100,0,0", [True, False, False]), ("99,1,0", [True, True, False])])
def test_mock_data_builds_no_split_of_weight_zero(split: str, built: list[bool], capsys) -> None:
    """Under Megatron-DeepSpeed's rules (our MockGPTData) only the splits of weight > 0 are built: `--split
    100,0,0` evaluates nothing; a NOTICE says these are not Megatron-LM's samples."""
    datasets = build_gpt_datasets(DataConfig(mock_data=True, split=split), 16, 1, (20, 4, 4), None, 128)
    assert [d is not None for d in datasets] == built
    assert all(d is not None for d in build_gpt_datasets(DataConfig(mock_data=True), 16, 1, (20, 4, 4), None, 128))
    assert "NOTICE: --mock-data under Megatron-DeepSpeed's data rules (it has no mock data)" in capsys.readouterr().out


def test_megatron_lm_mock_data_is_megatron_cores(capsys) -> None:
    """Under Megatron-LM's rules megatron-core splits its mock documents 1,1,1 whatever --split says (so all three
    splits exist), and each document counts up from 1 to its EOD (the samples themselves: the fixture case
    megatron_lm_mock of test_megatron_deepspeed_data.py)."""
    data = DataConfig(mock_data=True, split="100,0,0", data_upstream="megatron-lm")
    train, valid, test = build_gpt_datasets(data, 16, 1, (20, 4, 4), None, 128)
    assert valid is not None and test is not None and "NOTICE" not in capsys.readouterr().out
    tokens = train[0]["tokens"].tolist() + [int(train[0]["labels"][-1])]
    steps = {(b - a) % 127 for a, b in zip(tokens, tokens[1:]) if 127 not in (a, b)}  # 127: the NullTokenizer's EOD
    assert steps == {1}, tokens


def test_sampler_order_across_ranks() -> None:
    """Group g of mbs*dp consecutive samples; rank d takes [d*mbs, (d+1)*mbs) of it."""
    mbs, dp, total = 2, 3, 40
    per_rank = [list(PretrainingBatchSampler(total, 0, mbs, d, dp)) for d in range(dp)]
    assert per_rank[0][:2] == [[0, 1], [6, 7]] and per_rank[2][:2] == [[4, 5], [10, 11]]
    merged = [i for step in zip(*per_rank) for batch in step for i in batch]
    assert merged == list(range(36))  # the incomplete last group (36..39) is dropped
    for d in range(dp):
        resumed = list(PretrainingBatchSampler(total, 12, mbs, d, dp))
        assert resumed == per_rank[d][2:] and len(resumed) == len(PretrainingBatchSampler(total, 12, mbs, d, dp))
    with pytest.raises(DataError, match="resume point of 41 consumed samples"):
        PretrainingBatchSampler(total, 41, mbs, 0, dp)
    with pytest.raises(ValueError, match="data_parallel_rank 3"):
        PretrainingBatchSampler(total, 0, mbs, 3, dp)


def test_pipeline_batches_resume(corpora: tuple[str, str]) -> None:
    train = build_gpt_datasets(_config((corpora[0],)), SEQ, 3, (64, 1, 1), TOK, 128)[0]
    full = list(pipeline_batches(train, 2, 1, 2, 0, 0, seed=3))
    tokens, (labels, loss_mask) = full[0]
    assert tokens.shape == (2, SEQ) and tokens.dtype == torch.int64
    assert labels.dtype == torch.int64 and loss_mask.dtype == torch.float32
    assert torch.equal(tokens[0], train[2]["tokens"]) and torch.equal(tokens[1], train[3]["tokens"])
    resumed = list(pipeline_batches(train, 2, 1, 2, 8, 2, seed=3))  # 2 workers, from sample 8
    assert len(resumed) == len(full) - 2
    for (t1, (l1, m1)), (t2, (l2, m2)) in zip(full[2:], resumed):
        assert torch.equal(t1, t2) and torch.equal(l1, l2) and torch.equal(m1, m2)


def _build(rank: int, prefix: str, cache: str) -> dict:
    data = DataConfig(data_path=("0.5", prefix, "0.5", prefix), split="90,8,2", data_cache_path=cache)
    train, valid, _ = build_gpt_datasets(data, SEQ, 11, (40, 8, 4), TOK, 128)
    return {"train": _tokens(train, 10), "valid": _tokens(valid, 4)}


def test_build_under_two_ranks(tmp_path: Path, corpora: tuple[str, str]) -> None:
    """Rank 0 builds the caches, then rank 1 reads them (megatron-core's barriers); both agree."""
    cache = str(tmp_path / "cache")  # forked: megatron-core is already imported, no start-up cost
    results = forked_gloo_ranks(_build, 2, str(tmp_path / "store"), corpora[1], cache, timeout=180)
    assert all(isinstance(r, dict) for r in results), results  # a rank's error is its message
    assert results[0] == results[1]
    assert any(f.endswith("sample_index.npy") for f in os.listdir(cache))
