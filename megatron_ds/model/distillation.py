"""The knowledge-distillation loss of Megatron-DeepSpeed's `--kd` (its `calculate_mos_loss`, 4efb479): `kd_loss` of
full-vocabulary logits (one tensor rank), `vocab_parallel_kd_loss` of vocabulary-parallel ones (T > 1), the same
full-vocabulary KL divergence."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
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


def vocab_parallel_kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    temperature: float,
    beta: float,
    seq_length: int,
    batch_size: int,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """`kd_loss` of the full vocabulary from vocabulary-parallel logits: each tensor rank of `group` holds its
    shard (.., v/T) of the student's and the teacher's logits, in the same token layout ((b, s) or sequence-first
    (s, b)); `batch_size` is b, the divisor of `batchmean`. The same value on every rank of `group`; the gradient
    flows to this rank's student shard only, as megatron-core's `vocab_parallel_cross_entropy` does for the lm loss.

    Megatron-DeepSpeed 4efb479 takes the softmax over each rank's shard instead (a sum of per-shard KLs); not that."""
    assert student_logits.shape == teacher_logits.shape, (student_logits.shape, teacher_logits.shape)
    kl_sum = _VocabParallelKL.apply(student_logits, teacher_logits.detach(), temperature, group)
    return kl_sum * (temperature * temperature) / batch_size / seq_length * beta


class _VocabParallelKL(torch.autograd.Function):
    """sum over tokens of KL(softmax(teacher / T) || softmax(student / T)) over the whole vocabulary, from shards.

    Per token, with a = student / T, b = teacher / T, Z_x = sum_v exp(x_v - max x):
        KL = sum_v q_v (b_v - a_v) - (max b + log Z_b) + (max a + log Z_a),    q = exp(b - max b) / Z_b,
    so two all-reduces over the tensor group suffice: the maxima (MAX), then Z_a, Z_b and sum_v exp(b_v - max b)
    (b_v - a_v) (SUM). The token sum is the same on every rank. d KL / d a = softmax(a) - q, this rank's part of
    it saved from the forward (no collective in the backward)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, student: torch.Tensor, teacher: torch.Tensor, temperature: float, group: dist.ProcessGroup | None
    ) -> torch.Tensor:
        a = student.float() / temperature  # (.., v/T)
        b = teacher.float() / temperature
        maxima = torch.stack([a.max(dim=-1).values, b.max(dim=-1).values])  # (2, ..)
        _all_reduce(maxima, dist.ReduceOp.MAX, group)
        exp_a = torch.exp(a - maxima[0].unsqueeze(-1))
        exp_b = torch.exp(b - maxima[1].unsqueeze(-1))
        sums = torch.stack([exp_a.sum(dim=-1), exp_b.sum(dim=-1), (exp_b * (b - a)).sum(dim=-1)])  # (3, ..)
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        z_a, z_b, cross = sums
        kl = cross / z_b - (maxima[1] + torch.log(z_b)) + (maxima[0] + torch.log(z_a))  # per token
        grad = exp_a.div_(z_a.unsqueeze(-1)).sub_(exp_b.div_(z_b.unsqueeze(-1)))  # softmax(a) - q on this shard
        ctx.save_for_backward(grad)
        ctx.temperature = temperature
        ctx.dtype = student.dtype
        return kl.sum()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return (grad * (grad_output / ctx.temperature)).to(ctx.dtype), None, None, None


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
