"""The knowledge-distillation loss of Megatron-DeepSpeed's `--kd` (its `calculate_mos_loss`, 4efb479)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    temperature: float,
    beta: float,
    seq_length: int,
) -> torch.Tensor:
    """T^2 * KL(softmax(teacher / T) || softmax(student / T)), summed over tokens and vocabulary and divided by
    the micro-batch size (torch's `KLDivLoss(reduction="batchmean")` on (b, s, v)), / `seq_length` * `beta`.

    Logits are (b, s, v), the full vocabulary; no loss mask (every position counts, as upstream). `seq_length`
    is the run's `--seq-length` even when a curriculum gives shorter sequences (upstream divides by
    `args.seq_length`). Gradients flow to the student only."""
    assert student_logits.shape == teacher_logits.shape, (student_logits.shape, teacher_logits.shape)
    log_student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    teacher = F.softmax(teacher_logits.detach().float() / temperature, dim=-1)
    kl = F.kl_div(log_student, teacher, reduction="batchmean")
    return kl * (temperature * temperature) / seq_length * beta
