"""The run's layout on this machine: the pure `estimate.run_layout` given the probed device and,
for `--pp-partition-method profile`, a measurement of this process (`measure.calibrate`).

`resolve_layout` is what the builder calls (once per build) and `pretrain_gpt.py --print-layout`
prints; `layout_text` is the stage table with what the method predicts under it.
"""

from __future__ import annotations

from megatron_ds.config import DATA_UPSTREAMS, Config, padded_vocab_size
from megatron_ds.data.tokenizer import build_tokenizer, megatron_deepspeed_sentencepiece
from megatron_ds.estimate import run_layout
from megatron_ds.estimate.machine import Machine, describe
from megatron_ds.estimate.measured_time import Calibration
from megatron_ds.estimate.stage_contents import recomputed_layers
from megatron_ds.pipeline.layout import Layout
from megatron_ds.training.machine import layout_machine, probe
from megatron_ds.training.measure.calibrate import cached_calibration


def measure(config: Config, machine: Machine | None = None) -> Calibration:
    """This process's timing of the run's groups for `profile` (once per process and run shape)."""
    machine = machine or probe()
    t = config.training
    return cached_calibration(config.model, t.micro_batch_size, config.regularization, machine.device, t.precision)


def resolve_layout(config: Config, calibration: Calibration | None = None, machine: Machine | None = None) -> Layout:
    """The layout this run uses here (for `--pp-device` when given); `profile` measures in this process
    unless `calibration` is given (the builder passes rank 0's to every rank)."""
    machine = machine or layout_machine(config)
    if calibration is None and run_layout.uses_measured_times(config):
        calibration = measure(config, machine)
    return run_layout.build_run_layout(config, machine, calibration)


def layout_text(config: Config, layout: Layout, calibration: Calibration | None = None) -> str:
    """The stage table, and under it what the partition method predicts (`run_layout.layout_report`)."""
    par = config.parallel
    machine = layout_machine(config)
    if calibration is None and run_layout.uses_measured_times(config):
        calibration = measure(config, machine)
    report = run_layout.layout_report(config, layout, machine, calibration)
    n = par.ds_sequence_parallel_size  # Ulysses: the data axis holds DP x N ranks, N consecutive per sequence
    table = layout.format(par.data_parallel_size * n, par.tensor_model_parallel_size)
    if n > 1:
        table += (
            f"\nDeepSpeed-Ulysses: the data axis above is {par.data_parallel_size} data-parallel replica(s) x "
            f"--ds-sequence-parallel-size {n}: data ranks {n}g .. {n}g+{n - 1} split the sequences of replica g"
        )
    notices = [padding_line(config), *tokenizer_notices(config), recompute_notice(config, layout)]
    table += "".join(f"\n{line}" for line in notices if line)
    return f"{table}\n{report}\n{describe(config, machine)}" if report else table


def padding_line(config: Config) -> str | None:
    """What Megatron prints as `> padded vocab (size: V) with D dummy tokens (new size: P)`: the rows the model adds
    to the tokens (a loss over P classes, ln P at the start, not ln V)."""
    tokens, rows = config.data.unpadded_vocab_size, config.model.vocab_size
    if not tokens or rows == tokens:
        return None
    d, t = config.data.make_vocab_size_divisible_by, config.parallel.tensor_model_parallel_size
    by = f"--make-vocab-size-divisible-by {d}" + (f" x --tensor-model-parallel-size {t}" if t > 1 else "")
    return f"vocabulary: {tokens} tokens padded with {rows - tokens} dummy rows to {rows} (a multiple of {by})"


def null_tokenizer_notice(config: Config) -> str | None:
    """A NOTICE for a new Megatron-DeepSpeed-style run (not a resume, whose vocabulary is the checkpoint's) with
    NullTokenizer: ours is megatron-core's (--vocab-size ids); Megatron-DeepSpeed's had one id more."""
    data = config.data
    vocab = data.null_tokenizer_vocab_size
    if not vocab or data.data_upstream != DATA_UPSTREAMS[0] or config.checkpoint.load:  # megatron-deepspeed
        return None
    return (
        f"NOTICE: --tokenizer-type NullTokenizer --vocab-size {vocab}: ids 0..{vocab - 1}, end-of-document {vocab - 1}, "
        f"as megatron-core's NullTokenizer; Megatron-DeepSpeed's has {vocab + 1} ids, end-of-document {vocab}: give "
        f"--vocab-size {vocab + 1} for its model"
    )


def tokenizer_notices(config: Config) -> list[str | None]:
    """The NOTICEs where the line's tokenizer or vocabulary is not upstream's (printed once, with the layout)."""
    return [null_tokenizer_notice(config), vocab_size_notice(config), sentencepiece_notice(config)]


def _mds_sentencepiece(config: Config) -> bool:
    """A Megatron-DeepSpeed line (its data upstream) with its SentencePieceTokenizer, which is not ours."""
    data = config.data
    return data.tokenizer_type == "SentencePieceTokenizer" and data.data_upstream == DATA_UPSTREAMS[0]


def vocab_size_notice(config: Config) -> str | None:
    """A NOTICE when --vocab-size, not the tokenizer, sizes the vocabulary: both upstreams ignore --vocab-size with
    a tokenizer other than NullTokenizer and size it from the tokenizer. Ours is kept for imported models whose
    embedding has more rows than their tokenizer (the Hugging Face import prints such a --vocab-size)."""
    data = config.data
    if data.tokenizer_type in (None, "NullTokenizer") or not data.unpadded_vocab_size:
        return None
    kind, given = data.tokenizer_type, data.unpadded_vocab_size
    tokens = build_tokenizer(kind, data.tokenizer_model, data.vocab_file, data.merge_file).vocab_size
    if given == tokens:
        return None
    upstream = "Megatron-DeepSpeed" if data.data_upstream == DATA_UPSTREAMS[0] else "Megatron-LM"
    theirs = megatron_deepspeed_sentencepiece(data.tokenizer_model)[0] if _mds_sentencepiece(config) else tokens
    rows = padded_vocab_size(theirs, data.make_vocab_size_divisible_by, config.parallel.tensor_model_parallel_size)
    shape = f", not this model's {config.model.vocab_size}" if rows != config.model.vocab_size else ""
    return (
        f"NOTICE: --vocab-size {given} sizes the vocabulary here ({config.model.vocab_size} rows), not --tokenizer-type "
        f"{kind}'s {tokens} tokens; {upstream} ignores --vocab-size with a tokenizer and sizes it from the tokenizer: "
        f"{theirs} tokens padded to {rows} rows{shape}; drop --vocab-size for upstream's model (keep it for an "
        f"imported model whose embedding has more rows than its tokenizer)"
    )


def sentencepiece_notice(config: Config) -> str | None:
    """A NOTICE for a Megatron-DeepSpeed line with --tokenizer-type SentencePieceTokenizer: ours is its
    GPTSentencePieceTokenizer (the model's pieces, eod its eos); its SentencePieceTokenizer adds special pieces and
    ends documents with <EOD> (`data.tokenizer.megatron_deepspeed_sentencepiece`)."""
    if not _mds_sentencepiece(config):
        return None
    model = config.data.tokenizer_model
    here = build_tokenizer("SentencePieceTokenizer", model)
    ids, eod, added = megatron_deepspeed_sentencepiece(model)
    return (
        f"NOTICE: --tokenizer-type SentencePieceTokenizer is Megatron-DeepSpeed's GPTSentencePieceTokenizer here: "
        f"{here.vocab_size} ids, end-of-document {here.eod} (the model's eos); its SentencePieceTokenizer adds "
        f"{', '.join(added)}: {ids} ids, end-of-document <EOD> {eod}, so data it preprocessed ends documents with "
        f"{eod}, not an end-of-document here: preprocess the data again with tools/preprocess_data.py, or give "
        f"--tokenizer-type GPTSentencePieceTokenizer (this tokenizer, without this notice)"
    )


def recompute_notice(config: Config, layout: Layout) -> str | None:
    """A NOTICE when full recomputation leaves layers of a stage unrecomputed: DeepSpeed recomputes a chunk of
    `--recompute-num-layers` functions only when all are transformer layers, counting from each stage's first
    function (its embedding or head too; `stage_contents.checkpointed_chunks`), where Megatron-LM recomputes every layer."""
    t = config.training
    if not t.checkpoint_activations:
        return None
    groups, interval = layout.groups, t.checkpoint_num_layers
    first, end = len(groups.pre), len(groups.pre) + sum(layout.layers_per_stage)  # the body's spec indices
    short = []
    for s, k in enumerate(layout.layers_per_stage):
        specs = layout.stage_specs(s)
        pre, post = sum(1 for i in specs if i < first), sum(1 for i in specs if i >= end)
        again = recomputed_layers(pre, k, post, interval)
        if again < k:
            short.append(f"stage {s} recomputes {again} of its {k} layers")
    if not short:
        return None
    shown = "; ".join(short[:4]) + (f"; and {len(short) - 4} more stages" if len(short) > 4 else "")
    return (
        f"NOTICE: --recompute-num-layers {interval} leaves layers unrecomputed ({shown}): DeepSpeed recomputes a "
        f"chunk of {interval} functions only when all are transformer layers, counting from each stage's first "
        f"function, embedding and head included (Megatron-LM recomputes every layer); --recompute-num-layers 1 "
        f"recomputes them all"
    )
