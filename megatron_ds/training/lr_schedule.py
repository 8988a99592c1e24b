"""Learning-rate schedule with Megatron's semantics: linear warm-up, then decay to min_lr.

Progress is counted in samples, as Megatron's OptimizerParamScheduler does (one optimizer step
adds the global batch size), or in tokens (samples x seq_length) when a token-based flag
(`--lr-warmup-tokens`, `--lr-decay-tokens`) is given. Iteration-, sample- and token-based flags
are all converted to that one unit, so a schedule given in iterations and the same schedule given
in samples or tokens produce bit-identical learning rates. With p the progress, W the warm-up and
D the decay length (same unit):

lr(p) = lr * p / W                                               for p <= W
      = min_lr + (lr - min_lr) * f((p - W) / (D - W))            for W < p <= D
      = min_lr                                                   after D
with f = 1 (constant), 1 - x (linear) or (cos(pi x) + 1) / 2 (cosine);
inverse-square-root: max(min_lr, lr * sqrt(max(W, 1) / max(p, 1))) after the warm-up, min_lr after D.
p counts the samples (or tokens) of the optimizer steps already taken (so with warm-up the first
step has lr 0): the loop tells the schedule what each step consumes (`set_next_step`), so a batch
size ramp-up and a sequence-length curriculum move it by what they really consume (Megatron-DeepSpeed
counts the curriculum's shortened tokens too). DeepSpeed calls `step()` after each optimizer step and
stores `state_dict()` in checkpoints.

The weight decay follows Megatron's OptimizerParamScheduler too: constant, or linear / cosine from
start to end over `wd_incr` samples (groups with `wd_mult` 0, biases and norms, keep 0). Megatron-LM's
`--decoupled-lr` gives the groups marked `decoupled` the same shape between their own peak and floor.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from megatron_ds.config import Config, OptimizerConfig
from megatron_ds.errors import UserError

SAMPLES, TOKENS = "samples", "tokens"


class LRScheduleError(UserError):
    """The checkpoint's schedule differs from the flags' and no flag says which one wins."""


@dataclass(frozen=True)
class Schedule:
    """A schedule in one unit of progress: `samples` or `tokens`."""

    max_lr: float
    min_lr: float
    decay_style: str
    unit: str
    warmup: float
    """Warm-up length, in `unit` (fractional from --lr-warmup-fraction, as Megatron keeps it)."""
    decay: int
    """Position (in `unit`) where the decay reaches min_lr."""
    wd_incr_style: str = "constant"
    """`constant`, `linear` or `cosine` (Megatron's weight_decay_incr_style)."""
    start_wd: float = 0.0
    end_wd: float = 0.0
    wd_incr: int = 0
    """Samples over which the weight decay goes from start_wd to end_wd (unused when constant)."""
    decoupled_max_lr: float | None = None
    """Peak of the `decoupled` groups (Megatron-LM's --decoupled-lr), None without them."""
    decoupled_min_lr: float | None = None


def build_schedule(opt: OptimizerConfig, train_iters: int, global_batch_size: int, seq_length: int) -> Schedule:
    """The schedule the optimizer config describes, in samples, or in tokens if any bound is in tokens."""
    unit, warmup, decay = opt.schedule_lengths(train_iters, global_batch_size, seq_length)
    # A constant weight decay stays with the optimizer groups (and out of the compared schedule).
    start_wd, end_wd = opt.weight_decay_range() if opt.weight_decay_incr_style != "constant" else (0.0, 0.0)
    return Schedule(
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        decay_style=opt.lr_decay_style,
        unit=unit,
        warmup=warmup,
        decay=int(decay),
        wd_incr_style=opt.weight_decay_incr_style,
        start_wd=start_wd,
        end_wd=end_wd,
        wd_incr=opt.weight_decay_incr_samples if opt.weight_decay_incr_style != "constant" else 0,
        decoupled_max_lr=opt.decoupled_lr,
        decoupled_min_lr=None if opt.decoupled_lr is None else opt.decoupled_min_lr or opt.min_lr,
    )


def weight_decay(s: Schedule, samples: int) -> float:
    """Megatron's `get_wd` after `samples` samples."""
    if s.wd_incr_style == "constant" or samples > s.wd_incr:
        return s.end_wd
    ratio = samples / s.wd_incr
    coeff = ratio if s.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
    return s.start_wd + coeff * (s.end_wd - s.start_wd)


def decoupled(s: Schedule) -> Schedule:
    """The schedule of the decoupled groups: the same shape between their own peak and floor."""
    assert s.decoupled_max_lr is not None and s.decoupled_min_lr is not None
    return dataclasses.replace(s, max_lr=s.decoupled_max_lr, min_lr=s.decoupled_min_lr)


def learning_rate(s: Schedule, progress: int) -> float:
    """The learning rate after `progress` samples or tokens (the schedule's unit)."""
    # Ratios are formed before scaling: ints divide exactly-rounded, so a schedule in samples or
    # tokens gives the very same floats as the same schedule in iterations.
    if s.warmup > 0 and progress <= s.warmup:
        return s.max_lr * (progress / s.warmup)
    if s.decay_style == "constant":
        return s.max_lr
    if progress > s.decay:  # Megatron tests this before the decay style (inverse-square-root too)
        return s.min_lr
    if s.decay_style == "inverse-square-root":
        return max(s.min_lr, s.max_lr * math.sqrt(max(s.warmup, 1) / max(progress, 1)))
    x = (progress - s.warmup) / (s.decay - s.warmup)
    factor = 1.0 - x if s.decay_style == "linear" else 0.5 * (math.cos(math.pi * x) + 1.0)
    return s.min_lr + (s.max_lr - s.min_lr) * factor


class LRSchedule:
    """Sets each parameter group's lr (and a scheduled weight decay); its state is the steps taken,
    the samples and tokens they consumed, and the schedule itself.

    On `load_state_dict` the checkpoint's schedule is compared with this one (Megatron's rule):
    `override` keeps this one, `use_checkpoint` takes the checkpoint's, and with neither a
    difference is an `LRScheduleError`. `load_state=False` (`--no-load-lr-state`) ignores the
    checkpoint's state altogether: the schedule starts again from step 0.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        schedule: Schedule,
        global_batch_size: int,
        seq_length: int,
        override: bool = False,
        use_checkpoint: bool = False,
        load_state: bool = True,
    ) -> None:
        assert not (override and use_checkpoint), "validation refuses both"
        self.optimizer, self.schedule = optimizer, schedule
        self.global_batch_size, self.seq_length = global_batch_size, seq_length
        self.override, self.use_checkpoint, self.load_state = override, use_checkpoint, load_state
        self.num_steps = self.samples = self.tokens = 0
        self._next = (global_batch_size, global_batch_size * seq_length)
        self._apply()

    @classmethod
    def from_config(cls, optimizer: torch.optim.Optimizer, config: Config) -> LRSchedule:
        o, t = config.optimizer, config.training
        schedule = build_schedule(o, t.train_iters, t.global_batch_size, config.model.seq_length)
        return cls(
            optimizer,
            schedule,
            t.global_batch_size,
            config.model.seq_length,
            override=o.override_opt_param_scheduler,
            use_checkpoint=o.use_checkpoint_opt_param_scheduler,
            load_state=not config.checkpoint.no_load_lr_state,
        )

    def set_next_step(self, samples: int, tokens: int) -> None:
        """What the next optimizer step consumes (its global batch, and the tokens of that batch)."""
        self._next = (samples, tokens)

    def progress(self) -> int:
        """Samples or tokens (the schedule's unit) consumed by the steps taken."""
        return self.tokens if self.schedule.unit == TOKENS else self.samples

    def _apply(self) -> None:
        s, progress = self.schedule, self.progress()
        lr = learning_rate(s, progress)
        other = learning_rate(decoupled(s), progress) if s.decoupled_max_lr is not None else lr
        wd = weight_decay(s, self.samples) if s.wd_incr_style != "constant" else None
        for group in self.optimizer.param_groups:
            group["lr"] = other if group.get("decoupled") else lr
            if wd is not None:
                group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        return self.get_lr()

    def step(self, increment: int = 1, **_: Any) -> None:
        samples, tokens = self._next
        self.num_steps += increment
        self.samples += increment * samples
        self.tokens += increment * tokens
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        counters = {"num_steps": self.num_steps, "samples": self.samples, "tokens": self.tokens}
        return {**counters, **dataclasses.asdict(self.schedule)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.load_state:
            return  # --no-load-lr-state: this run's fresh schedule stands
        self.num_steps = int(state["num_steps"])
        # States written before the counters existed come from fixed-size steps.
        self.samples = int(state.get("samples", self.num_steps * self.global_batch_size))
        self.tokens = int(state.get("tokens", self.samples * self.seq_length))
        names = {f.name for f in dataclasses.fields(Schedule)}
        saved = Schedule(**{k: v for k, v in state.items() if k in names})
        self.schedule = self._reconcile(saved)
        self._apply()

    def _reconcile(self, saved: Schedule) -> Schedule:
        if self.override:
            return self.schedule
        if self.use_checkpoint:
            return saved
        diffs = schedule_differences(saved, self.schedule, self.seq_length)
        if diffs:
            raise LRScheduleError(
                f"the checkpoint's learning-rate schedule differs from the flags': {'; '.join(diffs)}; pass "
                f"--override-opt_param-scheduler to use the flags' schedule or "
                f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's"
            )
        return self.schedule


def schedule_differences(saved: Schedule, ours: Schedule, seq_length: int) -> list[str]:
    """'name saved (checkpoint) vs ours (flags)' for each differing field.

    Lengths are compared in the schedules' unit, or in tokens when one is in samples and the
    other in tokens (a schedule may be given either way)."""
    unit = saved.unit if saved.unit == ours.unit else TOKENS

    def length(s: Schedule, name: str) -> int:
        value = getattr(s, name)
        return value * seq_length if s.unit == SAMPLES and unit == TOKENS else value

    diffs = []
    for name, a, b in (
        ("lr", saved.max_lr, ours.max_lr),
        ("min_lr", saved.min_lr, ours.min_lr),
        ("decay style", saved.decay_style, ours.decay_style),
        ("weight decay style", saved.wd_incr_style, ours.wd_incr_style),
        ("start weight decay", saved.start_wd, ours.start_wd),
        ("end weight decay", saved.end_wd, ours.end_wd),
        ("weight decay samples", saved.wd_incr, ours.wd_incr),
        ("decoupled lr", saved.decoupled_max_lr, ours.decoupled_max_lr),
        ("decoupled min lr", saved.decoupled_min_lr, ours.decoupled_min_lr),
    ):
        if a != b:
            diffs.append(f"{name} {a} (checkpoint) vs {b} (flags)")
    for name in ("warmup", "decay"):
        a, b = length(saved, name), length(ours, name)
        if a != b:
            diffs.append(f"{name} {a} {unit} (checkpoint) vs {b} {unit} (flags)")
    return diffs
