"""`pipeline`: degrees, micro-batches, the stage layout exactly as `pretrain_gpt.py --print-layout`
prints it, predicted memory and time per stage, the simulated step, the DeepSpeed JSON and the
command line."""

from __future__ import annotations

from megatron_ds.config.parallel import DEFAULT_PIPELINE_SCHEDULE
from megatron_ds.estimate import pipeline_schedules
from megatron_ds.estimate.layout_costs import format_memory_table
from megatron_ds.pipeline import methods as partition_methods
from megatron_ds.plan import ds_json, ranking, runnable_schedules, search, time_report
from megatron_ds.plan.candidate import Candidate
from megatron_ds.plan.context import Context
from megatron_ds.plan.report import Section
from megatron_ds.training import deepspeed_config
from megatron_ds.units import format_bytes, format_seconds


def method_description(method: str) -> str:
    """What a `--layout` choice means, for the report."""
    options = search.layout_options(method)
    if "partition_method" in options:
        summary = partition_methods.find(method).summary
        return f"--pp-partition-method {method}: {summary}; passed as the equivalent --pp-layout"
    if "dedicated" in options:
        return f"--pp-dedicated-embedding-stages {method}"
    return f"the default {partition_methods.DEFAULT_METHOD} partition"


RECOMPUTE_TEXT = {"none": "off", "selective": "selective (the core attention)", "full": "on (full layers)"}


def pipeline_section(ctx: Context) -> Section:
    res = ctx.res
    plan = ctx.plan()
    sec = Section("pipeline", "Pipeline and tensor parallelism")
    sec.add(
        f"Degrees: tensor parallel {plan.tp} x pipeline parallel {plan.pp} x data parallel {plan.dp} = "
        f"{res.num_gpus} GPU{'s' if res.num_gpus != 1 else ''}"
        + (
            f"; expert parallel {plan.expert_parallel_size} ({_whose_experts(plan)} shared out over "
            f"{plan.expert_parallel_size} consecutive data-parallel ranks, reached by all-to-alls)."
            if plan.inputs.model.is_moe or _moe_teacher(plan)
            else "."
        ),
        *([_teacher_line(plan, "--mos" if res.raw.mos else "--kd")] if plan.inputs.teacher is not None else []),
        f"Batch: global {res.global_batch_size} = micro-batch {plan.micro_batch_size} x {plan.num_micro_batches} "
        f"micro-batches (gradient accumulation steps) x data parallel {plan.dp}.",
        f"Precision {plan.precision}, ZeRO-{plan.zero_stage}{_offload_text(plan)}, activation recomputation "
        f"{RECOMPUTE_TEXT[plan.recompute]}"
        + (", sequence parallel" if plan.sequence_parallel else "")
        + (f", pipeline schedule {plan.schedule.display}" if plan.pp > 1 else "")
        + ".",
        f"Layout method: {plan.method} ({method_description(plan.method)}); the table below is what "
        f"`pretrain_gpt.py --print-layout` prints for the command further down:",
        "",
    )
    sec.add(*plan.layout.format(plan.dp, plan.tp).splitlines(), "")
    sec.add(*format_memory_table(plan.stages, res.usable_bytes).splitlines(), "")
    sec.add(*time_report.stage_table(plan), *time_report.step_lines(res, plan))
    runner_up = ctx.choice().runner_up
    sec.add(*time_report.runner_up_lines(plan, runner_up))
    schedule = plan.schedule
    sec.add(
        f"Pipeline bubble with equal stages ({schedule.display}: {schedule.bubble_formula}): {plan.bubble:.1%} of the "
        f"ideal step time, so each stage idles {plan.idle_fraction:.1%} of the step (the schedule replayed with "
        f"forward 1, backward 2, weight gradients 1)."
    )
    _compare_layouts(ctx, sec, plan)
    _compare_schedules(ctx, sec, plan)
    config = ds_json.plan_config(res, plan)
    sec.snippets["DeepSpeed JSON"] = deepspeed_config.generate(config)
    sec.snippets["command"] = ds_json.command_line(res, config)
    sec.data = {**_data(plan), **time_report.time_data(plan, runner_up)}
    _checks(ctx, sec, plan)
    return sec


def _offload_text(plan: Candidate) -> str:
    engine = " on DeepSpeed's plain engine (pipeline size 1)" if plan.engine == "plain" else ""
    if plan.offload_optimizer == "none":
        return engine
    what = "optimizer and parameters" if plan.offload_param != "none" else "optimizer"
    return (
        f"{engine} with the {what} offloaded to {plan.offload_optimizer.upper()} (host memory per GPU: "
        f"{format_bytes(plan.host_per_gpu)} on the fullest stage; nothing on the GPUs alone fits; see `zero`)"
    )


def _compare_layouts(ctx: Context, sec: Section, plan: Candidate) -> None:
    """Largest stage and predicted step under each layout method tried, same degrees, batch and schedule."""
    if plan.pp < 2 or ctx.res.raw.layout:
        return
    own = (plan.inputs.schedule, plan.virtual_stages)
    tried = {t.method: t for t in ctx.choice().alternatives(ctx.res) if t.schedule == own}
    sec.add("Largest stage and predicted step by layout method, same degrees, batch and schedule (estimates):")
    for method in search.METHODS:
        t = tried.get(method)
        if t is None and method in ranking.refine_methods(ctx.res, plan.pp, plan.num_micro_batches):
            sec.add(f"  {method:<7} not tried under {plan.schedule.display} (the exact search runs under the "
                    f"search's own schedule; --layout {method} runs it)")  # fmt: skip
        elif t is None:
            size = f"{plan.pp} stages x {plan.num_micro_batches} micro-batches"
            sec.add(f"  {method:<7} not tried at {size} (exact search; --layout {method} runs it)")
        elif t.candidate is None:
            sec.add(f"  {method:<7} not possible: {t.error}")
        else:
            cand = t.candidate
            counts = " ".join(map(str, cand.layout.layers_per_stage))
            fit = "" if search.fits(ctx.res, cand) else "  (does not fit)"
            sec.add(
                f"  {method:<7} {format_bytes(cand.peak.total):>10} on stage {cand.peak.stage:<3} step "
                f"{format_seconds(cand.seconds, 4)}  layers {counts}{fit}"
            )


def _compare_schedules(ctx: Context, sec: Section, plan: Candidate) -> None:
    """Each pipeline schedule's fastest layout that fits, same degrees and batch (`ranking.alternatives`)."""
    if plan.pp < 2 or plan.engine != "pipeline":
        return
    tried = ctx.choice().alternatives(ctx.res)
    best = {}
    for schedule in dict.fromkeys(t.schedule for t in tried):
        fastest = ranking.fastest_tried(ctx.res, [t for t in tried if t.schedule == schedule])
        if fastest is not None:
            best[schedule] = fastest
    sec.add("Pipeline schedules, each with its fastest layout that fits (same degrees and batch; estimates):")
    for schedule, c in sorted(best.items(), key=lambda kv: (kv[1].seconds, runnable_schedules.schedule_order(kv[0]))):
        name, v = schedule
        flags = [f"--pp-schedule {name}" if name != DEFAULT_PIPELINE_SCHEDULE else ""]
        flags += [
            f"--num-virtual-stages-per-pipeline-rank {v}" if v > 1 else "",
            search.layout_flag(c.method, c.layout),
        ]
        sec.add(
            f"  {c.schedule.display:<22} step {format_seconds(c.seconds, 4)} ({c.seconds / plan.seconds:.3f} x the choice)  "
            f"largest stage {format_bytes(c.peak.total)}  {' '.join(f for f in flags if f)}".rstrip()
        )
    skipped = runnable_schedules.too_long_to_replay(ctx.res, plan.tp, plan.pp, plan.micro_batch_size, plan.zero_stage)
    for name, v in skipped:
        label = pipeline_schedules.find(name, v).display
        size = plan.num_micro_batches * plan.pp * v
        sec.add(f"  {label:<22} not priced: {size:,} micro-batch steps to replay, over {search.REPLAY_LIMIT:,}")


def _data(plan: Candidate) -> dict:
    return {
        "tensor_parallel": plan.tp,
        "pipeline_parallel": plan.pp,
        "data_parallel": plan.dp,
        "micro_batch_size": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.num_micro_batches,
        "precision": plan.precision,
        "zero_stage": plan.zero_stage,
        "offload_optimizer": plan.offload_optimizer,
        "offload_param": plan.offload_param,
        "engine": plan.engine,
        "checkpoint_activations": plan.checkpoint_activations,
        "selective_recompute": plan.selective_recompute,
        "sequence_parallel": plan.sequence_parallel,
        "pipeline_schedule": plan.inputs.schedule,
        "virtual_stages": plan.virtual_stages,
        "layout_method": plan.method,
        "layout": plan.layout.to_string(),
        "layers_per_stage": list(plan.layout.layers_per_stage),
        "layout_text": plan.layout.format(plan.dp, plan.tp),
        "bubble_fraction": plan.bubble,
        "idle_fraction": plan.idle_fraction,
        "stages": [
            {
                "stage": s.stage,
                "layers": s.num_layers,
                "params": s.params,
                "grads": s.grads,
                "optimizer": s.optimizer,
                "activations": s.activations,
                "in_flight": s.in_flight,
                "pipe_buffers": s.pipe_buffers,
                "transient": s.transient,
                "total": s.total,
                "host": s.host,
                "forward_gflop": t.forward,
                "backward_gflop": t.backward,
                "forward_seconds": plan.time.rank_forward[s.stage],
                "backward_seconds": plan.time.rank_backward[s.stage],
            }
            for s, t in zip(plan.stages, plan.rank_times)
        ],
    }


def _checks(ctx: Context, sec: Section, plan: Candidate) -> None:
    res = ctx.res
    gbs, mb, m, dp = res.global_batch_size, plan.micro_batch_size, plan.num_micro_batches, plan.dp
    sec.check(
        gbs == mb * m * dp, f"batch arithmetic: global {gbs} = micro {mb} x accumulation {m} x data parallel {dp}"
    )
    sec.check(plan.tp * plan.pp * dp == res.num_gpus, f"degrees: {plan.tp} x {plan.pp} x {dp} = {res.num_gpus} GPUs")
    sec.check(
        plan.zero_stage < 2 or plan.pp == 1,
        f"ZeRO-{plan.zero_stage} at pipeline size {plan.pp}: "
        + ("DeepSpeed's pipeline engine takes ZeRO 0 and 1" if plan.zero_stage < 2 else "DeepSpeed's plain engine"),
    )
    sec.check(
        res.dims["num_attention_heads"] % plan.tp == 0,
        f"tensor parallel {plan.tp} divides {res.dims['num_attention_heads']} attention heads",
    )
    sec.check(
        plan.tp <= (res.gpus_per_node or 1),
        f"tensor parallel {plan.tp} stays inside a node of {res.gpus_per_node} GPUs",
    )
    if res.raw.sequence_parallel and plan.tp == 1:  # what pretrain_gpt.py says of the same flags
        sec.check(
            False,
            "--sequence-parallel changes nothing at tensor parallel 1 (Megatron-LM turns it off): planned without it",
            blocking=False,
        )
    middle = plan.layout.layers_per_stage[1:-1]
    sec.check(all(k >= 1 for k in middle), "every middle stage holds at least one transformer layer")
    peak = plan.peak
    sec.check(
        peak.total <= res.usable_bytes,
        f"memory: largest stage {peak.stage} needs {format_bytes(peak.total)} "
        f"of {format_bytes(res.usable_bytes)} usable (estimate)",
    )
    if plan.offload_optimizer != "none":
        per_node = plan.host_per_gpu * (res.gpus_per_node or 1)
        cpu_gb = res.raw.cpu_memory_gb
        sec.check(
            None if cpu_gb is None else per_node <= cpu_gb * 2**30,
            f"host memory for the offloaded model states: about {format_bytes(per_node)} per node"
            + (" (give --cpu-memory-gb to check it)" if cpu_gb is None else f" of {cpu_gb:g} GB"),
        )
    if res.gpus_per_node_assumed:
        sec.check(None, f"GPUs per node not given: assumed {res.gpus_per_node} (--gpus-per-node)")
    sec.check(
        None,
        f"step time: a prediction (estimate/step_time.py through the {plan.schedule.label} schedule), not a "
        "measurement; benchmarks/planner_vs_published.py states its error against published runs",
        blocking=False,
    )


def _teacher_line(plan: Candidate, flag: str) -> str:
    """What a distilling plan adds to every rank (`estimate/distillation_costs.py`)."""
    teacher, stage = plan.inputs.teacher, plan.peak
    assert plan.time is not None and teacher is not None
    parts = plan.time.parts
    exchange = parts.get("teacher all-to-all", 0.0)
    forward = parts.get("teacher forward", 0.0) + exchange
    share = f"1/{plan.tp} of them"
    if teacher.is_moe:
        share = f"its dense parts and gates, experts / {plan.expert_parallel_size} of each MoE layer"
    return (
        f"Teacher ({flag}): {teacher.num_layers} layers, hidden {teacher.hidden_size}, {teacher.num_attention_heads} "
        + (f"heads, --num-experts {' '.join(map(str, teacher.num_experts))}" if teacher.is_moe else "heads")
        + f"; its weights {format_bytes(stage.teacher)} per GPU ({share}, frozen: no gradient or optimizer state); "
        f"its forward {forward * 1e3:.1f} ms"
        + (f" ({exchange * 1e3:.1f} ms of it all-to-alls)" if exchange else "")
        + f" and the kd loss {parts.get('kd loss', 0.0) * 1e3:.1f} ms per micro-batch."
    )


def _whose_experts(plan: Candidate) -> str:
    """Whose MoE layers the expert-parallel groups share out: the student's, the teacher's or both."""
    if not _moe_teacher(plan):
        return "each MoE layer's experts"
    if plan.inputs.model.is_moe:
        return "each MoE layer's experts, the student's and the teacher's,"
    return "each of the teacher's MoE layers' experts"


def _moe_teacher(plan: Candidate) -> bool:
    """The plan distils from a mixture-of-experts teacher (it shares the student's expert-parallel groups)."""
    return plan.inputs.teacher is not None and plan.inputs.teacher.is_moe
