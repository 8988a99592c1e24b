"""Import a Megatron-DeepSpeed (GPTModelPipe) checkpoint as ours: its weights, and its whole training
state in our universal form.

    from megatron_ds.interop.megatron_deepspeed import import_megatron_deepspeed
    result = import_megatron_deepspeed("mds/checkpoints", "checkpoints/converted")

`OUT/latest` -> `OUT/<tag>/`: our per-spec weight files at the source's T (they load at any P, T,
DP and layout, export with `--to hf`, generate with tools/generate.py) and `megatron_ds.json`: the
run's config from its saved args, its iteration and consumed samples. `OUT/<tag>.universal/`:
fp32 weights, the optimizer's moments and step, the learning-rate schedule and DeepSpeed's
counters, where `pretrain_gpt.py --load OUT` looks for the universal form, so a resume continues
the run under any layout. The source is only read (see `megatron_deepspeed_files` for how).
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_ds import files
from megatron_ds.config import Config
from megatron_ds.interop import megatron_deepspeed_args as saved_args
from megatron_ds.interop.megatron_deepspeed_files import MegatronDeepSpeedCheckpoint, open_megatron_deepspeed
from megatron_ds.interop.megatron_deepspeed_layout import BLOCKED, QKV_LAYOUTS
from megatron_ds.interop.megatron_deepspeed_source import MegatronDeepSpeedSource, check_split
from megatron_ds.model import naming, sharding
from megatron_ds.training.checkpoint import reader
from megatron_ds.training.checkpoint.directory import CONVERTED, LATEST, META, CheckpointError
from megatron_ds.training.checkpoint.universal import store
from megatron_ds.training.checkpoint.universal.convert import SUFFIX
from megatron_ds.training.checkpoint.universal.names import ModelTensor, model_tensors
from megatron_ds.training.resolve_layout import resolve_layout

SECTION = CONVERTED
"""The metadata section of a converted checkpoint: where it came from (and that its training state
is in universal form only: `rules.topology_changes`)."""


@dataclass
class ImportResult:
    output: str
    tag: str
    config: Config
    iteration: int
    states: list[str]
    """The optimizer states carried over (Adam: exp_avg, exp_avg_sq); [] when the source saved none."""
    train_flags: list[str]
    """Our flags for its model, tokenizer and schedule (Megatron-DeepSpeed's spelling)."""
    notes: list[str] = field(default_factory=list)


def import_megatron_deepspeed(
    source: str,
    output: str,
    qkv_layout: str = BLOCKED,
    tokenizer: dict[str, str | None] | None = None,
    show_progress: bool = True,
) -> ImportResult:
    """Convert Megatron-DeepSpeed checkpoint `source` (its --save directory or a global_step directory)
    into `output` (created; never overwritten)."""
    if qkv_layout not in QKV_LAYOUTS:
        raise CheckpointError(f"--qkv-layout {qkv_layout}: choose one of {', '.join(QKV_LAYOUTS)}")
    mds = open_megatron_deepspeed(source)
    tokenizer_flags, note = saved_args.tokenizer_flags(mds, tokenizer or {})
    config = saved_args.config_from_args(mds, tokenizer_flags)
    layout = resolve_layout(config)  # a layout error now, before anything is written
    root = os.path.abspath(output)
    with files.atomic_directory(root, "output") as tmp:
        step_dir = os.path.join(tmp, mds.tag)
        os.makedirs(step_dir)
        meta = _meta(mds, config, layout.to_string(), qkv_layout)
        files.write_json(os.path.join(step_dir, META), meta)
        ours = reader.Checkpoint(tmp, mds.tag, meta, config)
        src = MegatronDeepSpeedSource(mds, ours, qkv_layout)
        check_split(src)
        _write_weights(src, step_dir, show_progress)
        universal = os.path.join(tmp, mds.tag + SUFFIX)
        os.makedirs(universal)
        bar = files.progress(len(model_tensors(config.model)), "universal", show_progress)
        try:
            store.write(src, universal, bar)
        finally:
            bar.close()
        states = store.Universal(universal).states  # validated before the output gets its name
        with open(os.path.join(tmp, LATEST), "w") as f:
            f.write(mds.tag)
    notes = [note] if note else []
    if not states:
        notes.append("no optimizer state in the source: a resume from it starts the optimizer's moments at zero")
    flags = saved_args.render(mds.args, saved_args.MODEL_ARGS) + ["--vocab-size", str(saved_args.vocab_size(mds))]
    flags += tokenizer_flags + saved_args.render(mds.args, saved_args.TRAINING_ARGS)
    return ImportResult(root, mds.tag, config, meta["train_state"]["iteration"], states, flags, notes)


def _meta(mds: MegatronDeepSpeedCheckpoint, config: Config, layout: str, qkv_layout: str) -> dict[str, Any]:
    par = config.parallel
    return {
        "config": config.to_dict(),
        "train_state": saved_args.train_state(mds),
        "layout": layout,
        "world_size": par.pipeline_model_parallel_size * par.tensor_model_parallel_size * par.data_parallel_size,
        "format": 1,
        SECTION: {
            "source": mds.directory,
            "vocab_size": saved_args.vocab_size(mds),
            "qkv_layout": qkv_layout,
            "universal": mds.tag + SUFFIX,
            "tensor_model_parallel_size": mds.tensor_parallel,
            "pipeline_model_parallel_size": mds.pipeline_parallel,
            "data_parallel_size": mds.data_parallel,
            "zero_stage": mds.zero_stage,
            "precision": mds.precision,
            "checkpoint_version": mds.states.get("checkpoint_version"),
            "ds_version": mds.states.get("ds_version"),
        },
    }


def _write_weights(src: MegatronDeepSpeedSource, step_dir: str, show_progress: bool) -> None:
    """Our layer files at the source's T, in the source's weight dtype (as DeepSpeed writes them)."""
    model, t = src.model, src.tensor_parallel
    by_spec: dict[int, list[ModelTensor]] = defaultdict(list)
    for tensor in model_tensors(model):
        by_spec[tensor.spec_index].append(tensor)
    names = naming.gpt_spec_groups(model).names
    bar = files.progress(len(by_spec), "weights", show_progress)
    try:
        for index, tensors in sorted(by_spec.items()):
            states: list[dict[str, Any]] = [{} for _ in range(t)]
            for tensor in tensors:
                for state, piece in zip(states, sharding.split(tensor.rule, src.weight(tensor), t)):
                    state[tensor.key] = piece
            for rank, state in enumerate(states):
                state.update(dict.fromkeys(sharding.extra_state_keys(names[index], t)))
                torch.save(state, reader.layer_file(step_dir, index, rank))
            bar.update(1)
    finally:
        bar.close()
