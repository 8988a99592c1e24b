"""What may change between a checkpoint and the run that loads it, and what may not.

Free: dropout and init std (a notice), and the whole parallel layout: P, the stage split, T, DP, sequence parallelism
(Megatron's: as saved; Ulysses' degree N), ZeRO stage, offload, CPU Adam and precision (`topology_changes`; a full
resume then goes through the universal form, `megatron_ds.training.checkpoint.universal`; a mixture-of-experts model's
world size, expert-parallel size and ZeRO stage 0-2 too, saved at any P). Refused with one line: another
architecture, and for a full resume another global batch size or optimizer; a mixture-of-experts checkpoint saved at
P > 1 in --fp16 without ZeRO under another topology (`moe_pipeline_refusal`); a mixture-of-experts checkpoint in the
per-spec weight readers (`moe_refusal`; the Hugging Face export, generation, inference and a `--kd` teacher read its
per-expert files). Pure: no torch.distributed.
"""

from __future__ import annotations

from typing import Any

from megatron_ds.config import Config
from megatron_ds.config.experts import MOE_ROUTING_FIELDS
from megatron_ds.pipeline.layout import Layout
from megatron_ds.training.checkpoint.directory import CheckpointError, converted_from

WEIGHT_FREE_FIELDS = (
    "seq_length",
    "layernorm_epsilon",
    "rotary_base",
    "rotary_percent",
    "use_rope_scaling",
    "rope_scaling_factor",
    *MOE_ROUTING_FIELDS,
)
"""Architecture fields that shape no weight: a run may load the checkpoint with other values, as Megatron's
checkpoint-argument check does not compare them (fine-tuning at another context length, a longer rope base);
`max_position_embeddings` too when neither model has a position table. A resume prints the change
(`weight_free_notice`). (Dropout and init std are not architecture at all: `regularization_changes`.)"""


def _weight_free(theirs: dict[str, Any], ours: dict[str, Any]) -> tuple[str, ...]:
    no_table = not theirs.get("add_position_embedding", True) and not ours.get("add_position_embedding", True)
    return WEIGHT_FREE_FIELDS + (("max_position_embeddings",) if no_table else ())


def is_weights_only(meta: dict[str, Any]) -> bool:
    """The checkpoint holds model weights only (no optimizer, schedule or RNG state)."""
    return bool(meta.get("weights_only", False))


def has_optimizer_state(meta: dict[str, Any]) -> bool:
    """The checkpoint holds the optimizer and lr-schedule state (not `--no-save-optim`, not weights only)."""
    return not is_weights_only(meta) and bool(meta.get("optimizer_state", True))


def moe_refusal(meta: dict[str, Any], where: str) -> str | None:
    """Why the per-spec weight readers refuse a mixture-of-experts checkpoint (None for a dense one): its experts are
    in DeepSpeed's files. What reads it is said in the same line: the Hugging Face export (as Mixtral or Qwen3-MoE),
    generation and inference (`moe_weights`), a resume under any P, layout, world size, expert-parallel size and ZeRO
    stage 0-2 (through the universal form, `universal.moe_source` and `universal.moe_pipeline_source`), the conversion
    itself, and its weights alone (`--no-load-optim`); saved at P > 1 in --fp16 without ZeRO, a resume under its own
    topology only (`moe_pipeline_refusal`)."""
    saved = Config.from_dict(meta["config"])
    model = saved.model
    if not model.is_moe:
        return None
    experts = " ".join(map(str, model.num_experts))
    fp16_staged = (
        saved.parallel.pipeline_model_parallel_size > 1
        and saved.training.precision == "fp16"
        and saved.training.zero_stage == 0
        and converted_from(meta) is None
    )
    resumes = (
        f"pretrain_gpt.py --load resumes it (or takes its weights alone with --no-load-optim) under the layout "
        f"({meta.get('layout')}) and sizes it was saved with"
        if fp16_staged
        else "pretrain_gpt.py --load resumes it under any pipeline size, layout, world size, --moe-expert-parallel-size "
        "and ZeRO stage 0-2 (through its universal form, which `tools/convert_checkpoint.py --to universal` also "
        "writes), or takes its weights alone with --no-load-optim"
    )
    return (
        f"{where}: a mixture-of-experts checkpoint (--num-experts {experts}), whose experts are in DeepSpeed's files, "
        f"which the per-spec weight readers do not read; tools/convert_checkpoint.py --to hf writes it as Mixtral or "
        f"Qwen3-MoE (SwiGLU experts on every layer; --topk 2, or Megatron-LM's router at any --moe-router-topk), "
        f"tools/generate.py and inference.load_model read it (a --kd teacher too); {resumes}"
    )


def universal_refusal(meta: dict[str, Any], where: str) -> str | None:
    """Why the checkpoint has no universal form (None when it has one; a mixture-of-experts checkpoint's reader
    refuses what it does not read itself: `universal.moe_source`, `universal.moe_pipeline_source`)."""
    if not has_optimizer_state(meta):
        return f"{where}: holds weights only (no optimizer state); it loads under any layout as it is"
    saved = Config.from_dict(meta["config"])
    if saved.optimizer.decoupled_lr is not None:
        return (
            f"{where} was trained with --decoupled-lr, whose third optimizer group the universal form does not "
            f"hold; resume it under the layout, T, DP and ZeRO stage it was saved with (bf16 needs ZeRO 1 there), "
            f"or --no-load-optim to take its weights"
        )
    return None


def architecture_mismatch(saved: dict[str, Any], config: Config) -> list[str]:
    """Architecture (`ModelConfig`) fields that differ between a checkpoint's config and this run's.

    Regularization (dropout, init std) is not architecture: see `regularization_changes`.
    """
    theirs, ours = _models(saved, config)
    free = _weight_free(theirs, ours)
    return [
        f"{k} {theirs.get(k)!r} (checkpoint) vs {v!r} (now)"
        for k, v in ours.items()
        if theirs.get(k) != v and k not in free
    ]


def _models(saved: dict[str, Any], config: Config) -> tuple[dict[str, Any], dict[str, Any]]:
    # Through from_dict, fields added after the checkpoint was written take their defaults.
    return Config.from_dict(saved["config"]).to_dict()["model"], config.to_dict()["model"]


def weight_free_notice(saved: dict[str, Any], config: Config, load_dir: str, tag: str) -> str | None:
    """The one-line notice of a resume that changes fields which shape no weight (None for an import: a
    weights-only checkpoint was not trained here)."""
    theirs, ours = _models(saved, config)
    changes = [f"{k} {theirs.get(k)!r} -> {ours[k]!r}" for k in _weight_free(theirs, ours) if theirs.get(k) != ours[k]]
    if not changes or is_weights_only(saved):
        return None
    return (
        f"NOTICE: --load {load_dir} ({tag}): {'; '.join(changes)}: these shape no weight, so the checkpoint loads "
        f"and trains on with the new values (Megatron does not compare them)"
    )


def vocabulary_notice(saved: dict[str, Any], config: Config, load_dir: str, tag: str) -> str | None:
    """The padded rows match (the architecture check), but the tokens among them differ: rows the checkpoint trained
    as tokens become padding here, or the reverse (an export cuts the vocabulary at this run's size)."""
    theirs = Config.from_dict(saved["config"]).data.unpadded_vocab_size
    ours = config.data.unpadded_vocab_size
    if theirs is None or ours is None or theirs == ours:
        return None
    return (
        f"NOTICE: --load {load_dir} ({tag}) recorded a vocabulary of {theirs} tokens, this run {ours} (both padded to "
        f"{config.model.vocab_size} rows): rows {min(theirs, ours)}-{max(theirs, ours) - 1} change between token and "
        f"padding, and later exports keep {ours}"
    )


def regularization_changes(saved: dict[str, Any], config: Config) -> list[str]:
    """`RegularizationConfig` fields this run changes relative to the checkpoint (allowed on resume)."""
    ours = config.to_dict()["regularization"]
    theirs = Config.from_dict(saved["config"]).to_dict()["regularization"]
    return [f"{k} {theirs[k]!r} -> {v!r}" for k, v in ours.items() if theirs[k] != v]


def regularization_notice(saved: dict[str, Any], config: Config, load_dir: str, tag: str) -> str | None:
    """The one-line notice printed on resume when dropout or init std differ from the checkpoint's."""
    changes = regularization_changes(saved, config)
    if not changes:
        return None
    return f"NOTICE: --load {load_dir} ({tag}): regularization differs from the checkpoint's: {'; '.join(changes)}"


def vocabulary_hint(saved: Config, config: Config) -> str:
    """Why the padded vocabulary differs when only T changed: `--make-vocab-size-divisible-by` pads to a
    multiple of that x T, so keep the padded rows with a divisor that gives the checkpoint's size."""
    t_saved, t = saved.parallel.tensor_model_parallel_size, config.parallel.tensor_model_parallel_size
    if saved.model.vocab_size == config.model.vocab_size or t_saved == t:
        return ""
    return (
        f" (the padded vocabulary follows --make-vocab-size-divisible-by x --tensor-model-parallel-size; at T={t} "
        f"choose --make-vocab-size-divisible-by so that the padded size stays {saved.model.vocab_size})"
    )


def check_compatible(meta: dict[str, Any], config: Config, load_dir: str, tag: str) -> None:
    """Refuse a checkpoint this run cannot continue from (one line naming the difference and the fix)."""
    saved = Config.from_dict(meta["config"])
    mismatch = architecture_mismatch(meta, config)
    if mismatch:
        raise CheckpointError(
            f"--load {load_dir} ({tag}) has another architecture: {'; '.join(mismatch)}; "
            f"use matching model flags or another --load directory{vocabulary_hint(saved, config)}"
        )
    ck = config.checkpoint
    if ck.no_load_optim or ck.finetune or not has_optimizer_state(meta):
        return
    a, b = saved.training.global_batch_size, config.training.global_batch_size
    if a != b:
        raise CheckpointError(
            f"--load {load_dir} ({tag}) was trained with --global-batch-size {a}, this run uses {b}: the data "
            f"position, learning-rate schedule and dropout masks count in its batches; use --global-batch-size {a}, "
            f"or --finetune to start a new run from its weights"
        )
    a, b = saved.optimizer.optimizer, config.optimizer.optimizer
    if a != b:
        raise CheckpointError(
            f"--load {load_dir} ({tag}) holds {a}'s optimizer state, this run uses --optimizer {b}; use "
            f"--optimizer {a}, or --no-load-optim to load the weights only"
        )
    a, b = saved.optimizer.decoupled_lr is not None, config.optimizer.decoupled_lr is not None
    if a != b:
        with_, without = ("with", "without") if a else ("without", "with")
        raise CheckpointError(
            f"--load {load_dir} ({tag}) was trained {with_} --decoupled-lr and this run is {without} it: the "
            f"optimizer groups differ; {'give' if a else 'drop'} --decoupled-lr, or --no-load-optim to load the "
            f"weights only"
        )


def moe_pipeline_refusal(meta: dict[str, Any], config: Config, changes: list[str], where: str) -> str | None:
    """Why a mixture-of-experts checkpoint cannot load here (None when it can). Under another topology every one goes
    through the universal form (saved at P > 1: DeepSpeed's per-stage files, `universal.moe_pipeline_source`), but
    for one saved at P > 1 in --fp16 without ZeRO (DeepSpeed's FP16_Optimizer, whose state the universal form does not
    read), which loads under the topology it was saved with only. `changes`: `topology_changes`."""
    saved = Config.from_dict(meta["config"])
    if not changes or changes == ["universal form"] or converted_from(meta) is not None:
        return None
    fp16_unpartitioned = saved.training.precision == "fp16" and saved.training.zero_stage == 0
    if not (saved.model.is_moe and saved.parallel.pipeline_model_parallel_size > 1 and fp16_unpartitioned):
        return None
    return (
        f"{where}: a mixture-of-experts --fp16 checkpoint saved at pipeline size "
        f"{saved.parallel.pipeline_model_parallel_size} without ZeRO (DeepSpeed's FP16_Optimizer, whose state does not "
        f"convert to the universal form) loads under the topology it was saved with only, but {'; '.join(changes)}; "
        f"use the saved layout ({meta.get('layout')}), sizes, ZeRO stage and precision"
    )


def topology_changes(meta: dict[str, Any], config: Config, layout: Layout, world_size: int) -> list[str]:
    """How this run's parallel layout differs from the checkpoint's ([] when DeepSpeed can load it as saved)."""
    saved = Config.from_dict(meta["config"])
    diffs = []
    upstream = converted_from(meta)
    if upstream is not None:  # its training state exists in universal form only
        diffs.append(f"{upstream} (converted: its training state is in universal form)")
    if meta.get("layout") != layout.to_string():
        diffs.append(f"layout {meta.get('layout')} vs {layout.to_string()}")
    if meta.get("world_size") != world_size:
        diffs.append(f"world size {meta.get('world_size')} vs {world_size}")
    # Megatron's sequence parallelism changes no parameter and no partition: DeepSpeed loads it as saved
    for name in (
        "tensor_model_parallel_size",
        "data_parallel_size",
        "ds_sequence_parallel_size",
        "expert_parallel_size",
    ):
        a, b = getattr(saved.parallel, name), getattr(config.parallel, name)
        if a != b:
            diffs.append(f"{name} {a} vs {b}")
    if saved.training.zero_stage != config.training.zero_stage:
        diffs.append(f"zero stage {saved.training.zero_stage} vs {config.training.zero_stage}")
    if saved.training.precision != config.training.precision:
        diffs.append(f"precision {saved.training.precision} vs {config.training.precision}")
    # DeepSpeed's CPU Adam keeps its step count as an int, torch's AdamW as a tensor, and neither reads the
    # other's back; offload moves the optimizer's tensors: both go through the universal form
    a, b = saved.training, config.training
    if a.cpu_optimizer != b.cpu_optimizer:
        diffs.append(f"CPU Adam {a.cpu_optimizer} vs {b.cpu_optimizer}")
    if (a.optimizer_offload, a.offload_param) != (b.optimizer_offload, b.offload_param):
        diffs.append(f"offload {a.optimizer_offload}/{a.offload_param} vs {b.optimizer_offload}/{b.offload_param}")
    return diffs


def precision_notice(meta: dict[str, Any], config: Config, load_dir: str, tag: str) -> str | None:
    """The notice for a full resume in another precision (fp32 masters and moments carry over)."""
    a, b = Config.from_dict(meta["config"]).training.precision, config.training.precision
    if a == b:
        return None
    return (
        f"NOTICE: --load {load_dir} ({tag}) was trained in {a}, this run trains in {b}: the fp32 master weights "
        f"and optimizer moments carry over, the steps from here compute in {b}"
    )


def deepspeed_cannot_restore(config: Config) -> bool:
    """DeepSpeed 0.19.8's BF16_Optimizer (bf16 without ZeRO on the pipeline engine) fails to read its own optimizer
    state back (KeyError in `_load_legacy_checkpoint`): such a resume goes through the universal form instead. The
    plain engine wraps torch's optimizer in FP16_UnfusedOptimizer there, which reads its state back."""
    t = config.training
    return t.precision == "bf16" and t.zero_stage == 0 and config.engine_kind == "pipeline"
