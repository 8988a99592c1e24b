"""Import a Megatron-LM checkpoint (megatron-core `GPTModel`, `--ckpt-format torch_dist` or `torch`) as
ours: its weights, Adam's state, its iteration, counters and learning-rate schedule.

    from megatron_ds.interop.megatron_lm import import_megatron_lm
    result = import_megatron_lm("mlm/checkpoints", "checkpoints/converted")

The output is what `converted.write` writes (our weight files at the source's T, the universal form
a `--load` resumes from under any layout). Adam's state and the fp32 master weights convert from
torch_dist checkpoints, named by model tensor (`optimizer.state.exp_avg.<tensor>`: Megatron-LM without
--use-distributed-optimizer, or with --dist-ckpt-optim-fully-reshardable) or in the distributed
optimizer's default `dp_reshardable` buckets, and from `torch` checkpoints of the distributed optimizer
(`distrib_optim.pt`; the buffers are placed by `megatron_lm_buckets`) or without it (torch's state by
parameter number, `megatron_lm_torch_optimizer`); the reader is `megatron_lm_source.MegatronLMSource`. State that
does not match the weights does not convert (the notice says why): a resume then starts Adam's moments at zero and
takes the model's weights (bf16 in a bf16 run) as its fp32 master weights. A mixture-of-experts run (Megatron-LM's
router and experts; `megatron_lm_layout`) is written as its universal form alone, as an imported Mixtral: our
per-spec weight files hold no experts; its Adam's state converts where named by tensor, not from megatron-core's
ChainedOptimizer's buffers or `torch` files. The source is only read (`megatron_lm_files`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from megatron_ds.config import Config
from megatron_ds.interop import converted
from megatron_ds.interop import megatron_lm_args as saved_args
from megatron_ds.interop.megatron_lm_files import (
    MegatronLMCheckpoint,
    open_megatron_lm,
)
from megatron_ds.interop.megatron_lm_source import MegatronLMSource, check_names
from megatron_ds.training.checkpoint import reader
from megatron_ds.training.checkpoint.directory import CONVERTED
from megatron_ds.training.checkpoint.universal.convert import SUFFIX
from megatron_ds.training.resolve_layout import resolve_layout

RESTART = "a resume from it starts Adam's moments at zero, with the model's weights as the fp32 master weights"


@dataclass
class ImportResult(converted.UpstreamImport):
    source: MegatronLMCheckpoint | None = None
    """The checkpoint as read (its format and directory, for the tool's summary)."""


def import_megatron_lm(
    source: str, output: str, tokenizer: dict[str, str | None] | None = None, show_progress: bool = True
) -> ImportResult:
    """Convert Megatron-LM checkpoint `source` (its --save directory or an iter_NNNNNNN directory) into
    `output` (created; never overwritten)."""
    mlm = open_megatron_lm(source)
    tokenizer_flags, note = saved_args.tokenizer_flags(mlm, tokenizer or {})
    config = saved_args.config_from_args(mlm, tokenizer_flags)
    layout = resolve_layout(config)  # a layout error now, before anything is written
    tag = f"global_step{mlm.iteration}"
    meta = _meta(mlm, config, layout.to_string(), tag)
    sources: list[MegatronLMSource] = []

    def source_for(ours: reader.Checkpoint) -> MegatronLMSource:
        sources.append(MegatronLMSource(mlm, ours))
        return sources[-1]

    # a mixture-of-experts model's weights are in the universal form alone (our per-spec files hold no experts)
    moe = config.model.is_moe
    states = converted.write(output, tag, meta, config, source_for, check_names, show_progress, weight_files=not moe)
    notes = [note] if note else []
    if saved_args.placeholders(mlm):
        notes.append(
            "its args hold no training length or learning rate (a converted model?): give --train-iters and --lr "
            "when training from it"
        )
    if not states:
        reason = sources[-1].absence if sources and sources[-1].absence else optimizer_absence(mlm)
        notes.append(f"{reason}: {RESTART}")
    # printed as at our default T=1 (at another T the --load error says what to give)
    printed = saved_args.padded_at_t1(mlm)
    flags = saved_args.render(printed, saved_args.MODEL_ARGS) + saved_args.moe_flags(mlm.args) + tokenizer_flags
    flags += saved_args.render(mlm.args, saved_args.TRAINING_ARGS)
    flags += ["--data-upstream", "megatron-lm"]  # its data files split and blended as Megatron-LM does
    return ImportResult(os.path.abspath(output), tag, config, mlm.iteration, states, flags, notes, source=mlm)


def optimizer_absence(mlm: MegatronLMCheckpoint) -> str:
    """Why a checkpoint's optimizer state does not convert."""
    return "it holds no optimizer state (saved with --no-save-optim or before the first step)"


def _meta(mlm: MegatronLMCheckpoint, config: Config, layout: str, tag: str) -> dict[str, Any]:
    return {
        "config": config.to_dict(),
        "train_state": saved_args.train_state(mlm, config),
        "layout": layout,
        "world_size": config.parallel.tensor_model_parallel_size,
        "format": 1,
        CONVERTED: {
            "source": mlm.directory,
            "upstream": "megatron-lm",
            "vocab_size": saved_args.tokenizer_vocab_size(mlm),
            "ckpt_format": mlm.format,
            "universal": tag + SUFFIX,
            "tensor_model_parallel_size": mlm.tensor_parallel,
            "pipeline_model_parallel_size": mlm.pipeline_parallel,
            "precision": mlm.precision,
            "checkpoint_version": mlm.states.get("checkpoint_version"),
        },
    }
