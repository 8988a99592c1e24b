"""What the loop does around each step besides the step itself, in one object (`StepHooks`): the
step's batch size and sequence length (`step_plan`), Megatron-LM's `--manual-gc` and either upstream's
`--profile` (`housekeeping`), and the extra numbers of the log line (`--log-params-norm`,
`--log-num-zeros-in-grad`, the curriculum's length). Every rank runs the same hooks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from megatron_ds.config import Config
from megatron_ds.training.grad_norm import ZeroCounter, params_norm
from megatron_ds.training.housekeeping import ManualGC, build_profiler
from megatron_ds.training.state import TrainState
from megatron_ds.training.step_plan import StepPlan, StepSize


class StepHooks:
    def __init__(self, config: Config, engine: Any, rank: int) -> None:
        self.config, self.engine = config, engine
        self.plan = StepPlan(config, engine)
        self.gc = ManualGC(config)
        self.profiler = build_profiler(config, rank)
        self.zeros = ZeroCounter(engine) if config.logging.log_num_zeros_in_grad else None
        self.last: StepSize | None = None
        self.window_tokens = 0
        """Tokens of the steps since the last log line."""

    def train_batches(self, batches: Iterator[Any] | None) -> Iterator[Any] | None:
        return self.plan.cut(batches)

    def before_step(self, state: TrainState) -> StepSize:
        self.profiler.before_step(state.iteration)
        self.last = self.plan.before_step(state)
        self.window_tokens += self.last.tokens
        return self.last

    def after_step(self, state: TrainState) -> str | None:
        """Returns the profiler trace's path when one was written."""
        self.gc.after_step(state.iteration)
        return self.profiler.after_step(state.iteration)

    def before_eval(self) -> None:
        self.gc.around_evaluation()
        self.plan.before_eval()

    def after_eval(self) -> None:
        self.gc.around_evaluation()

    def take_window_tokens(self) -> int:
        tokens, self.window_tokens = self.window_tokens, 0
        return tokens

    def log_extras(self) -> dict[str, Any]:
        """The log line's optional numbers (collective: every rank calls it at each log line)."""
        lg = self.config.logging
        return {
            "params_norm": params_norm(self.engine) if lg.log_params_norm else None,
            "num_zeros": self.zeros.total() if self.zeros is not None else None,
            "curriculum_seq_length": self.last.seq_length
            if self.last is not None and self.config.training.curriculum is not None
            else None,
        }

    def close(self) -> None:
        self.profiler.close()
        self.gc.close()
