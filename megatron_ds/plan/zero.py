"""`zero`: model-state memory per GPU for every ZeRO stage side by side, and the stage to use.

Rows for stages 2 and 3 (16-bit) are DeepSpeed's own estimator formulas (`model_states.zero*_estimate`);
stages 0 and 1 use the byte factors of `model_states.state_factors`. Communication volumes per
step are from Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", Sec. 7 (in units of the parameter count Psi). The fixed lines are `guides/zero.txt`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ds.estimate.memory_inputs import MemoryInputs
from megatron_ds.estimate.memory_model import stage_memory_for
from megatron_ds.estimate.model_states import state_factors, zero2_estimate, zero3_estimate
from megatron_ds.model.shapes import largest_layer_params, total_params
from megatron_ds.plan import ds_json
from megatron_ds.plan.context import Context
from megatron_ds.plan.hardware import PlanError
from megatron_ds.plan.inputs import GIB
from megatron_ds.plan.report import Section, guide
from megatron_ds.training import deepspeed_config
from megatron_ds.units import format_bytes


@dataclass(frozen=True)
class Row:
    label: str
    stage: int
    offload_optimizer: str
    offload_param: str
    gpu_states: float
    cpu_per_node: float | None
    source: str

    @property
    def pipeline_ok(self) -> bool:
        """DeepSpeed's PipelineEngine asserts ZeRO < 2 (deepspeed/runtime/pipe/engine.py)."""
        return self.stage < 2


ORDER = (
    "ZeRO-0",
    "ZeRO-1",
    "ZeRO-2",
    "ZeRO-3",
    "ZeRO-1 + offload_optimizer cpu",
    "ZeRO-2 + offload_optimizer cpu",
    "ZeRO-3 + offload_optimizer cpu",
    "ZeRO-3 + offload_optimizer + offload_param cpu",
    "ZeRO-3 + offload to NVMe (ZeRO-Infinity)",
)
"""Preference order: GPU-resident stages first (network traffic only), then host offload (PCIe traffic and
CPU optimizer time), then NVMe (disk bandwidth). A judgement, not a measurement."""


def rows(ctx: Context) -> list[Row]:
    """Per-GPU model states of the whole model on pure data parallelism, in `ORDER`."""
    found = _rows(ctx)
    return sorted(found, key=lambda r: ORDER.index(r.label))


def _rows(ctx: Context) -> list[Row]:
    res, prec = ctx.res, ctx.precision
    n, gpn = res.num_gpus, res.gpus_per_node
    nodes = res.num_nodes
    psi, big = total_params(res.model()), largest_layer_params(res.model())
    out = []
    for stage, off in ((0, "none"), (1, "none"), (1, "cpu")):
        f = state_factors(prec, stage, offload_optimizer=off)
        cpu = f.host(psi, n) * gpn if off != "none" else None
        out.append(
            Row(
                f"ZeRO-{stage}" + (" + offload_optimizer cpu" if off != "none" else ""),
                stage,
                off,
                "none",
                psi * f.per_param(n),
                cpu,
                "ours: " + f.source,
            )
        )
    if prec == "fp32":
        for stage in (2, 3):
            f = state_factors(prec, stage)
            out.append(
                Row(
                    f"ZeRO-{stage}",
                    stage,
                    "none",
                    "none",
                    psi * f.per_param(n) + f.gathered * big,
                    None,
                    "ours: " + f.source,
                )
            )
        return out
    est = "DeepSpeed estimator, "
    cpu2, gpu2 = zero2_estimate(psi, gpn, nodes, cpu_offload=False)
    out.append(Row("ZeRO-2", 2, "none", "none", gpu2, cpu2, est + "estimate_zero2_model_states_mem_needs"))
    cpu2o, gpu2o = zero2_estimate(psi, gpn, nodes, cpu_offload=True)
    out.append(
        Row(
            "ZeRO-2 + offload_optimizer cpu",
            2,
            "cpu",
            "none",
            gpu2o,
            cpu2o,
            est + "estimate_zero2_model_states_mem_needs(cpu_offload=True)",
        )
    )
    for label, off_o, off_p, kw in (
        ("ZeRO-3", "none", "none", dict(cpu_offload=False)),
        ("ZeRO-3 + offload_optimizer cpu", "cpu", "none", dict(cpu_offload=True, cpu_offload_params=False)),
        (
            "ZeRO-3 + offload_optimizer + offload_param cpu",
            "cpu",
            "cpu",
            dict(cpu_offload=True, cpu_offload_params=True),
        ),
    ):
        cpu3, gpu3, _ = zero3_estimate(psi, big, gpn, nodes, **kw)
        out.append(Row(label, 3, off_o, off_p, gpu3, cpu3, est + "estimate_zero3_model_states_mem_needs"))
    out.append(
        Row(
            "ZeRO-3 + offload to NVMe (ZeRO-Infinity)",
            3,
            "nvme",
            "nvme",
            out[-1].gpu_states,
            None,
            "GPU as the CPU-offload row; host buffers not estimated",
        )
    )
    return out


def activation_bytes(ctx: Context) -> float:
    """Activations, pipe buffers and transients of the whole model on one GPU (no pipeline)."""
    res = ctx.res
    inputs = MemoryInputs(
        model=res.model(),
        micro_batch_size=res.raw.micro_batch_size or 1,
        num_micro_batches=1,
        precision=ctx.precision,
        zero_stage=1,
        data_parallel_size=res.num_gpus,
        checkpoint_activations=bool(res.raw.checkpoint_activations),
    )
    # The backward's transient, not the whole-step remainder: the optimizer step's temporaries
    # depend on each row's optimizer placement (none on the GPU with offload), and this one
    # figure is added to every row's model states.
    st = stage_memory_for(inputs, 0, 1, res.dims["num_layers"])
    return st.activations + st.pipe_buffers + st.backward_transient


def zero_section(ctx: Context) -> Section:
    res = ctx.res
    sec = Section("zero", "ZeRO stage")
    table, act = rows(ctx), activation_bytes(ctx)
    usable, cpu_cap = res.usable_bytes, (res.raw.cpu_memory_gb * GIB if res.raw.cpu_memory_gb else None)
    psi = total_params(res.model())
    sec.add(
        f"Model: {psi / 1e9:.2f} B parameters, {ctx.precision}, Adam; {res.num_gpus} GPU(s) "
        f"({res.gpus_per_node} per node), {format_bytes(usable)} usable per GPU "
        f"({1 - res.headroom:.0%} of {format_bytes(res.gpu_memory_bytes)}).",
        f"Per-GPU model states with pure data parallelism over all {res.num_gpus} GPU(s) (estimates), plus "
        f"{format_bytes(act)} of activations for micro-batch {res.raw.micro_batch_size or 1} "
        f"(Korthikanti et al. 2022 per-tensor count, see docs/planner.md):",
        f"  {'configuration':<48} {'GPU states':>11} {'w/ activ.':>10} {'CPU/node':>10}  pipeline?",
    )
    for r in table:
        cpu = format_bytes(r.cpu_per_node) if r.cpu_per_node is not None else "n/a"
        fits = "fits" if r.gpu_states + act <= usable else "too big"
        sec.add(
            f"  {r.label:<48} {format_bytes(r.gpu_states):>11} {fits:>10} {cpu:>10}  "
            f"{'yes' if r.pipeline_ok else 'no (ZeRO<2 only)'}"
        )
    text = guide("zero")
    sec.add(
        text["sources"],
        text["communication"],
        *(f"  ZeRO-{s}: {text[f'zero-{s}']}" for s in range(4)),
        f"  CPU offload: {text['cpu-offload']}.",
        f"  NVMe offload: {text['nvme-offload']}.",
    )
    sec.data = {
        "parameters": psi,
        "activation_bytes": act,
        "usable_bytes": usable,
        "rows": [dict(r.__dict__, fits=r.gpu_states + act <= usable) for r in table],
    }
    _recommend(ctx, sec, table, act, cpu_cap)
    return sec


def _first_fit(
    table: list[Row], act: float, usable: float, cpu_cap: float | None, pipeline_only: bool, min_stage: int
) -> Row | None:
    for r in table:
        if r.stage < min_stage or (pipeline_only and not r.pipeline_ok):
            continue
        cpu_ok = r.cpu_per_node is None or cpu_cap is None or r.offload_optimizer == "none" or r.cpu_per_node <= cpu_cap
        if r.gpu_states + act <= usable and cpu_ok:
            return r
    return None


def _recommend(ctx: Context, sec: Section, table: list[Row], act: float, cpu_cap: float | None) -> None:
    res = ctx.res
    fixed_pp = res.raw.pipeline_model_parallel_size
    min_stage = 1 if res.num_gpus > 1 else 0  # ZeRO-1 costs no extra communication volume
    if res.raw.zero_stage is not None:
        min_stage = res.raw.zero_stage
    ours = _first_fit(table, act, res.usable_bytes, cpu_cap, True, min_stage)
    generic = None if (fixed_pp or 1) > 1 else _first_fit(table, act, res.usable_bytes, cpu_cap, False, min_stage)
    if ours is not None and ours.offload_optimizer == "none":
        sec.add(
            f"Recommended for pretrain_gpt.py: {ours.label} with pure data parallelism (the lowest stage that "
            f"fits; ZeRO-1 partitions optimizer states at no extra communication volume)."
        )
        _snippet_for(ctx, sec, ours.stage, "none")
    else:
        _recommend_model_parallel(ctx, sec, ours)
    if generic is not None and generic.stage >= 2:
        sec.add(
            f"Without DeepSpeed's pipeline engine (a plain DeepSpeedEngine model, not pretrain_gpt.py, which "
            f"always builds a PipelineModule): {generic.label} fits with data parallelism alone."
        )
        sec.snippets[f"zero_optimization for {generic.label} (non-pipeline engines only)"] = (
            deepspeed_config.zero_snippet(generic.stage, generic.offload_optimizer, generic.offload_param)
        )
    if cpu_cap is None and any(r.offload_optimizer != "none" for r in table):
        sec.check(None, "host memory for offload rows not checked: give --cpu-memory-gb (per node)")


def _recommend_model_parallel(ctx: Context, sec: Section, offload_row: Row | None) -> None:
    """ZeRO 0/1 alone does not fit: split the model (pipeline/tensor), or offload if that fits."""
    try:
        plan = ctx.plan()
    except PlanError as e:
        plan = None
        reason = str(e)
    if plan is not None:
        offload = " with the optimizer offloaded to CPU" if plan.offload_optimizer != "none" else ""
        sec.add(
            f"Recommended for pretrain_gpt.py: ZeRO-{plan.zero_stage}{offload} combined with tensor parallel "
            f"{plan.tp} x pipeline parallel {plan.pp} (data parallel {plan.dp}); see `pipeline`. Pipeline "
            f"parallelism combines with ZeRO 0/1 only, so model states are split across stages instead of ZeRO-2/3."
        )
        sec.check(
            plan.zero_stage in (0, 1),
            f"ZeRO-{plan.zero_stage} with pipeline parallel {plan.pp}: the pipeline engine accepts ZeRO 0 and 1",
        )
        _snippet_for(ctx, sec, plan.zero_stage, plan.offload_optimizer, plan)
    elif offload_row is not None:
        sec.add(
            f"Recommended for pretrain_gpt.py: {offload_row.label}: the only ZeRO 0/1 option that fits "
            f"({guide('zero')['cpu-offload']})."
        )
        _snippet_for(ctx, sec, offload_row.stage, offload_row.offload_optimizer)
    else:
        sec.add(f"No ZeRO 0/1 configuration fits for pretrain_gpt.py: {reason}")
        sec.check(False, "model fits in GPU memory with a ZeRO stage pretrain_gpt.py supports")


def _snippet_for(ctx: Context, sec: Section, stage: int, offload: str, plan=None) -> None:
    """The full DeepSpeed JSON for the recommendation (the `pipeline` plan's batch split when it matches)."""
    res = ctx.res
    cand = plan or _pure_data_parallel(ctx, stage)
    if cand is None:
        sec.snippets["zero_optimization"] = deepspeed_config.zero_snippet(stage, offload)
        sec.check(
            None,
            "batch-size arithmetic for the snippet: give --global-batch-size divisible by "
            "micro-batch x data-parallel size to get the full DeepSpeed JSON",
        )
        return
    config = ds_json.plan_config(res, cand)
    sec.snippets["DeepSpeed JSON"] = deepspeed_config.generate(config, offload)
    sec.data["recommended"] = {
        "zero_stage": stage,
        "offload_optimizer": offload,
        "tp": cand.tp,
        "pp": cand.pp,
        "micro_batch_size": cand.micro_batch_size,
    }


def _pure_data_parallel(ctx: Context, stage: int):
    """The `pipeline` plan if it is pure data parallel with this stage, else micro-batch 1 (or the fixed one)."""
    from megatron_ds.plan import search

    res = ctx.res
    try:
        plan = ctx.plan()
        if plan.tp * plan.pp == 1 and plan.zero_stage == stage:
            return plan
    except PlanError:
        pass
    mb = res.raw.micro_batch_size or 1
    if not res.global_batch_size or res.global_batch_size % (mb * res.num_gpus):
        return None
    return search.evaluate(res, 1, 1, mb, stage, ctx.precision, bool(res.raw.checkpoint_activations), "none")
