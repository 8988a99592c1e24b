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
from dataclasses import dataclass
from typing import Any

from megatron_ds.config import Config
from megatron_ds.interop import converted
from megatron_ds.interop import megatron_deepspeed_args as saved_args
from megatron_ds.interop.megatron_deepspeed_experts import MegatronDeepSpeedMoeSource, check_moe
from megatron_ds.interop.megatron_deepspeed_files import MegatronDeepSpeedCheckpoint, open_megatron_deepspeed
from megatron_ds.interop.megatron_deepspeed_layout import BLOCKED, INTERLEAVED, QKV_LAYOUTS
from megatron_ds.interop.megatron_deepspeed_source import MegatronDeepSpeedSource, check_split
from megatron_ds.training.checkpoint.directory import CONVERTED, CheckpointError
from megatron_ds.training.checkpoint.universal.convert import SUFFIX
from megatron_ds.training.resolve_layout import resolve_layout

SECTION = CONVERTED
"""The metadata section of a converted checkpoint: where it came from (and that its training state
is in universal form only: `rules.topology_changes`)."""


@dataclass
class ImportResult(converted.UpstreamImport):
    qkv_layout: str = BLOCKED
    """How each tensor rank's fused QKV rows were read (`QKV_LAYOUTS`)."""


def import_megatron_deepspeed(
    source: str,
    output: str,
    qkv_layout: str | None = None,
    tokenizer: dict[str, str | None] | None = None,
    show_progress: bool = True,
) -> ImportResult:
    """Convert Megatron-DeepSpeed checkpoint `source` (its --save directory or a global_step directory)
    into `output` (created; never overwritten). `qkv_layout` None: the one its writer used (`written_qkv_layout`)."""
    if qkv_layout is not None and qkv_layout not in QKV_LAYOUTS:
        raise CheckpointError(f"--qkv-layout {qkv_layout}: choose one of {', '.join(QKV_LAYOUTS)}")
    mds = open_megatron_deepspeed(source)
    layout_note = None
    if qkv_layout is None:
        qkv_layout, layout_note = written_qkv_layout(mds)
    tokenizer_flags, note = saved_args.tokenizer_flags(mds, tokenizer or {})
    config = saved_args.config_from_args(mds, tokenizer_flags)
    layout = resolve_layout(config)  # a layout error now, before anything is written
    meta = _meta(mds, config, layout.to_string(), qkv_layout)
    moe = config.model.is_moe
    states = converted.write(
        output,
        mds.tag,
        meta,
        config,
        lambda ours: (MegatronDeepSpeedMoeSource if moe else MegatronDeepSpeedSource)(mds, ours, qkv_layout),
        check_moe if moe else check_split,
        show_progress,
        weight_files=not moe,
    )
    notes = [n for n in (layout_note, note) if n]
    if not states:
        notes.append("no optimizer state in the source: a resume from it starts the optimizer's moments at zero")
    flags = saved_args.render(mds.args, saved_args.MODEL_ARGS) + ["--vocab-size", str(saved_args.vocab_size(mds))]
    flags += saved_args.render(mds.args, saved_args.MOE_ARGS) if moe else []
    flags += tokenizer_flags + saved_args.render(mds.args, saved_args.TRAINING_ARGS)
    return ImportResult(
        os.path.abspath(output), mds.tag, config, meta["train_state"]["iteration"], states, flags, notes, qkv_layout
    )


def written_qkv_layout(mds: MegatronDeepSpeedCheckpoint) -> tuple[str, str | None]:
    """The QKV row order of a checkpoint, and a note when it is not the current release's training order: a
    Hugging Face model written by upstream's `tools/hf2megads_weight_converter.py` (its saved args carry
    `--hf-ckpt-dir`) has its rows per key/value group (`refactor._qkv_refactor`, also at 4efb479, whose model reads
    them blocked); anything else is taken as trained by the current release (blocked)."""
    hf_dir = mds.args.get("hf_ckpt_dir")
    if not hf_dir or mds.args.get("to_hf_ckpt"):
        return BLOCKED, None
    return INTERLEAVED, (
        f"{mds.directory} was written by Megatron-DeepSpeed's tools/hf2megads_weight_converter.py (from {hf_dir}), "
        "which orders each tensor rank's QKV rows per key/value group: read as --qkv-layout interleaved, the Hugging "
        "Face model it converted (Megatron-DeepSpeed's own model at 4efb479 reads them blocked, so its training from "
        "this checkpoint scrambles the attention heads of a rank that holds more than one key/value head)"
    )


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
            "expert_parallel_size": saved_args.expert_parallel_size(mds),
            "checkpoint_version": mds.states.get("checkpoint_version"),
            "ds_version": mds.states.get("ds_version"),
        },
    }
