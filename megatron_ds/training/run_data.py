"""The loop's data on one rank: each split's micro-batches, positioned at the consumed samples."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from megatron_ds.config import Config
from megatron_ds.data import DataError
from megatron_ds.training.rank_agreement import agree
from megatron_ds.training.state import TrainState


class BadData:
    """Bad samples (ids outside the vocabulary) this rank fed to the engine harmless (`data.vocab_check`), so
    that every rank stops at the same point with the same one line: `stop_if_any` after each step and each
    evaluation, one all-reduce of a flag per rank (`rank_agreement.agree`: the message only travels when there is
    one)."""

    def __init__(self) -> None:
        self.error: DataError | None = None
        """The first one this rank read."""

    def record(self, error: DataError) -> None:
        if self.error is None:
            self.error = error

    def stop_if_any(self) -> None:
        """Raise the first rank's error on every rank if any rank read a bad sample (collective: every rank)."""
        found = agree(self.error)
        if found is not None:
            raise DataError(found.message)


@dataclass(frozen=True)
class BatchReader:
    """How this rank reads a split: what `pipeline_batches` takes besides the dataset and the start."""

    micro_batch_size: int
    """`--micro-batch-size`: samples per micro-batch on one data-parallel rank."""
    data_parallel_rank: int
    """This rank's data-parallel index: which samples of each global batch it reads."""
    data_parallel_size: int
    """Data-parallel replicas sharing each global batch."""
    seed: int
    """`--seed`: the data loader's generator and workers are seeded from it."""
    reads_data: bool
    """The first or the last stage: the only stages whose `train_batch` reads micro-batches."""
    vocabulary: Any = None
    """The ids a sample may hold (`data.vocab_check.Vocabulary`), checked at every micro-batch; None: unchecked."""
    documents: Any = None
    """`data.packed_documents.PackedDocuments` under `--reset-position-ids` / `--reset-attention-mask`: every
    micro-batch's inputs become (tokens, position_ids, document_ids); None: the tokens alone."""

    def batches(self, dataset: Any, start_sample: int, num_workers: int, repeat: bool = False) -> Iterator[Any] | None:
        """This rank's micro-batches of `dataset` from global sample `start_sample` (pass after pass with
        `repeat`); None without a dataset or on a stage that reads none."""
        from megatron_ds.data.batches import pipeline_batches

        if dataset is None or not self.reads_data:
            return None
        batches = pipeline_batches(
            dataset,
            self.micro_batch_size,
            self.data_parallel_rank,
            self.data_parallel_size,
            start_sample,
            num_workers,
            self.seed,
            repeat,
            vocabulary=self.vocabulary,
        )
        return batches if self.documents is None else self.documents.batches(batches)


@dataclass
class RunData:
    """The loop's data on this rank: each split's micro-batches, positioned at the consumed samples."""

    train: Iterator[Any] | None
    """Training micro-batches from `consumed_train_samples` (None on a stage that reads none)."""
    valid: Iterator[Any] | None
    """Validation micro-batches from `consumed_valid_samples`, one stream that every evaluation
    continues (None without a validation split or on a stage that reads none)."""
    has_valid: bool
    """There is a validation split: every stage evaluates, including those that read no data."""
    test_dataset: Any
    """The test split's dataset, or None; `test_batches` opens it at the final evaluation."""
    reader: BatchReader
    """How this rank reads each split."""
    bad: BadData | None = None
    """Under torch.distributed with more than one rank: the bad samples read, for the loop to stop on."""

    def test_batches(self) -> Iterator[Any] | None:
        """The test split's micro-batches from its first sample (no loader workers)."""
        return self.reader.batches(self.test_dataset, 0, 0)

    def stop_if_bad(self) -> None:
        """After a step or an evaluation, on every rank: a one-line DataError on every rank if some rank read a
        sample with an id outside the vocabulary (a single process raised it as it read it)."""
        if self.bad is not None:
            self.bad.stop_if_any()


def build_run_data(cfg: Config, engine: Any, state: TrainState) -> RunData:
    from megatron_ds.data.gpt_data import build_gpt_datasets
    from megatron_ds.data.splits import requested_samples
    from megatron_ds.data.tokenizer import build_tokenizer

    t = cfg.training
    if cfg.data.prompt_data:
        return _prompt_run_data(cfg, engine, state)
    tokenizer = None
    if cfg.data.tokenizer_type:
        tokenizer = build_tokenizer(
            cfg.data.tokenizer_type,
            tokenizer_model=cfg.data.tokenizer_model,
            vocab_file=cfg.data.vocab_file,
            merge_file=cfg.data.merge_file,
            vocab_size=cfg.data.null_tokenizer_vocab_size,
            null_eod_id=cfg.data.null_tokenizer_eod_id,
            null_pad_id=cfg.data.null_tokenizer_pad_id,
        )
    train, valid, test = build_gpt_datasets(
        cfg.data, cfg.model.seq_length, t.seed, requested_samples(t), tokenizer, cfg.model.vocab_size
    )
    import torch.distributed as dist

    bad = BadData() if dist.is_initialized() and dist.get_world_size() > 1 else None
    reader = _reader(cfg, engine, vocabulary(cfg, bad), packed_documents(cfg, tokenizer))
    return RunData(
        train=reader.batches(train, state.consumed_train_samples, cfg.data.num_workers),
        valid=reader.batches(valid, state.consumed_valid_samples, 0),
        has_valid=valid is not None,
        test_dataset=test,
        reader=reader,
        bad=bad,
    )


def packed_documents(cfg: Config, tokenizer: Any) -> Any:
    """What the micro-batches carry for `--reset-position-ids` / `--reset-attention-mask` (None without them): the
    end-of-document id is the tokenizer's `eod`, as upstream's get_batch reads it (without --tokenizer-type, mock
    data's NullTokenizer's: its last id)."""
    from megatron_ds.data.packed_documents import PackedDocuments
    from megatron_ds.data.tokenizer import NullTokenizer

    d = cfg.data
    if not (d.reset_position_ids or d.reset_attention_mask):
        return None
    eod = (tokenizer or NullTokenizer(d.unpadded_vocab_size or cfg.model.vocab_size)).eod
    return PackedDocuments(eod, d.reset_position_ids, d.reset_attention_mask)


def _reader(cfg: Config, engine: Any, vocabulary: Any = None, documents: Any = None) -> BatchReader:
    return BatchReader(
        micro_batch_size=cfg.training.micro_batch_size,
        data_parallel_rank=engine.grid.get_data_parallel_rank(),
        data_parallel_size=cfg.parallel.data_parallel_size,
        seed=cfg.training.seed,
        reads_data=engine.is_first_stage() or engine.is_last_stage(),
        vocabulary=vocabulary,
        documents=documents,
    )


def vocabulary(cfg: Config, bad: BadData | None = None) -> Any:
    """The ids the run's GPT samples may hold (`data.vocab_check.Vocabulary`): the unpadded vocabulary
    (`--vocab-size`, else the tokenizer's size); the model's rows above it are padding no sample should reach.
    With `bad` a bad sample is recorded there (the loop stops every rank after the step), else raised at once."""
    from megatron_ds.data.vocab_check import Vocabulary

    d = cfg.data
    size = d.unpadded_vocab_size or cfg.model.vocab_size
    if not size or d.prompt_data:  # finetune_llama.py's examples are checked at launch (their labels hold the pad)
        return None
    on_bad = bad.record if bad is not None else None
    if d.tokenizer_type in (None, "NullTokenizer"):
        return Vocabulary(size, f"--vocab-size {size}" if d.tokenizer_type else f"{size} ids", on_bad)
    files = " ".join(f for f in (d.tokenizer_model, d.vocab_file) if f)
    return Vocabulary(size, f"--tokenizer-type {d.tokenizer_type}{' ' + files if files else ''}", on_bad)


def _prompt_run_data(cfg: Config, engine: Any, state: TrainState) -> RunData:
    """finetune_llama.py: every example trains, none evaluates (as upstream's provider returns no validation or
    test set); the examples were read and checked at launch (`launch_checks.check_prompt_data`). A resume's
    NOTICE on the repeated loader is the loop's (`loop._load_or_fresh`)."""
    from megatron_ds.data.prompt_data import build_prompt_data

    reader = _reader(cfg, engine)
    train = build_prompt_data(cfg.data, cfg.model.seq_length, cfg.model.vocab_size) if reader.reads_data else None
    batches = reader.batches(train, state.consumed_train_samples, cfg.data.num_workers, cfg.data.repeated_dataloader)
    return RunData(train=batches, valid=None, has_valid=False, test_dataset=None, reader=reader)
