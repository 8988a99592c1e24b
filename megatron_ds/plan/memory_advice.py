"""`memory`: from a reported out-of-memory or per-stage memory pattern to the likely cause and an
ordered list of changes, each with its predicted saving on the fullest stage and its cost."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_ds.estimate.memory_inputs import StageMemory
from megatron_ds.estimate.memory_model import stage_memory
from megatron_ds.pipeline import methods as partition_methods
from megatron_ds.pipeline.layout import LayoutError
from megatron_ds.plan import search
from megatron_ds.plan.context import Context
from megatron_ds.plan.hardware import PlanError
from megatron_ds.plan.report import Section
from megatron_ds.units import format_bytes

END_HEAVY = 1.15  # first/last stage this much above the middle ones counts as the seed's pattern


@dataclass(frozen=True)
class Change:
    name: str
    flags: str
    saving: float
    cost: str
    cost_rank: int  # 0: no throughput cost, 1: some, 2: large


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
    return out


def current(ctx: Context) -> search.Candidate:
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
        )
    return ctx.plan()


def memory_section(ctx: Context) -> Section:
    sec = Section("memory", "Memory diagnosis")
    now = current(ctx)
    stages = list(now.stages)
    sec.add(
        f"Configuration analysed: t={now.tp} p={now.pp} d={now.dp}, micro-batch {now.micro_batch_size}, "
        f"ZeRO-{now.zero_stage}, recompute {'on' if now.checkpoint_activations else 'off'}, layout "
        f"{now.layout.to_string()}."
    )
    _diagnose(ctx, sec, stages)
    changes = sorted(_changes(ctx, now), key=lambda c: (c.cost_rank, -c.saving))
    sec.add("Changes, cheapest first, with the predicted saving on the fullest stage (estimates):")
    for i, c in enumerate(changes, 1):
        saving = (
            f"saves {format_bytes(c.saving)}"
            if c.saving > 0
            else f"adds {format_bytes(-c.saving)} (not advised here)"
            if c.saving < 0
            else "saves nothing"
        )
        sec.add(f"  {i}. {c.name} [{c.flags}]: {saving}; cost: {c.cost}")
    sec.data = {"stages": [s.total for s in stages], "changes": [dataclasses.asdict(c) for c in changes]}
    sec.check(now.zero_stage in (0, 1), "every suggested change keeps ZeRO 0/1 (pipeline engine)")
    return sec


def _diagnose(ctx: Context, sec: Section, stages: list[StageMemory]) -> None:
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
        f"micro-batch(es) in flight under 1F1B."
    )
    if ctx.res.usable_bytes and st.total > ctx.res.usable_bytes:
        sec.check(
            False, f"stage {peak} predicted {format_bytes(st.total)} exceeds {format_bytes(ctx.res.usable_bytes)}"
        )


def _peak(ctx: Context, now: search.Candidate, **changes) -> search.Candidate | None:
    vals = {
        "tp": now.tp,
        "pp": now.pp,
        "mb": now.micro_batch_size,
        "zero": now.zero_stage,
        "precision": now.precision,
        "ckpt": now.checkpoint_activations,
        "method": now.method,
        **changes,
    }
    try:
        return search.evaluate(ctx.res, **vals)
    except (LayoutError, ValueError, ZeroDivisionError):
        return None


def _saving(base: float, cand: search.Candidate | None) -> float:
    return 0.0 if cand is None else base - cand.peak.total


def _changes(ctx: Context, now: search.Candidate) -> list[Change]:
    base, out = now.peak.total, []
    if now.pp > 1:
        for method in (*partition_methods.planned_methods(), "both"):
            cand = _peak(ctx, now, method=method)
            if cand is None or method == now.method or _saving(base, cand) <= 0:
                continue
            flags = search.layout_flag(method, cand.layout)
            if "partition_method" in search.layout_options(method):
                flags += f" (--pp-partition-method {method})"
            out.append(
                Change(
                    f"rebalance stages ({method})",
                    flags,
                    _saving(base, cand),
                    "none in memory or communication; stage times become unequal",
                    0,
                )
            )
    if now.zero_stage == 0 and now.dp > 1:
        out.append(
            Change(
                "ZeRO-1",
                "--zero-stage 1",
                _saving(base, _peak(ctx, now, zero=1)),
                "same communication volume as data parallelism (ZeRO paper Sec. 7)",
                0,
            )
        )
    if not now.checkpoint_activations:
        out.append(
            Change(
                "activation recomputation",
                "--checkpoint-activations",
                _saving(base, _peak(ctx, now, ckpt=True)),
                "about one extra forward per layer, ~1/3 more compute (Korthikanti et al. 2022)",
                1,
            )
        )
    half = now.micro_batch_size // 2
    if half and ctx.res.global_batch_size % (half * now.dp) == 0:
        out.append(
            Change(
                "halve the micro-batch",
                f"--micro-batch-size {half}",
                _saving(base, _peak(ctx, now, mb=half)),
                "smaller matrix multiplies (lower GPU efficiency); twice the micro-batches, which shrinks the bubble",
                1,
            )
        )
    out.append(_offload_change(ctx, now))
    out.append(
        Change(
            "1-bit Adam / 0/1 Adam / 1-bit LAMB",
            "optimizer type OneBitAdam etc.",
            0.0,
            "no memory saving: they compress gradient communication and keep Adam's states plus error-"
            "feedback buffers; not in the installed DeepSpeed and incompatible with ZeRO (see `onebit`)",
            2,
        )
    )
    return out


def _offload_change(ctx: Context, now: search.Candidate) -> Change:
    inputs = dataclasses.replace(now.inputs, zero_stage=max(1, now.zero_stage), offload_optimizer="cpu")
    new = max(s.total for s in stage_memory(inputs, now.layout))
    return Change(
        "offload optimizer states to CPU",
        "zero_optimization.offload_optimizer.device=cpu, zero_force_ds_cpu_optimizer=false",
        now.peak.total - new,
        "PCIe traffic every step and a CPU optimizer step (torch AdamW on CPU unless the engine switches "
        "to DeepSpeedCPUAdam); needs host memory",
        2,
    )
