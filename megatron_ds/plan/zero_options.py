"""The ZeRO options beyond ZeRO 0/1 on the GPUs that pretrain_gpt.py runs, and the choice among them.

Each option is a ZeRO stage with its optimizer and parameter offload. ZeRO 0/1 run on DeepSpeed's
pipeline engine at any t x p; ZeRO-2 and ZeRO-3 on its plain engine at pipeline size 1 (docs/training.md).
`plain_options` are tried on the GPUs alone, beside ZeRO 0/1, and the fastest predicted step of them
all wins. Only when nothing fits on the GPUs are the offload options priced: the predicted step of the
same configuration on the GPUs plus what each adds (`estimate/zero_time.py`: PCIe and NVMe traffic,
the CPU optimizer step), and the fastest that fits wins; `choose_offload` keeps the comparison for
the report. An offloaded run is the same GPU work plus that traffic, so it is never faster than a
configuration that fits without it.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass, field

from megatron_ds.config.parallel import DEFAULT_PIPELINE_SCHEDULE
from megatron_ds.estimate.model_states import PRECISION_BYTES
from megatron_ds.estimate.zero_time import INTERCONNECT, LINKS, Links, step_overheads
from megatron_ds.plan import experts
from megatron_ds.plan.candidate import Candidate
from megatron_ds.plan.hardware import PlanError
from megatron_ds.plan.inputs import Resolved
from megatron_ds.plan.no_fit import no_fit_message, schedule_message
from megatron_ds.plan.ranking import (
    Search,
    Tried,
    alternatives,
    config_key,
    rank_key,
)
from megatron_ds.plan.search import degree_pairs, recompute_modes

DISTILLATION_ZERO_STAGES = (0, 1, 2, 3)
"""The ZeRO stages a distilling plan tries (the plain engine runs them all; offload is not planned for it)."""


@dataclass(frozen=True)
class ZeroOption:
    """A ZeRO stage and where its optimizer and parameters live."""

    zero_stage: int
    offload_optimizer: str = "none"
    offload_param: str = "none"

    @property
    def fields(self) -> tuple[int, str, str]:
        return self.zero_stage, self.offload_optimizer, self.offload_param

    @property
    def label(self) -> str:
        parts = [f"ZeRO-{self.zero_stage}"]
        if self.offload_optimizer != "none" and self.offload_param == self.offload_optimizer:
            parts.append(f"optimizer and parameters offloaded to {self.offload_optimizer}")
        elif self.offload_optimizer != "none":
            parts.append(f"optimizer offloaded to {self.offload_optimizer}")
        return " + ".join(parts)

    @property
    def any_pipeline(self) -> bool:
        """DeepSpeed's pipeline engine runs it (ZeRO 0/1) at any pipeline size; else pipeline size 1 only."""
        return self.zero_stage < 2


PLAIN = (ZeroOption(2), ZeroOption(3))
OFFLOAD = (
    ZeroOption(1, "cpu"),
    ZeroOption(2, "cpu"),
    ZeroOption(3, "cpu"),
    ZeroOption(3, "cpu", "cpu"),
    ZeroOption(3, "nvme", "nvme"),
)


def allowed(res: Resolved, option: ZeroOption) -> bool:
    """The user's fixed ZeRO stage and pipeline size permit it; NVMe only with `--storage nvme`."""
    raw = res.raw
    if raw.zero_stage is not None and raw.zero_stage != option.zero_stage:
        return False
    if not option.any_pipeline and (raw.pipeline_model_parallel_size or 1) > 1:
        return False
    if not option.any_pipeline and res.schedule[0] not in (None, DEFAULT_PIPELINE_SCHEDULE):
        return False  # the plain engine runs no pipeline schedule
    return "nvme" not in option.fields or raw.storage == "nvme"


def plain_options(res: Resolved) -> list[ZeroOption]:
    return [o for o in PLAIN if allowed(res, o)]


def pairs_for(res: Resolved, option: ZeroOption) -> list[tuple[int, int]]:
    """(t, p) pairs the option can use, in the search's preference order."""
    return [(t, p) for t, p in degree_pairs(res) if option.any_pipeline or p == 1]


def links(res: Resolved) -> Links:
    """The bandwidth assumptions, with the data-parallel link of `--interconnect` when given."""
    link = res.raw.interconnect
    return Links(network=INTERCONNECT[link]) if link in INTERCONNECT else LINKS


@dataclass
class Timed:
    """One option's best fitting configuration and its estimated step."""

    option: ZeroOption
    candidate: Candidate
    compute: float
    """The predicted step on the GPUs, seconds (`plan/timing.py`)."""
    overheads: dict[str, float] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.compute + sum(self.overheads.values())


def timed(res: Resolved, option: ZeroOption, cand: Candidate) -> Timed:
    params = cand.peak.num_params  # per tensor rank, on the fullest stage
    terms = step_overheads(params, cand.dp, PRECISION_BYTES[cand.precision], *option.fields, links=links(res))
    terms.pop("data-parallel communication", None)  # the step-time model prices it
    return Timed(option, cand, cand.seconds, terms)


@dataclass
class OffloadChoice:
    """The offload options that fit, fastest first; `candidate` is the chosen configuration."""

    timed: list[Timed]
    others: list[Candidate] = field(default_factory=list)
    """The other fitting configurations the options' searches priced (for the runner-up)."""

    @property
    def candidate(self) -> Candidate:
        return self.timed[0].candidate

    def ranked(self) -> list[Candidate]:
        """The choice, then every other fitting configuration, fastest first."""
        rest = [t.candidate for t in self.timed[1:]] + self.others
        return [self.candidate, *sorted(rest, key=rank_key)]


def _offload_order(t: Timed) -> tuple[float, int]:
    return round(t.seconds, 9), OFFLOAD.index(t.option)


def choose_offload(search: Search) -> OffloadChoice | None:
    """Every allowed offload option's preferred fitting configuration, by estimated step (None: none fits)."""
    res = search.res
    found, others = [], []
    for option in OFFLOAD:
        if not allowed(res, option):
            continue
        cand = search.best(option, pairs_for(res, option), refine=False)
        if cand is not None:
            found.append(timed(res, option, cand))
            others += search.ranked[1:]
    found.sort(key=_offload_order)
    if found:  # only the fastest option's layout and schedule are refined
        found[0] = timed(res, found[0].option, search.refine(found[0].candidate))
        found.sort(key=_offload_order)
    return OffloadChoice(found, others) if found else None


@dataclass
class Choice:
    """The chosen configuration and every fitting one priced beside it, fastest first."""

    ranked: list[Candidate]
    tried: dict[tuple, list[Tried]] = field(default_factory=dict)
    """The refined configurations' layout methods and schedules (`ranking.alternatives`), by `config_key`."""

    @property
    def candidate(self) -> Candidate:
        return self.ranked[0]

    def alternatives(self, res: Resolved) -> list[Tried]:
        """The choice under every layout method and schedule (priced once, by the search's refinement)."""
        key = config_key(self.candidate)
        if key not in self.tried:
            self.tried[key] = alternatives(res, self.candidate)
        return self.tried[key]

    @property
    def runner_up(self) -> Candidate | None:
        """The fastest configuration that differs from the choice in degrees, micro-batch, recomputation, ZeRO or
        offload."""

        return next((c for c in self.ranked[1:] if config_key(c) != config_key(self.candidate)), None)


def choose_all(res: Resolved, precision: str) -> Choice:
    """Every fitting configuration, fastest first; PlanError naming the closest miss if none fits.

    ZeRO 0/1 at any t x p (the pipeline engine) and ZeRO-2/3 at p = 1 (the plain engine) on the GPUs compete
    by predicted step; only when none fits, the offload option with the smallest estimated step
    (`choose_offload`)."""
    enabled = gc.isenabled()
    gc.disable()  # the search allocates millions of acyclic objects (streams, programs): no cycle collection
    try:
        return _choose_all(res, precision)
    finally:
        if enabled:
            gc.enable()


def _choose_all(res: Resolved, precision: str) -> Choice:
    if res.model().is_moe or res.distils:
        return _choose_plain(res, precision)
    search = Search(res, precision)
    ranked: list[Candidate] = []
    if res.raw.zero_stage in (None, 0, 1) and search.best(None, degree_pairs(res)) is not None:
        ranked += search.ranked
    for option in plain_options(res):
        if search.best(option, pairs_for(res, option)) is not None:
            ranked += search.ranked
    if ranked:
        return Choice(sorted(ranked, key=rank_key), search.tried)
    chosen = choose_offload(search)
    if chosen is not None:
        return Choice(chosen.ranked(), search.tried)
    if search.batch_ok and not search.schedule_ok:
        raise PlanError(schedule_message(res, search.unreplayed))
    raise PlanError(
        no_fit_message(res, search.closest, search.bounds, search.batch_ok, also_tried(res), search.unreplayed)
    )


def _choose_plain(res: Resolved, precision: str) -> Choice:
    """What trains on the plain engine alone, by predicted step: a mixture-of-experts model at t = p = 1, every
    expert-parallel size (a divisor of every expert count and of the GPUs) under ZeRO 0, 1 and 2 (at a pipeline size
    > 1 the flags fix, on the pipeline engine: ZeRO 0 and 1, E dividing a stage's data-parallel ranks); a distilling run
    (`--kd`) at p = 1, every tensor size the teacher allows, under ZeRO 0-3 (what `--zero-stage` leaves open), with a
    mixture-of-experts teacher at t = 1, every expert-parallel size dividing its expert counts too, under ZeRO 0-2; no
    offload."""
    moe = res.model().is_moe or res.moe_teacher is not None  # a MoE teacher: the student's E, ZeRO 0-2 too
    zeros = experts.MOE_ZERO_STAGES if moe else DISTILLATION_ZERO_STAGES
    pairs = degree_pairs(res)
    ranked: list[Candidate] = []
    tried: dict = {}
    closest: Candidate | None = None
    bounds: list = []
    batch_ok = False
    fixed = res.raw.moe_expert_parallel_size
    p = pairs[0][1]  # a mixture-of-experts plan has one (t, p): p > 1 only when the flags fix it
    if p > 1:  # DeepSpeed's pipeline engine: ZeRO 0/1, E dividing the data-parallel ranks of a stage
        zeros = tuple(z for z in zeros if z < 2)
    for ep in experts.expert_parallel_sizes(res.model(), res.num_gpus // p, fixed, res.moe_teacher) if moe else [1]:
        search = Search(dataclasses.replace(res, expert_parallel_size=ep), precision)
        for zero in zeros:
            if res.raw.zero_stage in (None, zero) and search.best(ZeroOption(zero), pairs) is not None:
                ranked += search.ranked
        tried.update(search.tried)
        batch_ok = batch_ok or search.batch_ok
        bounds += search.bounds
        if search.closest is not None and (closest is None or search.closest.peak.total < closest.peak.total):
            closest = search.closest
    if ranked:
        return Choice(sorted(ranked, key=rank_key), tried)
    also = ("recomputation",) if "full" in recompute_modes(res.raw) else ()
    also += ("every expert-parallel size",) if moe else ("every tensor size and ZeRO stage",)
    raise PlanError(no_fit_message(res, closest, bounds, batch_ok, also))


def also_tried(res: Resolved) -> tuple[str, ...]:
    """What the search tried beyond the configurations the flags name outright, as the no-fit message says."""
    return tuple(
        text
        for text, tried in (
            ("recomputation", "full" in recompute_modes(res.raw)),
            ("ZeRO-2/3 at pipeline size 1", bool(plain_options(res))),
            ("optimizer/parameter offload", any(allowed(res, o) for o in OFFLOAD)),
        )
        if tried
    )


def choose(res: Resolved, precision: str) -> Candidate:
    """The fastest configuration that fits (a `Candidate`); PlanError naming the closest miss if none does."""
    return choose_all(res, precision).candidate
