"""What `pipeline` says about time: the predicted step in seconds and where it goes, per stage, the
runner-up and why it lost, and the same as JSON data."""

from __future__ import annotations

from megatron_ds.estimate.step_inputs import StepTime
from megatron_ds.plan import timing
from megatron_ds.plan.candidate import Candidate
from megatron_ds.plan.inputs import Resolved
from megatron_ds.units import format_bytes, format_number, format_seconds

PART_NAMES = {
    "matmul": "matmuls",
    "attention": "attention",
    "memory": "memory-bound kernels",
    "tp-comm": "tensor-parallel communication",
    "recompute": "recomputation",
    "all-to-all": "expert-parallel all-to-all",
    "teacher all-to-all": "the teacher's all-to-all",
}


def describe(c: Candidate) -> str:
    """One configuration in a few words."""
    zero = f"ZeRO-{c.zero_stage}" + (f", optimizer on {c.offload_optimizer}" if c.offload_optimizer != "none" else "")
    zero += f", parameters on {c.offload_param}" if c.offload_param != "none" else ""
    return (
        f"t={c.tp} p={c.pp} d={c.dp}"
        + (f" E={c.expert_parallel_size}" if c.inputs.model.is_moe or c.expert_parallel_size > 1 else "")
        + f", micro-batch {c.micro_batch_size}, recompute "
        f"{c.recompute_label}" + (", sequence parallel" if c.sequence_parallel else "") + f", {zero}"
    )


def terms(t: StepTime, num_micro_batches: int) -> dict[str, float]:
    """Seconds of the step by cause: the slowest stage's compute by kind (all its micro-batches), its
    exposed data-parallel reduction, the optimizer step, and the rest (pipeline bubble and sends)."""
    out = {PART_NAMES.get(k, k): v * num_micro_batches for k, v in t.parts.items()}
    busy = [f + b for f, b in zip(t.rank_forward, t.rank_backward)]
    slowest = max(range(len(busy)), key=lambda s: busy[s])
    per_mb = t.dp_per_micro_batch[slowest] if t.dp_per_micro_batch else 0.0
    out["data-parallel communication"] = max(t.reduce_grads) + per_mb * num_micro_batches
    out["optimizer step"] = max(t.optimizer)
    out["pipeline bubble and sends"] = max(0.0, t.seconds - sum(out.values()))
    return out


def step_lines(res: Resolved, plan: Candidate) -> list[str]:
    t = plan.time
    assert t is not None
    hw = timing.hardware(res.gpu_name, plan.precision, res.gpus_per_node or 1, res.raw.kernel_profile)
    how = "the schedule replayed" if t.simulated else "1F1B's closed form (M x P too large to replay quickly)"
    lines = [
        f"Predicted step: {format_seconds(t.seconds)} ({how}); {t.tflops_per_gpu:.0f} TFLOP/s per GPU in model FLOPs "
        f"(MFU {t.mfu:.1%} of the {t.peak_flops / 1e12:g} TFLOP/s peak), {t.tokens_per_second:,.0f} tokens/s; "
        f"{t.seconds / t.ideal:.3f} x the same compute in equal stages with no bubble.",
        "  where it goes (slowest stage): "
        + ", ".join(f"{k} {format_seconds(v)}" for k, v in terms(t, plan.num_micro_batches).items() if v > 0),
        f"  priced on {hw.source}" + ("" if hw.known else " (seconds only rank configurations here)"),
    ]
    return lines


def stage_table(plan: Candidate) -> list[str]:
    """Per stage: one micro-batch's forward and backward, the step's optimizer and exposed reduction."""
    t = plan.time
    assert t is not None
    head = f"{'stage':>5} {'layers':>6} {'forward':>10} {'backward':>10} {'optimizer':>10} {'dp-reduce':>10} {'memory':>10}"
    lines = [
        "predicted time per stage (ms; one micro-batch's forward and backward with recomputation) and memory",
        head,
    ]
    forward, backward = t.rank_forward, t.rank_backward  # with chunks, a rank's chunks together
    for s, st in enumerate(plan.stages):
        lines.append(
            f"{s:>5} {st.num_layers:>6} {format_number(forward[s] * 1e3):>10} {format_number(backward[s] * 1e3):>10} "
            f"{format_number(t.optimizer[s] * 1e3):>10} {format_number(t.reduce_grads[s] * 1e3):>10} {format_bytes(st.total):>10}"
        )
    return lines


def slower_by(seconds: float, than: float) -> str:
    """`+11.4%`; under 0.1% two decimals (`+0.02%`), so a near tie does not read as no difference."""
    change = seconds / than - 1
    return f"{change:+.1%}" if abs(change) >= 1e-3 else f"{change:+.2%}"


def runner_up_lines(plan: Candidate, other: Candidate | None) -> list[str]:
    """The fastest configuration that differs in degrees, micro-batch, recomputation, ZeRO or offload, and why it
    lost."""
    if other is None or other.time is None or plan.time is None:
        return ["Runner-up: none (no other configuration fits)."]
    cause, worse = lost_on(plan, other)
    return [
        f"Runner-up: {describe(other)}: {format_seconds(other.seconds)}, {slower_by(other.seconds, plan.seconds)}; it loses "
        f"most on {cause} (+{format_seconds(worse)})."
    ]


def lost_on(plan: Candidate, other: Candidate) -> tuple[str, float]:
    """The step term `other` is slowest on against `plan`, and by how many seconds."""
    assert plan.time is not None and other.time is not None
    mine, theirs = terms(plan.time, plan.num_micro_batches), terms(other.time, other.num_micro_batches)
    worse = {k: theirs.get(k, 0.0) - mine.get(k, 0.0) for k in {*mine, *theirs}}
    cause = max(worse, key=lambda k: worse[k])
    return cause, worse[cause]


def time_data(plan: Candidate, other: Candidate | None) -> dict:
    t = plan.time
    assert t is not None
    data = {
        "step_seconds": t.seconds,
        "tflops_per_gpu": t.tflops_per_gpu,
        "tokens_per_second": t.tokens_per_second,
        "mfu": t.mfu,
        "simulated": t.simulated,
        "step_over_ideal": t.seconds / t.ideal,
        "step_terms_seconds": terms(t, plan.num_micro_batches),
    }
    if other is not None:
        data["runner_up"] = {
            "tensor_parallel": other.tp,
            "pipeline_parallel": other.pp,
            "data_parallel": other.dp,
            "micro_batch_size": other.micro_batch_size,
            "checkpoint_activations": other.checkpoint_activations,
            "selective_recompute": other.selective_recompute,
            "sequence_parallel": other.sequence_parallel,
            "zero_stage": other.zero_stage,
            "offload_optimizer": other.offload_optimizer,
            "offload_param": other.offload_param,
            "pipeline_schedule": other.inputs.schedule,
            "virtual_stages": other.virtual_stages,
            "step_seconds": other.seconds,
        }
        if other.time is not None:
            cause, seconds = lost_on(plan, other)
            data["runner_up"]["loses_most_on"] = {"term": cause, "seconds": seconds}
    return data
