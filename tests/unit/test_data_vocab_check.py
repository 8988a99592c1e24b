"""Token ids against the vocabulary at every micro-batch (`data/vocab_check.py`), and every rank stopping on one
rank's bad sample (`training/run_data.py` `BadData`)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_ds.config import DataConfig
from megatron_ds.data import DataError
from megatron_ds.data.batches import pipeline_batches
from megatron_ds.data.gpt_data import build_gpt_datasets
from megatron_ds.data.indexed import write_indexed_dataset
from megatron_ds.data.tokenizer import NullTokenizer
from megatron_ds.data.vocab_check import Vocabulary
from megatron_ds.testing.launch import forked_gloo_ranks

SEQ = 8
FIX = (
    "the corpus was written with another tokenizer: preprocess it with this one (tools/preprocess_data.py), or give "
    "the tokenizer it was written with"
)


def _corpus(prefix: Path, bad_id: int | None, seed: int = 0) -> str:
    """60 documents of ids below 100; with `bad_id`, document 30 holds it."""
    rng = np.random.default_rng(seed)
    docs = [list(rng.integers(0, 99, rng.integers(5, 20))) + [99] for _ in range(60)]
    if bad_id is not None:
        docs[30][2] = bad_id
    write_indexed_dataset(str(prefix), docs, 1000)
    return str(prefix)


def _train(data_path: tuple[str, ...], cache: Path, samples: int = 200) -> object:
    data = DataConfig(data_path=data_path, split="100,0,0", data_cache_path=str(cache))
    with contextlib.redirect_stdout(io.StringIO()):
        return build_gpt_datasets(data, SEQ, 1, (samples, 0, 0), NullTokenizer(100), 128)[0]


def _first_bad(train) -> int:
    return next(k for k in range(len(train)) if int(train[k]["tokens"].max()) >= 100 or train[k]["labels"][-1] >= 100)


@pytest.mark.parametrize("workers", [0, 1])
def test_an_id_outside_the_vocabulary_is_one_line_naming_corpus_sample_and_id(tmp_path: Path, workers: int) -> None:
    """It reached the embedding: an IndexError traceback at the first forward (or, in the padding rows, nothing)."""
    prefix = _corpus(tmp_path / "c", bad_id=500)
    train = _train((prefix,), tmp_path / "cache")
    vocab = Vocabulary(100, "--vocab-size 100")
    with pytest.raises(DataError) as err:
        for _ in pipeline_batches(train, 2, 0, 1, 0, workers, seed=1, vocabulary=vocab):
            pass
    message = str(err.value)
    del err  # its traceback holds the loader, whose worker would otherwise be joined in a later test
    assert message == (
        f"{prefix}: train sample {_first_bad(train)} holds token id 500, outside the vocabulary's 100 ids "
        f"(--vocab-size 100); {FIX}"
    )
    clean = _corpus(tmp_path / "clean", bad_id=None)
    plain = list(pipeline_batches(_train((clean,), tmp_path / "cache"), 2, 0, 1, 0, 0, seed=1))
    checked = list(pipeline_batches(_train((clean,), tmp_path / "cache"), 2, 0, 1, 0, 0, seed=1, vocabulary=vocab))
    assert len(plain) == len(checked) and all(torch.equal(a[0], b[0]) for a, b in zip(plain, checked))


def test_a_blend_names_the_corpus_the_sample_comes_from(tmp_path: Path) -> None:
    good, bad = _corpus(tmp_path / "good", None, seed=1), _corpus(tmp_path / "bad", 100, seed=2)
    train = _train(("0.5", good, "0.5", bad), tmp_path / "cache")
    with pytest.raises(DataError, match=rf"^{bad}: train sample \d+ holds token id 100, outside the vocabulary's 100"):
        list(pipeline_batches(train, 2, 0, 1, 0, 0, seed=1, vocabulary=Vocabulary(100, "--vocab-size 100")))


def test_with_a_recorder_the_bad_sample_goes_on_harmless(tmp_path: Path) -> None:
    """Under torch.distributed the error is recorded and the micro-batch fed on (ids 0, loss masked), so the step
    ends on every rank and the loop stops them all at once."""
    train = _train((_corpus(tmp_path / "c", bad_id=500),), tmp_path / "cache")
    k = _first_bad(train)
    found: list[DataError] = []
    vocab = Vocabulary(100, "--vocab-size 100", on_bad=found.append)
    batches = list(pipeline_batches(train, 1, 0, 1, 0, 0, seed=1, vocabulary=vocab))
    assert len(batches) == len(train) and found and f"train sample {k} holds token id 500" in str(found[0])
    tokens, (labels, loss_mask) = batches[k]
    assert not tokens.any() and not labels.any() and not loss_mask.any()
    assert torch.equal(batches[k - 1][0][0], train[k - 1]["tokens"])  # the others as they are


def _stop_if_any(rank: int) -> None:
    from megatron_ds.training.run_data import BadData

    bad = BadData()
    bad.stop_if_any()  # nothing read: nothing happens
    if rank == 1:
        bad.record(DataError("data/x: train sample 5 holds token id 500, ..."))
    bad.stop_if_any()


def test_one_ranks_bad_sample_stops_every_rank_with_its_line(tmp_path: Path) -> None:
    results = forked_gloo_ranks(_stop_if_any, 2, str(tmp_path / "store"))
    assert results == ["data/x: train sample 5 holds token id 500, ..."] * 2


def test_the_runs_vocabulary() -> None:
    from megatron_ds.flags.parser import parse_config
    from megatron_ds.training.run_data import vocabulary

    base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --lr 1e-4 --train-iters 2"
    config, _ = parse_config([*base.split(), "--data-path", "x", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                              "900"], world_size=1)  # fmt: skip
    assert vocabulary(config) == Vocabulary(900, "--vocab-size 900")  # not the padded 1024: those rows are padding
