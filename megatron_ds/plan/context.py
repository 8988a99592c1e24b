"""What every advisor shares: the resolved inputs, the chosen precision and (lazily) the parallel plan."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_ds.plan.candidate import Candidate
from megatron_ds.plan.hardware import PlanError
from megatron_ds.plan.inputs import Resolved
from megatron_ds.plan.zero_options import Choice, choose_all

NEEDS_BATCH = "choosing a configuration needs the batch: give --global-batch-size (samples per optimizer step)"


@dataclass
class Context:
    res: Resolved
    precision: str
    precision_reason: str
    _choice: Choice | None = field(default=None, repr=False)

    def choice(self) -> Choice:
        """Every fitting configuration priced, fastest first (computed once; raises PlanError)."""
        if self._choice is None:
            if self.res.global_batch_size is None:  # `zero` runs without one; its recommendation needs it
                raise PlanError(NEEDS_BATCH)
            self._choice = choose_all(self.res, self.precision)
        return self._choice

    def plan(self) -> Candidate:
        """The parallel configuration `pipeline` recommends: the fastest that fits."""
        return self.choice().candidate
