"""Megatron's learning-rate schedule state (`OptimizerParamScheduler.state_dict()`, saved by both
Megatron-DeepSpeed and Megatron-LM) as our `LRSchedule`'s.

Progress is counted in samples (or, in Megatron-DeepSpeed, tokens) either way; ours stores optimizer
steps, upstream the samples they consumed, so a count that is not a multiple of the global batch
size (a batch-size ramp-up) cannot be continued here.
"""

from __future__ import annotations

from typing import Any

from megatron_ds.config import Config
from megatron_ds.training.checkpoint.directory import CheckpointError
from megatron_ds.training.lr_schedule import SAMPLES, TOKENS


def schedule_state(saved: dict[str, Any], config: Config, where: str) -> dict[str, Any]:
    """`saved` (upstream's scheduler state) as ours; `where` names the checkpoint in errors."""
    gbs = config.training.global_batch_size
    steps, remainder = divmod(int(saved["num_steps"]), gbs)
    if remainder:
        raise CheckpointError(
            f"{where}: its schedule counted {saved['num_steps']} samples, not a multiple of the global batch "
            f"size {gbs} (a batch-size ramp-up?); it cannot be continued here"
        )
    in_tokens = saved.get("lr_decay_tokens") is not None or saved.get("lr_warmup_tokens") is not None
    per_sample = config.model.seq_length if in_tokens else 1
    # A length upstream counts in samples is that many samples' tokens in a schedule counted in tokens
    # (as upstream does itself when its warm-up is in samples and its decay in tokens).
    warmup, decay = saved.get("lr_warmup_tokens"), saved.get("lr_decay_tokens")
    return {
        "num_steps": steps,
        "max_lr": float(saved["max_lr"]),
        "min_lr": float(saved["min_lr"]),
        "decay_style": saved["lr_decay_style"],
        "unit": TOKENS if in_tokens else SAMPLES,
        "warmup": int(warmup if warmup is not None else int(saved["lr_warmup_steps"]) * per_sample),
        "decay": int(decay if decay is not None else int(saved["lr_decay_steps"]) * per_sample),
    }
