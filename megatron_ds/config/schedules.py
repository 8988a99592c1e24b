"""What changes step by step in a run: the sequence-length curriculum (`CurriculumConfig`) and the
global batch size schedule (`rampup_batch_size`, `step_batch_size_schedule`).

Both are pure functions of the step (1-based) or of the samples consumed before it, so the length
of training, the learning-rate progress and a resume all follow from the config alone:

- the curriculum is DeepSpeed's legacy `curriculum_learning` section as Megatron-DeepSpeed runs it
  (`deepspeed.runtime.data_pipeline.curriculum_scheduler.CurriculumScheduler`, which its
  `megatron/training.py` asks for `update_difficulty(iteration + 1)` before every step);
- the batch schedule is Megatron-DeepSpeed's `--rampup-batch-size START INCREMENT SAMPLES`
  (`megatron/microbatches.py`, `RampupBatchsizeNumMicroBatches`) or Megatron-LM's
  `--step-batch-size-schedule` (`megatron/core/num_microbatches_calculator.py`,
  `StepBatchsizeNumMicroBatchesCalculator`), both asked for the batch size of the samples consumed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megatron_ds.config.checks import check
from megatron_ds.errors import ConfigError

CURRICULUM_SCHEDULES = ("fixed_linear", "fixed_root", "fixed_discrete")
"""DeepSpeed's legacy schedule types; `custom` needs a Python function and is refused."""
CURRICULUM_KEY = "curriculum_learning"
"""The DeepSpeed JSON section `CurriculumConfig.from_json` reads."""


@dataclass(frozen=True)
class CurriculumConfig:
    """DeepSpeed's legacy sequence-length curriculum (`curriculum_learning` in `--deepspeed_config`,
    `curriculum_type` `seqlen`): each training batch is cut to `seq_length(step)` tokens (the
    pipeline's activation shapes are reset whenever that changes); evaluation runs at full length."""

    schedule_type: str
    """`fixed_linear`, `fixed_root` or `fixed_discrete`."""
    min_difficulty: int
    """The first sequence length."""
    max_difficulty: int
    """The last one; once reached, the length stays there (DeepSpeed's `update_difficulty`)."""
    total_curriculum_step: int = 0
    """fixed_linear / fixed_root: steps from min to max."""
    difficulty_step: int = 1
    """fixed_linear / fixed_root: every length is a multiple of this."""
    root_degree: float = 1.0
    """fixed_root: the degree of the root (1 is fixed_linear)."""
    difficulty: tuple[int, ...] = ()
    """fixed_discrete: the lengths, one more than `max_step`."""
    max_step: tuple[int, ...] = ()
    """fixed_discrete: the last step of each length but the last."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "difficulty", tuple(self.difficulty))
        object.__setattr__(self, "max_step", tuple(self.max_step))
        where = f"{CURRICULUM_KEY}"
        check(
            self.schedule_type in CURRICULUM_SCHEDULES,
            f"{where}.schedule_type {self.schedule_type!r} is not supported; use one of "
            f"{', '.join(CURRICULUM_SCHEDULES)}",
        )
        check(
            1 <= self.min_difficulty <= self.max_difficulty,
            f"{where}: min_difficulty {self.min_difficulty} and max_difficulty {self.max_difficulty} must satisfy "
            f"1 <= min <= max",
        )
        if self.schedule_type == "fixed_discrete":
            d, m = self.difficulty, self.max_step
            check(
                len(d) >= 2 and len(d) == len(m) + 1,
                f"{where}.schedule_config: fixed_discrete needs 'difficulty' with one more entry than 'max_step' "
                f"(got {len(d)} and {len(m)})",
            )
            check(all(v >= 1 for v in d), f"{where}.schedule_config.difficulty {list(d)}: lengths must be >= 1")
            check(
                all(b > a for a, b in zip((0, *m), m)),
                f"{where}.schedule_config.max_step {list(m)}: steps must be positive and increasing",
            )
        else:
            check(
                self.total_curriculum_step >= 1 and self.difficulty_step >= 1,
                f"{where}.schedule_config: total_curriculum_step {self.total_curriculum_step} and difficulty_step "
                f"{self.difficulty_step} must be >= 1",
            )
            check(
                math.isfinite(self.root_degree) and self.root_degree > 0,
                f"{where}.schedule_config.root_degree {self.root_degree} must be > 0",
            )

    @classmethod
    def from_json(cls, section: Any, source: str) -> CurriculumConfig | None:
        """The curriculum a DeepSpeed JSON's `curriculum_learning` section asks for (None when it is
        absent or `enabled` is false); `source` names the file in the one-line errors."""
        if section is None:
            return None
        where = f"{source} {CURRICULUM_KEY}"
        check(isinstance(section, dict), f"{where} must be a JSON object")
        known = {"enabled", "curriculum_type", "min_difficulty", "max_difficulty", "schedule_type", "schedule_config"}
        unknown = sorted(set(section) - known)
        check(not unknown, f"{where}.{unknown[0] if unknown else ''} is not a key of the legacy curriculum; remove it")
        if not section.get("enabled", False):
            return None
        kind = section.get("curriculum_type", "seqlen")
        check(kind == "seqlen", f"{where}.curriculum_type {kind!r}: only 'seqlen' is implemented")
        for key in ("min_difficulty", "max_difficulty", "schedule_type"):
            check(key in section, f"{where} has no {key!r}; DeepSpeed's curriculum requires it")
        schedule = section.get("schedule_config", {})
        check(isinstance(schedule, dict), f"{where}.schedule_config must be a JSON object")
        kind = section["schedule_type"]
        needs = {
            "fixed_linear": ("total_curriculum_step", "difficulty_step"),
            "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
            "fixed_discrete": ("difficulty", "max_step"),
        }.get(kind, ())
        for key in needs:
            check(key in schedule, f"{where}.schedule_config has no {key!r}; {kind} requires it")
        values: dict[str, Any] = {k: schedule[k] for k in needs}
        for key in ("min_difficulty", "max_difficulty"):
            _check_number(where, key, section[key])
        for key, value in values.items():
            _check_number(where, f"schedule_config.{key}", value)
        try:
            return cls(
                schedule_type=kind,
                min_difficulty=section["min_difficulty"],
                max_difficulty=section["max_difficulty"],
                **{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()},
            )
        except ConfigError as err:
            raise ConfigError(f"{source} {err}") from None

    def lengths_to_divide(self) -> tuple[int, ...]:
        """What every length the curriculum gives is built from: its lengths (fixed_discrete), or the first
        and last and the step the others are multiples of."""
        if self.schedule_type == "fixed_discrete":
            return self.difficulty
        return (self.min_difficulty, self.max_difficulty, self.difficulty_step)

    def difficulty_at(self, step: int) -> int:
        """DeepSpeed's `get_difficulty(step)` for this schedule (0.19.8's; see `seq_length`)."""
        if self.schedule_type == "fixed_discrete":
            for length, last in zip(self.difficulty, self.max_step):
                if step <= last:
                    return length
            return self.difficulty[-1]
        degree = 1.0 if self.schedule_type == "fixed_linear" else float(self.root_degree)
        fraction = (float(step) / self.total_curriculum_step) ** (1.0 / degree)
        value = math.floor(fraction * (self.max_difficulty - self.min_difficulty) + self.min_difficulty)
        value -= value % self.difficulty_step
        # DeepSpeed 0.19.8 raises a length floored below the start to the first multiple of
        # difficulty_step at or above min_difficulty (older releases could return 0).
        value = max(value, -(-self.min_difficulty // self.difficulty_step) * self.difficulty_step)
        return min(value, self.max_difficulty)

    def seq_length(self, step: int) -> int:
        """The sequence length of training step `step` (1-based): DeepSpeed's `update_difficulty(step)`
        after steps 1..step-1, which updates the length only while it is below max_difficulty."""
        reached = self._first_step_at_max()
        return self.difficulty_at(step if reached is None or step < reached else reached)

    def settle_step(self) -> int:
        """A step from which on every step has the same length (the curriculum is over)."""
        reached = self._first_step_at_max()
        if reached is not None:
            return reached
        if self.schedule_type == "fixed_discrete":
            return self.max_step[-1] + 1
        high = max(1, self.total_curriculum_step)
        while self.difficulty_at(high) < self.max_difficulty:  # monotone: it reaches the cap
            high *= 2
        low = 1
        while low < high:
            mid = (low + high) // 2
            low, high = (mid + 1, high) if self.difficulty_at(mid) < self.max_difficulty else (low, mid)
        return low

    def _first_step_at_max(self) -> int | None:
        """The first step whose difficulty is >= max_difficulty (the state stops changing there)."""
        if self.schedule_type != "fixed_discrete":
            return None  # monotone and capped: difficulty_at is the state itself
        for i, length in enumerate(self.difficulty):
            if length >= self.max_difficulty:
                return 1 if i == 0 else self.max_step[i - 1] + 1
        return None


def _check_number(where: str, key: str, value: Any) -> None:
    """An integer (a list of them for `difficulty` and `max_step`; any number for `root_degree`)."""
    many = key.endswith(("difficulty", "max_step")) and key.startswith("schedule_config")
    items = value if many and isinstance(value, list) else [value]
    kinds = (int, float) if key.endswith("root_degree") else (int,)
    ok = (not many or isinstance(value, list)) and all(isinstance(v, kinds) and not isinstance(v, bool) for v in items)
    what = "a list of integers" if many else "a number" if float in kinds else "an integer"
    check(ok, f"{where}.{key} {value!r} is not {what}; fix the file")


def rampup_batch_size(rampup: tuple[int, int, int], global_batch_size: int, consumed_samples: int) -> int:
    """Megatron-DeepSpeed's `--rampup-batch-size START INCREMENT SAMPLES`: START, raised by INCREMENT in
    equal shares of SAMPLES samples, then `global_batch_size` (`RampupBatchsizeNumMicroBatches.update`)."""
    start, increment, samples = rampup
    if consumed_samples > samples:
        return global_batch_size
    per_increment = samples / ((global_batch_size - start) // increment)
    return start + int(consumed_samples / per_increment) * increment


def step_batch_size(schedule: tuple[tuple[int, int], ...], consumed_samples: int) -> int:
    """Megatron-LM's `--step-batch-size-schedule`: the batch size of the last threshold (in samples)
    at or below `consumed_samples` (`StepBatchsizeNumMicroBatchesCalculator._get_batch_size_for_samples`)."""
    size = schedule[0][1]
    for threshold, batch in schedule:
        if consumed_samples < threshold:
            break
        size = batch
    return size


def check_rampup(rampup: tuple[int, int, int], global_batch_size: int) -> None:
    """The checks of Megatron's ramp-up calculator, as one-line errors."""
    start, increment, samples = rampup
    flag = f"--rampup-batch-size {start} {increment} {samples}"
    check(
        start > 0 and increment > 0 and samples > 0,
        f"{flag}: start, increment and samples must be > 0 (Megatron divides by the samples)",
    )
    check(
        start < global_batch_size,
        f"{flag}: the start batch size must be below --global-batch-size {global_batch_size} (nothing to ramp "
        f"otherwise); drop --rampup-batch-size or lower the start",
    )
    check(
        (global_batch_size - start) % increment == 0,
        f"{flag}: --global-batch-size {global_batch_size} minus the start {start} is not a multiple of the "
        f"increment {increment}; choose sizes that step exactly to the global batch size",
    )


def check_step_schedule(schedule: tuple[tuple[int, int], ...], global_batch_size: int) -> None:
    """Megatron-LM's checks of a step schedule, and its last batch size is the global batch size."""
    text = " ".join(f"{t}:{b}" for t, b in schedule)
    flag = f"--step-batch-size-schedule (in samples: {text})"
    check(bool(schedule) and schedule[0][0] == 0, f"{flag}: the first threshold must be 0")
    check(
        all(b[0] > a[0] for a, b in zip(schedule, schedule[1:])),
        f"{flag}: thresholds must be strictly increasing (two tokens thresholds may fall in one sample)",
    )
    check(all(b >= 1 for _, b in schedule), f"{flag}: batch sizes must be >= 1")
    check(
        schedule[-1][1] == global_batch_size,
        f"{flag}: its last batch size {schedule[-1][1]} is the global batch size, but --global-batch-size is "
        f"{global_batch_size}; drop --global-batch-size or make them equal",
    )
