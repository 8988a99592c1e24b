"""Run state: what changes as training goes (kept out of the frozen config)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    """Progress of a run; saved in every checkpoint."""

    iteration: int = 0
    """Optimizer steps taken."""
    consumed_train_samples: int = 0
    """Global training samples consumed; the data order resumes from here."""
    consumed_valid_samples: int = 0
    """Validation samples consumed by evaluations so far."""
    consumed_train_tokens: int = 0
    """Training tokens consumed (samples x the tokens each step kept: a curriculum shortens them);
    checkpoints written before the field existed count samples x --seq-length."""
    floating_point_operations_so_far: float = 0.0
    """Model FLOPs of every training step so far (Megatron-LM's `num_floating_point_operations_so_far`, what
    `--log-progress` reports); checkpoints written before the field existed count consumed samples x the FLOPs
    of one sample at --seq-length."""
