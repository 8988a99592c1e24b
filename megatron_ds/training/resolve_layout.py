"""The run's layout on this machine: the pure `estimate.run_layout` given the probed device and,
for `--pp-partition-method profile`, a measurement of this process (`measure.calibrate`).

`resolve_layout` is what the builder calls (once per build) and `pretrain_gpt.py --print-layout`
prints; `layout_text` is the stage table with what the method predicts under it.
"""

from __future__ import annotations

from megatron_ds.config import DATA_UPSTREAMS, Config
from megatron_ds.estimate import run_layout
from megatron_ds.estimate.compute import recomputed_layers
from megatron_ds.estimate.machine import Machine, describe
from megatron_ds.estimate.measured_time import Calibration
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
    notices = [padding_line(config), null_tokenizer_notice(config), recompute_notice(config, layout)]
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


def recompute_notice(config: Config, layout: Layout) -> str | None:
    """A NOTICE when full recomputation leaves layers of a stage unrecomputed: DeepSpeed recomputes a chunk of
    `--recompute-num-layers` functions only when all are transformer layers, counting from each stage's first
    function (its embedding or head too; `compute.checkpointed_chunks`), where Megatron-LM recomputes every layer."""
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
