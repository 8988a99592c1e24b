"""The search over configurations: every fitting one of a ZeRO option priced in the order of its time
bound (branch and bound) under every schedule it can run (`plan/runnable_schedules.py`), the fastest layout of one (`best_layout`), the
fastest chosen and refined (`alternatives`: every layout method and schedule, interleaving at v = 2-4,
with the same degrees, micro-batch, recomputation and ZeRO); the message when nothing fits is `plan/no_fit.py`'s.
The configurations themselves and their pricing are `plan/search.py`'s."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron_ds.config.parallel import DEFAULT_PIPELINE_SCHEDULE
from megatron_ds.estimate.step_bounds import step_lower_bound
from megatron_ds.estimate.step_inputs import StepInputs
from megatron_ds.estimate.step_time import layout_bound
from megatron_ds.pipeline.fastest import SearchBudgetError
from megatron_ds.pipeline.layout import LayoutError
from megatron_ds.plan import timing
from megatron_ds.plan.candidate import Candidate
from megatron_ds.plan.inputs import Resolved
from megatron_ds.plan.runnable_schedules import (
    SCHEDULES,
    Unreplayed,
    num_micro_batches,
    schedule_options,
    schedule_order,
    schedules_for,
    unreplayed,
)
from megatron_ds.plan.search import (
    DEFAULT,
    FASTEST_MAX_REPLAY,
    FASTEST_MAX_STAGES,
    FASTEST_MAX_VISITS,
    METHODS,
    RECOMPUTE,
    evaluate,
    fits,
    layout_options,
    micro_batches,
    plain_layout,
    recompute_modes,
    sequence_parallel_at,
    states_lower_bound,
)


def best_layout(
    res: Resolved,
    t: int,
    p: int,
    mb: int,
    zero: int,
    precision: str,
    recompute: str,
    methods: list[str],
    offload: str = "none",
    offload_param: str = "none",
    schedule: tuple[str, int] = (DEFAULT_PIPELINE_SCHEDULE, 1),
    memory_only: bool = False,
) -> Candidate | None:
    """The fastest layout that fits under `schedule` (name, virtual stages) (ties: smaller largest stage, then the simplest flag in METHODS
    order); when none fits, the one with the smallest largest stage (the closest miss)."""
    found = []
    for method in methods:
        try:
            found.append(
                evaluate(
                    res,
                    t,
                    p,
                    mb,
                    zero,
                    precision,
                    recompute == "full",
                    method,
                    offload,
                    offload_param,
                    selective=recompute == "selective",
                    schedule=schedule[0],
                    virtual_stages=schedule[1],
                    time_misses=False,
                    timed=not memory_only,
                )
            )
        except LayoutError:
            continue
    fitting = [c for c in found if fits(res, c)]
    if fitting and memory_only:
        return min(fitting, key=lambda c: (round(c.peak.total), METHODS.index(c.method)))
    if fitting:
        return min(fitting, key=_fastest_key)
    return min(found, key=lambda c: (round(c.peak.total), METHODS.index(c.method)), default=None)


def zero_for(res: Resolved, dp: int, offload: str, zero: int | None) -> int:
    """The ZeRO stage of an option; None: ZeRO-1 with offload or data parallelism (or `--zero-stage`), else 0."""
    if zero is not None:
        return zero
    if offload != "none":
        return 1
    return res.raw.zero_stage if res.raw.zero_stage is not None else (1 if dp > 1 else 0)


def time_bound(
    res: Resolved, t: int, p: int, mb: int, zero: int, precision: str, recompute: str,
    schedule: str = DEFAULT_PIPELINE_SCHEDULE, method: str | None = None, virtual_stages: int = 1,
) -> float:  # fmt: skip
    """No layout of this configuration steps faster (`estimate/step_bounds.step_lower_bound`); with `method`
    one that needs no costs (the default partition, a dedicated mode: what the search prices), no run of that
    method's layout steps faster either (`estimate/step_time.layout_bound`: its slowest rank's passes)."""
    dp = res.num_gpus // (t * p)
    if res.model().is_moe:
        return 0.0  # the bound prices dense layers; a MoE plan's few configurations (t = p = 1) are all priced
    hw = timing.hardware(res.gpu_name, precision, res.gpus_per_node or 1, res.raw.kernel_profile)
    m = num_micro_batches(res, t, p, mb)
    run = res.run_features or timing.features(zero, precision, sequence_parallel_at(res, t))
    model = res.model(t)
    bound = step_lower_bound(
        model, mb, m, t, p, precision, recompute == "full", hw.kernels, hw.links, run,
        schedule=schedule, selective_recompute=recompute == "selective",
    )  # fmt: skip
    if method is None or "partition_method" in layout_options(method):
        return bound
    try:
        layout = plain_layout(model, p, method, virtual_stages)
    except LayoutError:
        return bound
    step = StepInputs(
        model=model, layers_per_stage=tuple(layout.layers_per_stage), stage_params=(0,) * p, micro_batch_size=mb,
        num_micro_batches=m, tp=t, dp=dp, precision=precision, zero_stage=zero,
        checkpoint_activations=recompute == "full", selective_recompute=recompute == "selective",
        gpus_per_node=res.gpus_per_node or 1, schedule=schedule, attention_dropout=False,
        virtual_stages=virtual_stages,
    )  # fmt: skip
    return max(bound, layout_bound(step, hw.kernels, hw.links, run))


def rank_key(c: Candidate) -> tuple:
    """Fastest first; ties: 1F1B before the other schedules, smaller t x p, larger t, less recomputation,
    the simpler layout flag."""
    schedule = schedule_order((c.inputs.schedule, c.virtual_stages))
    return (round(c.seconds, 6), schedule, c.tp * c.pp, -c.tp, RECOMPUTE.index(c.recompute), METHODS.index(c.method))


def refine_methods(res: Resolved, pp: int, num_micro_batches: int = 1) -> list[str]:
    """The layouts the chosen configuration is tried under: `--layout`'s alone, else every method but the
    exact `fastest` beyond FASTEST_MAX_STAGES stages or FASTEST_MAX_REPLAY micro-batches x stages."""
    if res.raw.layout:
        return [res.raw.layout]
    exact = pp <= FASTEST_MAX_STAGES and pp * num_micro_batches <= FASTEST_MAX_REPLAY
    return [m for m in METHODS if m != "fastest" or exact] if pp > 1 else [DEFAULT]


@dataclass(frozen=True)
class Tried:
    """One layout method under one schedule, the chosen configuration's degrees and batch otherwise."""

    method: str
    schedule: tuple[str, int]
    candidate: Candidate | None
    """None: the method cannot lay out this schedule (`error` says why)."""
    error: str = ""


def config_key(c: Candidate) -> tuple:
    """What the refinement keeps: degrees (the expert-parallel size too), micro-batch, recomputation, ZeRO and
    offload."""
    return (
        c.tp, c.pp, c.micro_batch_size, c.recompute, c.zero_stage, c.offload_optimizer, c.offload_param,
        c.expert_parallel_size,
    )  # fmt: skip


def alternatives(res: Resolved, top: Candidate) -> list[Tried]:
    """`top` under every layout method (`refine_methods`) and every schedule it can run (`schedule_options`).
    Under `top`'s own schedule each is priced whether or not it fits, under the others only those that fit
    (a miss's `time` is None until `retimed`). The exact `fastest` split runs under `top`'s own schedule only
    (it is the slow one; with virtual stages it is refused at once)."""
    own = (top.inputs.schedule, top.virtual_stages)
    methods = refine_methods(res, top.pp, top.num_micro_batches)
    tried = []
    for schedule in schedule_options(res, top.tp, top.pp, top.micro_batch_size, top.zero_stage):
        for method in methods:
            if method == "fastest" and schedule != own and schedule[1] == 1 and not res.raw.layout:
                continue
            tried.append(_try(res, top, method, schedule, time_misses=schedule == own))
    return tried


def retimed(res: Resolved, tried: list[Tried], schedule: tuple[str, int]) -> list[Tried]:
    """`tried` with `schedule`'s misses priced too (the layout table reads the chosen schedule's)."""
    return [
        _try(res, t.candidate, t.method, t.schedule, time_misses=True)
        if t.schedule == schedule and t.candidate is not None and t.candidate.time is None
        else t
        for t in tried
    ]


def _try(res: Resolved, top: Candidate, method: str, schedule: tuple[str, int], time_misses: bool) -> Tried:
    """`top`'s degrees, batch, recomputation and ZeRO under `method` and `schedule`."""
    res = dataclasses.replace(res, expert_parallel_size=top.expert_parallel_size)
    try:
        cand = evaluate(
            res, top.tp, top.pp, top.micro_batch_size, top.zero_stage, top.precision,
            top.recompute == "full", method, top.offload_optimizer, top.offload_param,
            selective=top.recompute == "selective", schedule=schedule[0], virtual_stages=schedule[1],
            time_misses=time_misses, max_visits=None if res.raw.layout else FASTEST_MAX_VISITS,
        )  # fmt: skip
    except SearchBudgetError as e:
        return Tried(method, schedule, None, f"{e}; --layout {method} runs it to the end")
    except LayoutError as e:
        return Tried(method, schedule, None, str(e))
    return Tried(method, schedule, cand)


def fastest_tried(res: Resolved, tried: list[Tried]) -> Candidate | None:
    """The fastest that fits (ties: the earlier schedule, the smaller largest stage, the simpler method)."""
    fitting = [t.candidate for t in tried if t.candidate is not None and fits(res, t.candidate)]
    return min(fitting, key=_fastest_key, default=None)


def _fastest_key(c: Candidate) -> tuple:
    """Fastest first; ties: the earlier schedule, the smaller largest stage, the simpler layout flag."""
    schedule = schedule_order((c.inputs.schedule, c.virtual_stages))
    return round(c.seconds, 9), schedule, round(c.peak.total), METHODS.index(c.method)


class Search:
    """Searches configurations for one ZeRO option at a time, remembering the closest miss over all and
    every fitting configuration it priced (`ranked`, fastest first)."""

    def __init__(self, res: Resolved, precision: str) -> None:
        raw = res.raw
        self.res, self.precision = res, precision
        self.recomputes = recompute_modes(raw)
        if res.model().is_moe and (raw.pipeline_model_parallel_size or 1) > 1:  # refused with experts at P > 1
            self.recomputes = [r for r in self.recomputes if r != "full"]
        self.methods = [raw.layout] if raw.layout else [DEFAULT]
        self.closest: Candidate | None = None
        self.bounds: list[tuple[float, int, int]] = []
        self.batch_ok = False
        self.schedule_ok = False
        """Some configuration runs the schedule the flags fix (always, when they fix none)."""
        self.unreplayed: list[Unreplayed] = []
        """Configurations that run the schedule the flags fix but are too long to replay (not priced)."""
        self.ranked: list[Candidate] = []
        self.tried: dict[tuple, list[Tried]] = {}
        """Per refined configuration (`config_key`): its `alternatives`."""

    def fitting(self, option: Any, pairs: list[tuple[int, int]], keep: int = 2) -> list[Candidate]:
        """The `keep` fastest fitting configurations of `option` (a `zero_options.ZeroOption`; None: ZeRO 0/1
        by the data-parallel rule) over these (t, p), fastest first. Branch and bound: configurations are
        priced in the order of their time bound (`time_bound`) until the bound passes the `keep`-th fastest
        found; a micro-batch is skipped once a smaller one missed memory at the same (t, p, recompute, schedule),
        and interleaving where 1F1B misses memory with the same degrees, micro-batch and recomputation."""
        res = self.res
        zero_opt, offload, offload_param = (None, "none", "none") if option is None else option.fields
        order = self._bounded(pairs, zero_opt, offload, offload_param)
        found: list[Candidate] = []
        missed: dict[tuple, int] = {}
        priced: dict[tuple, Candidate | None] = {}

        def layout(
            t: int, p: int, r: int, mb: int, zero: int, k: tuple[str, int] = SCHEDULES[0], memory_only: bool = False
        ) -> Candidate | None:
            """`best_layout` of this option's offload, layout flags and precision (r: RECOMPUTE index, k: the
            schedule and its chunks)."""
            return best_layout(
                res, t, p, mb, zero, self.precision, RECOMPUTE[r], self.methods, offload, offload_param,
                k, memory_only=memory_only,
            )  # fmt: skip

        def price(t: int, p: int, r: int, mb: int, zero: int, k: tuple[str, int]) -> Candidate | None:
            key = (t, p, r, mb, zero, k)
            if key not in priced:
                cand = priced[key] = layout(t, p, r, mb, zero, k)
                if cand is not None and fits(res, cand):
                    found.append(cand)
                elif cand is not None:
                    missed[(t, p, r, k)] = min(mb, missed.get((t, p, r, k), mb))
                    if self.closest is None or cand.peak.total < self.closest.peak.total:
                        self.closest = cand
            return priced[key]

        def twin_fits(t: int, p: int, r: int, mb: int, zero: int) -> bool:
            """1F1B's end ranks (its fullest) fit with the same degrees, micro-batch and recomputation (not timed)."""
            key = (t, p, r, mb, zero, SCHEDULES[0])
            cand = priced[key] if key in priced else layout(t, p, r, mb, zero, memory_only=True)
            return cand is not None and fits(res, cand)

        for bound, _, t, p, r, mb, zero, k in sorted(order):
            if len(found) >= keep and bound > sorted(c.seconds for c in found)[keep - 1]:
                break
            if mb >= missed.get((t, p, r, k), mb + 1):
                continue  # a larger micro-batch holds more activations
            if k[1] > 1 and not twin_fits(t, p, r, mb, zero):
                continue  # interleaving holds more in flight than 1F1B; ZB-H1 may hold less (its weight
                # gradients come later), so it is priced whatever 1F1B's memory
            price(t, p, r, mb, zero, k)
        return sorted(found, key=rank_key)

    def _bounded(self, pairs: list[tuple[int, int]], zero_opt: Any, offload: str, offload_param: str) -> list[tuple]:
        """Every configuration of these (t, p) the search may price, with its time bound, in pricing order's
        fields (bound, schedule order, t, p, recompute index, micro-batch, ZeRO stage, schedule); records what
        ruled configurations out (no micro-batch, no schedule, unreplayed, model states over memory)."""
        res = self.res
        order = []
        for t, p in pairs:
            dp = res.num_gpus // (t * p)
            sizes = micro_batches(res, dp)
            self.batch_ok = self.batch_ok or bool(sizes)
            zero = zero_for(res, dp, offload, zero_opt)
            runs = {mb: schedules_for(res, t, p, mb, zero) for mb in sizes}
            self.schedule_ok = self.schedule_ok or any(runs.values())
            if res.schedule[0] is not None:
                self.unreplayed += unreplayed(res, t, p, sizes, zero)
            states = states_lower_bound(res, t, p, zero, self.precision, offload, offload_param)
            if states > res.usable_bytes:
                self.bounds.append((states, t, p))
                continue
            for recompute in self.recomputes:
                for mb in sizes:
                    for schedule in runs[mb]:
                        bound = time_bound(
                            res, t, p, mb, zero, self.precision, recompute, schedule[0], self.methods[0], schedule[1]
                        )
                        r = RECOMPUTE.index(recompute)
                        order.append((bound, schedule_order(schedule), t, p, r, mb, zero, schedule))
        return order

    def best(self, option: Any, pairs: list[tuple[int, int]], refine: bool = True) -> Candidate | None:
        """The fastest fitting configuration of `option`, its layout and schedule refined unless `refine` is
        False (None: nothing fits)."""
        found = self.fitting(option, pairs)
        if not found:
            return None
        chosen = self.refine(found[0]) if refine else found[0]
        self.ranked = sorted([chosen, *found[1:]], key=rank_key)
        return chosen

    def refine(self, top: Candidate) -> Candidate:
        """The fastest fitting of `top`'s `alternatives` (kept in `tried`)."""
        tried = alternatives(self.res, top)
        chosen = fastest_tried(self.res, tried) or top
        schedule = (chosen.inputs.schedule, chosen.virtual_stages)
        if schedule != (top.inputs.schedule, top.virtual_stages):
            tried = retimed(self.res, tried, schedule)
        self.tried[config_key(top)] = tried
        return chosen
