"""Knowledge distillation from a teacher checkpoint (`DistillationConfig`), as Megatron-DeepSpeed's `--kd`.

The teacher is the GPT of `--load-teacher`'s checkpoint (its own saved architecture; the `--*-teacher` sizes,
when given, must agree with it), run forward without gradients on the student's inputs in training steps only.
The loss of a training step is lm loss + kd loss, where (Megatron-DeepSpeed 4efb479's `calculate_mos_loss`)

    kd loss = T^2 * KLDivLoss(batchmean)(log_softmax(student / T), softmax(teacher / T)) / seq_length * beta

with T = `--kd-temp`, beta = `--kd-beta-ce`, batchmean dividing by the micro-batch size and seq_length the
full `--seq-length` (also under a curriculum's shorter sequences); no loss mask; at T > 1 the full vocabulary's KL
divergence from vocabulary-parallel logits. What the rest of the tree must be for it (pipeline size 1, no
grouped-query attention...) is `Config`'s rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ds.config.checks import check, optional_at_least, positive


@dataclass(frozen=True)
class DistillationConfig:
    """Whether a run distils from a teacher, and how (the knowledge-distillation flags)."""

    kd: bool = False
    """Distil from the teacher of `load_teacher` (`--kd`)."""
    mos: bool = False
    """`--mos` (Megatron-DeepSpeed's mixture of students): the same loss from the same teacher as `kd`, logged as
    `mos loss` (upstream's loss dict; with both flags too), meant for a mixture-of-experts student."""
    load_teacher: str | None = None
    """The teacher's checkpoint: one of ours, weights only (`--load-teacher`); needed with kd."""
    num_layers_teacher: int | None = None
    """The teacher's layers (`--num-layers-teacher`): must equal the checkpoint's; None takes the checkpoint's."""
    hidden_size_teacher: int | None = None
    """The teacher's width (`--hidden-size-teacher`): must equal the checkpoint's; None takes the checkpoint's."""
    num_attention_heads_teacher: int | None = None
    """The teacher's heads (`--num-attention-heads-teacher`): must equal the checkpoint's; None takes its."""
    num_experts_teacher: tuple[int, ...] | None = None
    """The teacher's experts (`--num-experts-teacher`, one count or one per mixture-of-experts layer, as `--num-experts`):
    its experts per layer must equal the checkpoint's; None takes the checkpoint's (a dense or a mixture-of-experts
    teacher)."""
    kd_alpha_ce: float = 1.0
    """`--kd-alpha-ce`: read by Megatron-DeepSpeed but scaling nothing there, nor here (a NOTICE says so)."""
    kd_beta_ce: float = 1.0
    """beta, the factor of the kd loss (`--kd-beta-ce`)."""
    kd_temp: float = 1.0
    """T, the softmax temperature of both distributions; the loss is scaled by T^2 (`--kd-temp`)."""

    def __post_init__(self) -> None:
        for flag, value in (
            ("--num-layers-teacher", self.num_layers_teacher),
            ("--hidden-size-teacher", self.hidden_size_teacher),
            ("--num-attention-heads-teacher", self.num_attention_heads_teacher),
        ):
            optional_at_least(flag, value, 1)
        if self.num_experts_teacher is not None:
            object.__setattr__(self, "num_experts_teacher", tuple(int(n) for n in self.num_experts_teacher))
            check(
                len(self.num_experts_teacher) >= 1 and all(n >= 1 for n in self.num_experts_teacher),
                f"--num-experts-teacher {' '.join(map(str, self.num_experts_teacher))} must be one or more counts >= 1",
            )
        positive("--kd-temp", self.kd_temp)
        check(
            self.kd_beta_ce == self.kd_beta_ce and abs(self.kd_beta_ce) != float("inf"),
            f"--kd-beta-ce {self.kd_beta_ce} is not a finite number; give the kd loss's factor (1 by default)",
        )
        check(
            not self.distils or bool(self.load_teacher),
            f"{self.flag} needs --load-teacher DIR, the teacher's checkpoint (pretrain_gpt.py --save DIR); add it",
        )

    @property
    def distils(self) -> bool:
        """A teacher's loss joins the student's (`--kd` or `--mos`)."""
        return self.kd or self.mos

    @property
    def flag(self) -> str:
        """The flag that asked for it, for messages."""
        return "--mos" if self.mos else "--kd"

    @property
    def loss_name(self) -> str:
        """The loss's name in the log line and TensorBoard: Megatron-DeepSpeed's loss dict key."""
        return "mos loss" if self.mos else "kd loss"
