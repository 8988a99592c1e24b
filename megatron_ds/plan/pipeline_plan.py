"""`pipeline`: degrees, micro-batches, the stage layout exactly as `pretrain_gpt.py --print-layout`
prints it, predicted memory per stage, the bubble, the DeepSpeed JSON and the command line."""

from __future__ import annotations

from megatron_ds.estimate.layout_costs import format_memory_table
from megatron_ds.estimate.memory_model import format_bytes
from megatron_ds.pipeline import methods as partition_methods
from megatron_ds.pipeline.layout import LayoutError
from megatron_ds.plan import ds_json, search
from megatron_ds.plan.context import Context
from megatron_ds.plan.hardware import PlanError
from megatron_ds.plan.report import Section
from megatron_ds.training import deepspeed_config


def method_description(method: str) -> str:
    """What a `--layout` choice means, for the report."""
    options = search.layout_options(method)
    if "partition_method" in options:
        summary = partition_methods.find(method).summary
        return f"--pp-partition-method {method}: {summary}; passed as the equivalent --pp-layout"
    if "dedicated" in options:
        return f"--pp-dedicated-embedding-stages {method}"
    return f"the default {partition_methods.DEFAULT_METHOD} partition"


def pipeline_section(ctx: Context) -> Section:
    res = ctx.res
    res.require(["model", "num_gpus", "gpu_memory", "global_batch_size"], "`pipeline`")
    if res.raw.zero_stage in (2, 3):
        raise PlanError(
            f"--zero-stage {res.raw.zero_stage}: pretrain_gpt.py always runs DeepSpeed's pipeline engine "
            f"(GPTModelPipe is a PipelineModule, even at --pipeline-model-parallel-size 1), which "
            f"accepts ZeRO 0 and 1 only; use --zero-stage 1"
        )
    plan = ctx.plan()
    sec = Section("pipeline", "Pipeline and tensor parallelism")
    sec.add(
        f"Degrees: tensor parallel {plan.tp} x pipeline parallel {plan.pp} x data parallel {plan.dp} = "
        f"{res.num_gpus} GPUs.",
        f"Batch: global {res.global_batch_size} = micro-batch {plan.micro_batch_size} x {plan.num_micro_batches} "
        f"micro-batches (gradient accumulation steps) x data parallel {plan.dp}.",
        f"Precision {plan.precision}, ZeRO-{plan.zero_stage}, activation recomputation "
        f"{'on' if plan.checkpoint_activations else 'off'}.",
        f"Layout method: {plan.method} ({method_description(plan.method)}); the table below is what "
        f"`pretrain_gpt.py --print-layout` prints for the command further down:",
        "",
    )
    sec.add(*plan.layout.format(plan.dp, plan.tp).splitlines(), "")
    sec.add(*format_memory_table(plan.stages, res.usable_bytes).splitlines())
    sec.add(
        f"Pipeline bubble (estimate, Narayanan et al. 2021 eq. 1, equal stage times assumed): (p-1)/m = "
        f"{plan.bubble:.1%} of the ideal step time; DeepSpeed TrainSchedule runs 2(m+p-1) steps of which 2m "
        f"compute, so each stage idles {plan.idle_fraction:.1%} of them."
    )
    _compare_layouts(ctx, sec, plan)
    config = ds_json.plan_config(res, plan)
    sec.snippets["DeepSpeed JSON"] = deepspeed_config.generate(config)
    sec.snippets["command"] = ds_json.command_line(res, config)
    sec.data = _data(plan)
    _checks(ctx, sec, plan)
    return sec


def _compare_layouts(ctx: Context, sec: Section, plan: search.Candidate) -> None:
    """Largest stage under each layout method for the same degrees and batch (the seed's question)."""
    if plan.pp < 2:
        return
    sec.add("Largest stage by layout method, same degrees and batch (estimates):")
    for method in search.METHODS:
        try:
            cand = search.evaluate(
                ctx.res,
                plan.tp,
                plan.pp,
                plan.micro_batch_size,
                plan.zero_stage,
                plan.precision,
                plan.checkpoint_activations,
                method,
            )
        except LayoutError as e:
            sec.add(f"  {method:<7} not possible: {e}")
            continue
        counts = " ".join(map(str, cand.layout.layers_per_stage))
        sec.add(f"  {method:<7} {format_bytes(cand.peak.total):>10} on stage {cand.peak.stage:<3} layers {counts}")


def _data(plan: search.Candidate) -> dict:
    return {
        "tensor_parallel": plan.tp,
        "pipeline_parallel": plan.pp,
        "data_parallel": plan.dp,
        "micro_batch_size": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.num_micro_batches,
        "precision": plan.precision,
        "zero_stage": plan.zero_stage,
        "checkpoint_activations": plan.checkpoint_activations,
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
            }
            for s in plan.stages
        ],
    }


def _checks(ctx: Context, sec: Section, plan: search.Candidate) -> None:
    res = ctx.res
    gbs, mb, m, dp = res.global_batch_size, plan.micro_batch_size, plan.num_micro_batches, plan.dp
    sec.check(
        gbs == mb * m * dp, f"batch arithmetic: global {gbs} = micro {mb} x accumulation {m} x data parallel {dp}"
    )
    sec.check(plan.tp * plan.pp * dp == res.num_gpus, f"degrees: {plan.tp} x {plan.pp} x {dp} = {res.num_gpus} GPUs")
    sec.check(plan.zero_stage in (0, 1), f"ZeRO-{plan.zero_stage} on DeepSpeed's pipeline engine (accepts 0 and 1)")
    sec.check(
        res.dims["num_attention_heads"] % plan.tp == 0,
        f"tensor parallel {plan.tp} divides {res.dims['num_attention_heads']} attention heads",
    )
    sec.check(
        plan.tp <= (res.gpus_per_node or 1),
        f"tensor parallel {plan.tp} stays inside a node of {res.gpus_per_node} GPUs",
    )
    middle = plan.layout.layers_per_stage[1:-1]
    sec.check(all(k >= 1 for k in middle), "every middle stage holds at least one transformer layer")
    peak = plan.peak
    sec.check(
        peak.total <= res.usable_bytes,
        f"memory: largest stage {peak.stage} needs {format_bytes(peak.total)} "
        f"of {format_bytes(res.usable_bytes)} usable (estimate)",
    )
    if res.gpus_per_node_assumed:
        sec.check(None, f"GPUs per node not given: assumed {res.gpus_per_node} (--gpus-per-node)")
    sec.check(None, "step time and throughput: not estimated (no compute model); the bubble assumes equal stage times")
