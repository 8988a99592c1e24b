"""`zero`: model-state memory per GPU for every ZeRO stage and offload side by side, and the stage to use.

Every row of the table (`plan/zero_table.py`) is the memory model's (`estimate/model_states.py`, which follows what DeepSpeed 0.19.8
allocates: benchmarks/zero_memory.py measures it within 1%); for 16-bit ZeRO-2/3 DeepSpeed's own
estimators (`model_states.zero*_estimate`) are shown beside it. Every row is a configuration
pretrain_gpt.py runs: ZeRO 0/1 on DeepSpeed's pipeline engine at any pipeline size, ZeRO 2/3 on its
plain engine at pipeline size 1. The recommendation is the `pipeline` plan's (`zero_options.choose`), with
why: the smallest predicted step of those that fit on the GPUs alone (each other stage's fastest shown
beside it), else the offload option with the smallest estimated step
(`plan/zero_options.py`). Communication volumes per step are from Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", Sec. 7 (in units of the parameter count Psi).
The fixed lines are `guides/zero.txt`.
"""

from __future__ import annotations

from megatron_ds.model.shapes import total_params
from megatron_ds.plan import ds_json, zero_options
from megatron_ds.plan.candidate import Candidate
from megatron_ds.plan.context import NEEDS_BATCH, Context
from megatron_ds.plan.hardware import PlanError
from megatron_ds.plan.inputs import GIB
from megatron_ds.plan.ranking import Search
from megatron_ds.plan.report import Section, guide
from megatron_ds.plan.time_report import describe, slower_by
from megatron_ds.plan.zero_table import (
    Row,
    activation_bytes,
    expert_parallel_size,
    has_experts,
    rows,
    teacher,
    teacher_bytes,
)
from megatron_ds.training import deepspeed_config
from megatron_ds.units import format_bytes, format_seconds


def zero_section(ctx: Context) -> Section:
    res = ctx.res
    sec = Section("zero", "ZeRO stage")
    table, act, kd = rows(ctx), activation_bytes(ctx), teacher_bytes(ctx)
    ep, _ = expert_parallel_size(ctx)
    found = teacher(ctx)
    sec.add(*_header(ctx, act, kd, found))
    sec.add(*_table(table, act + kd, res.usable_bytes))
    sec.add(*_notes(ctx, table))
    sec.data = {
        "parameters": total_params(res.model()),
        "activation_bytes": act,
        "usable_bytes": res.usable_bytes,
        "rows": [
            {
                **{k: v for k, v in r.__dict__.items() if k not in ("refused", "plain_only") or v},
                "engine": r.engine,
                "fits": r.gpu_states is not None and r.gpu_states + act + kd <= res.usable_bytes,
            }
            for r in table
        ],
    }
    if has_experts(ctx):
        sec.data["expert_parallel_size"] = ep
    if found is not None:
        sec.data["teacher_weight_bytes"] = kd
    cpu_cap = res.raw.cpu_memory_gb * GIB if res.raw.cpu_memory_gb else None
    _recommend(ctx, sec, table, act, cpu_cap)
    return sec


def _header(ctx: Context, act: float, kd: float, found: tuple | None) -> list[str]:
    """The model, the GPUs and what every row adds: activations, the experts' split, the teacher's weights."""
    res = ctx.res
    usable, psi = res.usable_bytes, total_params(res.model())
    ep, ep_source = expert_parallel_size(ctx)
    lines = [
        f"Model: {psi / 1e9:.2f} B parameters, {ctx.precision}, Adam; {res.num_gpus} GPU(s) "
        f"({res.gpus_per_node} per node), {format_bytes(usable)} usable per GPU "
        f"({1 - res.headroom:.0%} of {format_bytes(res.gpu_memory_bytes)}).",
        f"Per-GPU model states with pure data parallelism over all {res.num_gpus} GPU(s) (estimates), plus "
        f"{format_bytes(act)} of activations for micro-batch {res.raw.micro_batch_size or 1} "
        f"(Korthikanti et al. 2022 per-tensor count, see docs/planner.md):",
    ]
    if has_experts(ctx):
        whose = "each MoE layer's" if res.model().is_moe else "the teacher's MoE layers'"
        lines.append(
            f"  at expert-parallel size E = {ep} ({ep_source}): {whose} experts / {ep} on each GPU"
            + (
                f", their parameters, gradients and optimizer state partitioned over the {max(1, res.num_gpus // ep)} "
                "GPU(s) holding the same experts (d / E), the rest over all d; DeepSpeed's estimators know no experts"
                if res.model().is_moe
                else ""
            )
            + ";"
        )
    if found is not None:
        model, t = found
        at = "" if t == 1 else f" at tensor size {t} (the smallest the trainer accepts it at)"
        experts_note = f", experts / {ep} of each MoE layer" if model.is_moe else ""
        lines.append(
            f"  plus the teacher's weights{at}: {format_bytes(kd)} per GPU on every row ({res.raw.kd and '--kd' or '--mos'}"
            f"{experts_note}; frozen and outside the engine: no gradient or optimizer state, not partitioned by ZeRO, "
            "not offloaded), counted in 'w/ activ.';"
        )
    return lines


def _table(table: list[Row], beside: float, usable: float) -> list[str]:
    """One line per ZeRO stage and offload: the states on a GPU (and DeepSpeed's estimate), whether they fit with
    `beside` (activations and a teacher's weights), the CPU memory per node, the engine."""
    lines = [f"  {'configuration':<48} {'GPU states':>11} {'DeepSpeed':>10} {'w/ activ.':>10} {'CPU/node':>10}  engine"]
    for r in table:
        if r.gpu_states is None:
            lines.append(f"  {r.label:<48} {'refused':>11}  (pretrain_gpt.py runs no ZeRO-3 with experts, below)")
            continue
        cpu = format_bytes(r.cpu_per_node) if r.cpu_per_node is not None else "n/a"
        theirs = format_bytes(r.deepspeed_gpu) if r.deepspeed_gpu is not None else "-"
        fits = "fits" if r.gpu_states + beside <= usable else "too big"
        lines.append(f"  {r.label:<48} {format_bytes(r.gpu_states):>11} {theirs:>10} {fits:>10} {cpu:>10}  {r.engine}")
    return lines


def _notes(ctx: Context, table: list[Row]) -> list[str]:
    """The guide's account of each stage and offload, and what the trainer refuses or restricts."""
    text = guide("zero")
    lines = [
        text["sources"],
        text["communication"],
        *(f"  ZeRO-{s}: {text[f'zero-{s}']}" for s in range(4)),
        f"  CPU offload: {text['cpu-offload']}.",
        f"  NVMe offload: {text['nvme-offload']}.",
    ]
    refused = next((r.refused for r in table if r.refused), None)
    if refused:
        lines.append(f"ZeRO-3 with experts, in the trainer's words: {refused}")
    experts = has_experts(ctx)
    if experts or ctx.res.distils:
        lines.append(
            "With "
            + ("experts" if experts else "a teacher")
            + ", pretrain_gpt.py trains on DeepSpeed's plain engine at pipeline size 1"
            + (" and tensor size 1" if experts else "")
            + "; the plan below is chosen among what it runs"
            + (" at every expert-parallel size" if experts and not ctx.res.raw.moe_expert_parallel_size else "")
            + ", offload not planned."
        )
    return lines


def _recommend(ctx: Context, sec: Section, table: list[Row], act: float, cpu_cap: float | None) -> None:
    """The `pipeline` plan, and why: the fastest configuration that fits on the GPUs, else the fastest offload."""
    if ctx.res.global_batch_size is None:
        sec.add(f"No recommendation: {NEEDS_BATCH}.")
        return
    try:
        plan = ctx.plan()
    except PlanError as e:
        sec.add(f"No configuration fits for pretrain_gpt.py: {e}")
        sec.check(False, "model fits in GPU memory with a ZeRO stage pretrain_gpt.py runs")
        return
    where = f"tensor parallel {plan.tp} x pipeline parallel {plan.pp} (data parallel {plan.dp})"
    label = next(
        (
            r.label
            for r in table
            if (r.stage, r.offload_optimizer, r.offload_param)
            == (plan.zero_stage, plan.offload_optimizer, plan.offload_param)
        ),
        f"ZeRO-{plan.zero_stage}",
    )
    engine = "DeepSpeed's plain engine (pipeline size 1)" if plan.engine == "plain" else "DeepSpeed's pipeline engine"
    if plan.offload_optimizer == "none":
        sec.add(
            f"Recommended for pretrain_gpt.py (as `pipeline`): {label} with {where} on {engine}: the smallest "
            f"predicted step of the configurations that fit on the GPUs alone ({format_seconds(plan.seconds)}; "
            "ZeRO 0/1 priced at every t x p, ZeRO-2/3 at pipeline size 1; `pipeline` says where the time goes).",
        )
        ranked = ctx.choice().ranked
        others = _other_stages(ranked)
        for c in others:
            sec.add(
                f"  fastest with ZeRO-{c.zero_stage}: {describe(c)}: {format_seconds(c.seconds)} "
                f"({slower_by(c.seconds, ranked[0].seconds)})"
            )
        sec.data["other_zero_stages"] = [
            {"zero_stage": c.zero_stage, "tp": c.tp, "pp": c.pp, "dp": c.dp, "micro_batch_size": c.micro_batch_size,
             "step_seconds": c.seconds}
            for c in others
        ]  # fmt: skip
    else:
        _offload_reason(ctx, sec, label, where, engine)
    sec.check(plan.zero_stage < 2 or plan.pp == 1, f"ZeRO-{plan.zero_stage} at pipeline size {plan.pp} runs")
    _snippet_for(ctx, sec, plan)
    if cpu_cap is None and plan.offload_optimizer == "cpu":
        sec.check(None, "host memory for the offloaded model states not checked: give --cpu-memory-gb (per node)")


def _other_stages(ranked: list[Candidate]) -> list[Candidate]:
    """The fastest fitting configuration of each ZeRO stage the choice (`ranked[0]`) does not use, by stage."""
    best: dict[int, Candidate] = {}
    for c in ranked[1:]:
        if c.zero_stage != ranked[0].zero_stage and c.zero_stage not in best:
            best[c.zero_stage] = c  # ranked is fastest first
    return [best[z] for z in sorted(best)]


def _offload_reason(ctx: Context, sec: Section, label: str, where: str, engine: str) -> None:
    """Nothing fits on the GPUs alone: the fitting offload options by estimated step, the fastest chosen."""
    choice = zero_options.choose_offload(Search(ctx.res, ctx.precision))
    sec.add(
        f"Recommended for pretrain_gpt.py (as `pipeline`): {label} with {where} on {engine}: nothing fits on "
        f"the GPUs alone; of the offload options that fit, the smallest estimated step (the predicted step on "
        f"the GPUs, estimate/step_time.py, plus the traffic and CPU work each adds, estimate/zero_time.py):"
    )
    for t in choice.timed if choice else []:
        terms = "; ".join(f"{k} {format_seconds(v)}" for k, v in t.overheads.items())
        c = t.candidate
        sec.add(
            f"  {t.option.label} (t={c.tp}, p={c.pp}, micro-batch {c.micro_batch_size}, recompute "
            f"{'off' if c.recompute == 'none' else c.recompute}): {format_seconds(t.seconds)} = GPU step {format_seconds(t.compute)}"
            + (f"; {terms}" if terms else "")
        )


def _snippet_for(ctx: Context, sec: Section, plan) -> None:
    """The DeepSpeed JSON and the command of the recommendation."""
    config = ds_json.plan_config(ctx.res, plan)
    sec.snippets["DeepSpeed JSON"] = deepspeed_config.generate(config)
    sec.snippets["command"] = ds_json.command_line(ctx.res, config)
    sec.data["recommended"] = {
        "zero_stage": plan.zero_stage,
        "offload_optimizer": plan.offload_optimizer,
        "offload_param": plan.offload_param,
        "tp": plan.tp,
        "pp": plan.pp,
        "micro_batch_size": plan.micro_batch_size,
    }
