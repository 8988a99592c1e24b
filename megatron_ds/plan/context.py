"""What every advisor shares: the resolved inputs, the chosen precision and (lazily) the parallel plan."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_ds.plan.inputs import Resolved
from megatron_ds.plan.search import Candidate
from megatron_ds.plan.zero_options import choose


@dataclass
class Context:
    res: Resolved
    precision: str
    precision_reason: str
    _plan: Candidate | None = field(default=None, repr=False)

    def plan(self) -> Candidate:
        """The parallel configuration `pipeline` recommends (computed once; raises PlanError)."""
        if self._plan is None:
            self._plan = choose(self.res, self.precision)
        return self._plan
