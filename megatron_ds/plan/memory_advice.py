"""`memory`: from a reported out-of-memory or per-stage memory pattern to the likely cause and an
ordered list of changes, each with its predicted saving on the fullest stage and its cost.

The changes, their costs and their savings are `estimate.fit_advice.ranked_changes`; this module
reads the report, picks the configuration and renders the section."""

from __future__ import annotations

import dataclasses
import math

from megatron_ds.estimate.fit_advice import Change, LayoutFor, fitting_combination, ranked_changes
from megatron_ds.estimate.memory_inputs import MemoryInputs, StageMemory
from megatron_ds.pipeline import methods as partition_methods
from megatron_ds.pipeline.layout import Layout
from megatron_ds.plan import search
from megatron_ds.plan.candidate import Candidate
from megatron_ds.plan.context import Context
from megatron_ds.plan.hardware import PlanError
from megatron_ds.plan.report import Section
from megatron_ds.units import format_apart, format_bytes

END_HEAVY = 1.15  # first/last stage this much above the middle ones counts as the seed's pattern


def parse_reported(text: str, num_stages: int | None) -> dict[str, float]:
    """`first=10824,middle=8041,last=10980` or one value per stage `10824,8041,8041,10980` (MB)."""
    out: dict[str, float] = {}
    items = [t.strip() for t in text.split(",") if t.strip()]
    try:
        if all("=" in t for t in items):
            for t in items:
                key, value = t.split("=", 1)
                out[key.strip().lower()] = float(value)
        else:
            values = [float(t) for t in items]
            out = {"first": values[0], "last": values[-1]}
            if len(values) > 2:
                out["middle"] = max(values[1:-1])
    except (ValueError, IndexError):
        raise PlanError(
            f"--reported-mb {text!r}: write first=MB,middle=MB,last=MB or one MB value per stage, "
            f"e.g. --reported-mb first=10824,middle=8041,last=10980"
        ) from None
    unknown = set(out) - {"first", "middle", "last"}
    if unknown:
        raise PlanError(f"--reported-mb: unknown key(s) {', '.join(sorted(unknown))}; use first, middle, last")
    bad = {k: v for k, v in out.items() if not 0 < v < math.inf}
    if bad:
        key, value = next(iter(bad.items()))
        raise PlanError(f"--reported-mb {text!r}: {key}={value:g} is not a memory figure; give MB above 0")
    per_stage = not all("=" in t for t in items)
    if num_stages is not None and num_stages < 2:
        raise PlanError(
            f"--reported-mb {text!r}: a 1-stage pipeline has no first and last stages to compare; "
            f"give --pipeline-model-parallel-size of the run"
        )
    if per_stage and num_stages is not None and len(items) != num_stages:
        raise PlanError(
            f"--reported-mb {text!r}: {len(items)} values for a {num_stages}-stage pipeline; give {num_stages} "
            f"values or first=MB,middle=MB,last=MB"
        )
    return out


def current(ctx: Context) -> Candidate:
    """The user's present configuration: fixed flags where given, the `pipeline` plan otherwise."""
    res, raw = ctx.res, ctx.res.raw
    if raw.pipeline_model_parallel_size and raw.micro_batch_size:
        t = raw.tensor_model_parallel_size or 1
        p, mb = raw.pipeline_model_parallel_size, raw.micro_batch_size
        dp = res.num_gpus // (t * p)
        if res.num_gpus % (t * p) or res.global_batch_size % (mb * dp):
            raise PlanError(
                f"--num-gpus {res.num_gpus}, --tensor-model-parallel-size {t}, --pipeline-model-parallel-"
                f"size {p}, --micro-batch-size {mb} and --global-batch-size {res.global_batch_size} do "
                f"not divide: GPUs must be a multiple of t x p and the global batch of micro-batch x "
                f"data-parallel size ({mb} x {max(dp, 1)})"
            )
        zero = raw.zero_stage if raw.zero_stage is not None else 0
        return search.evaluate(
            res,
            t,
            raw.pipeline_model_parallel_size,
            raw.micro_batch_size,
            zero,
            ctx.precision,
            bool(raw.checkpoint_activations),
            raw.layout or "none",
            selective=bool(raw.recompute_activations),
        )
    return ctx.plan()


def memory_section(ctx: Context) -> Section:
    sec = Section("memory", "Memory diagnosis")
    now = current(ctx)
    stages = list(now.stages)
    sec.add(
        f"Configuration analysed: t={now.tp} p={now.pp} d={now.dp}, micro-batch {now.micro_batch_size}, "
        f"ZeRO-{now.zero_stage}{_offloaded(now)}, recompute {now.recompute_label}"
        + (", sequence parallel" if now.sequence_parallel else "")
        + ", layout "
        f"{now.layout.to_string()}."
    )
    _diagnose(ctx, sec, stages, now.schedule.label)
    changes = _changes(ctx, now)
    sec.add(
        "Changes, cheapest first, with the predicted saving on the fullest stage and its memory per GPU after "
        "the change (estimates):"
    )
    for i, c in enumerate(changes, 1):
        saving = (
            f"saves {format_bytes(c.saving)}"
            if c.saving > 0
            else f"adds {format_bytes(-c.saving)} (not advised here)"
            if c.saving < 0
            else "saves nothing"
        )
        sec.add(f"  {i}. {c.name} [{c.flags}]: {saving} ({format_bytes(c.peak)} per GPU); cost: {c.cost}")
    needs_more = _needs_more(ctx, now, changes)
    together = _together(ctx, now) if needs_more else None
    sec.data = {
        "stages": [s.total for s in stages],
        "changes": [dataclasses.asdict(c) for c in changes],
        "together": dataclasses.asdict(together) if together else None,
    }
    if together is not None:
        sec.add(
            f"No single change fits in {format_bytes(ctx.res.usable_bytes)}; together they do: {together.name} "
            f"[{together.flags}]: {format_bytes(together.peak)} per GPU; cost: {together.cost}"
        )
    elif needs_more:
        sec.add(
            f"No single change, nor two together, fits in {format_bytes(ctx.res.usable_bytes)}: split the model over "
            "more GPUs (a larger --tensor-model-parallel-size or --pipeline-model-parallel-size; `pipeline` searches "
            "them) or shorten --seq-length."
        )
    # ranked_changes offers the plain engine's changes (ZeRO 2/3, Ulysses) at pipeline size 1 only
    engine = (
        "pipeline engine (ZeRO 0/1)"
        if now.pp > 1
        else "pipeline engine (ZeRO 0/1) or its plain engine (ZeRO 2/3, Ulysses; pipeline size 1)"
    )
    sec.check(now.zero_stage < 2 or now.pp == 1, f"every suggested change runs on DeepSpeed's {engine}")
    return sec


def _offloaded(now: Candidate) -> str:
    if now.offload_optimizer == "none":
        return ""
    params = f", parameters to {now.offload_param}" if now.offload_param != "none" else ""
    return f" (optimizer offloaded to {now.offload_optimizer}{params})"


def _diagnose(ctx: Context, sec: Section, stages: list[StageMemory], schedule_label: str) -> None:
    reported = parse_reported(ctx.res.raw.reported_mb, len(stages)) if ctx.res.raw.reported_mb else {}
    mid = max((s.total for s in stages[1:-1]), default=None)
    first, last = stages[0], stages[-1]
    if (
        reported.get("middle")
        and max(reported.get("first", 0), reported.get("last", 0)) > END_HEAVY * reported["middle"]
    ):
        sec.add(
            f"Reported pattern: end stages {reported.get('first', 0):.0f}/{reported.get('last', 0):.0f} MB vs "
            f"middle {reported['middle']:.0f} MB: the first stage also holds the word embedding (vocab x hidden, "
            f"with its gradient and optimizer state) and the last the tied LM head, the fp32 logits and the "
            f"loss gradients (b x s x vocab x 4 bytes each), so both exceed stages that hold only layers."
        )
    if mid:
        sec.add(
            f"Predicted for this configuration: first {format_bytes(first.total)}, largest middle "
            f"{format_bytes(mid)}, last {format_bytes(last.total)} (first/middle {first.total / mid:.2f}, "
            f"last/middle {last.total / mid:.2f}"
            + (
                f"; reported {reported['first'] / reported['middle']:.2f} and "
                f"{reported['last'] / reported['middle']:.2f}"
                if {"first", "middle", "last"} <= set(reported)
                else ""
            )
            + ")."
        )
    peak = ctx.res.raw.oom_stage if ctx.res.raw.oom_stage is not None else max(stages, key=lambda s: s.total).stage
    if not 0 <= peak < len(stages):
        raise PlanError(
            f"--oom-stage {peak} is not a stage of this {len(stages)}-stage pipeline; give 0..{len(stages) - 1}"
        )
    st = stages[peak]
    parts = {
        "model states": st.model_states,
        "activations": st.activations,
        "buffers and transients": st.pipe_buffers + st.transient,
    }
    biggest = max(parts, key=parts.get)
    sec.add(
        f"Stage {peak}: {format_bytes(st.total)} predicted, mostly {biggest} "
        f"({', '.join(f'{k} {format_bytes(v)}' for k, v in parts.items())}); it keeps {st.in_flight} "
        f"micro-batch(es) in flight under {schedule_label}."
    )
    if ctx.res.usable_bytes and st.total > ctx.res.usable_bytes:
        need, usable = format_apart(st.total, ctx.res.usable_bytes)
        sec.check(False, f"stage {peak} predicted {need} exceeds {usable}")


def _layout_for(ctx: Context, now: Candidate) -> LayoutFor:
    """The layout a method gives a changed configuration, with `now`'s degrees, as the planner lays it out."""

    def layout_for(inputs: MemoryInputs, method: str) -> Layout:
        return search.layout_for(ctx.res, now.tp, now.pp, method, inputs)

    return layout_for


def _changes(ctx: Context, now: Candidate) -> list[Change]:
    """`estimate.fit_advice`'s changes for this configuration, laid out as the planner lays it out."""
    rebalance = (*partition_methods.planned_methods(), "both") if now.pp > 1 else ()
    return ranked_changes(now.inputs, now.layout, now.method, _layout_for(ctx, now), rebalance, _layout_flags)


def _needs_more(ctx: Context, now: Candidate, changes: list[Change]) -> bool:
    """The configuration does not fit the GPU and no single change makes it fit."""
    usable = ctx.res.usable_bytes
    return bool(usable) and max(s.total for s in now.stages) > usable and all(c.peak > usable for c in changes)


def _together(ctx: Context, now: Candidate) -> Change | None:
    """The cheapest changes together that fit (`fit_advice.fitting_combination`), the memory method rebalancing."""
    layout_for, usable = _layout_for(ctx, now), ctx.res.usable_bytes
    return fitting_combination(now.inputs, now.layout, now.method, layout_for, usable, "memory", _layout_flags)


def _layout_flags(method: str, layout: Layout) -> str:
    flags = search.layout_flag(method, layout)
    if "partition_method" in search.layout_options(method):
        flags += f" (--pp-partition-method {method})"
    return flags
