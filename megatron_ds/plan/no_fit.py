"""The planner's answer when nothing fits: the global batch no degrees divide (`batch_message`), the fixed
schedule no configuration runs (`schedule_message`), or the memory the closest configuration lacks
(`no_fit_message`), each with the change that would make one fit."""

from __future__ import annotations

from megatron_ds.config.parallel import INTERLEAVED
from megatron_ds.plan.candidate import Candidate
from megatron_ds.plan.inputs import Resolved
from megatron_ds.plan.runnable_schedules import Unreplayed, replay_note
from megatron_ds.plan.search import degree_pairs
from megatron_ds.units import format_apart, format_bytes


def batch_message(res: Resolved) -> str:
    """Why no configuration takes the global batch, and the nearest batch sizes that one would: each (t, p) needs
    a multiple of micro-batch x its data-parallel size (micro-batch 1 when it is not fixed)."""
    gbs, fixed = res.global_batch_size, res.raw.micro_batch_size
    mb = fixed or 1
    t, p = max(degree_pairs(res), key=lambda tp: tp[0] * tp[1])  # the fewest data-parallel ranks
    unit = mb * (res.num_gpus // (t * p))
    below, above = gbs // unit * unit, (gbs // unit + 1) * unit
    nearest = f"{below} or {above}" if below else f"{above}"
    micro = f"micro-batch {fixed}" if fixed else "micro-batch"
    return (
        f"--global-batch-size {gbs} does not divide into {micro} x data-parallel size for any tensor/pipeline "
        f"degree on --num-gpus {res.num_gpus}; use a multiple of {unit} (micro-batch {mb} x data-parallel "
        f"{unit // mb} at t={t}, p={p}), e.g. {nearest}"
    )


def schedule_message(res: Resolved, skipped: list[Unreplayed] = ()) -> str:
    """Why no configuration runs the schedule the flags fix (or none short enough to replay: `skipped`)."""
    name, v = res.schedule
    raw = res.raw
    asked = " with ".join(
        flag
        for flag, given in (
            (f"--pp-schedule {raw.pp_schedule}", raw.pp_schedule),
            ("--enable-zbh1-pipeline", raw.enable_zbh1_pipeline),
            (f"--num-virtual-stages-per-pipeline-rank {v}", raw.num_virtual_stages_per_pipeline_rank),
        )
        if given
    )
    if name == INTERLEAVED or (v or 1) > 1:
        chunks = f"{v} x P chunks" if v else "2, 3 or 4 x P chunks"
        need = (
            f"P >= 2 pipeline ranks, ZeRO 0 or 1, the {res.dims['num_layers']} layers split into {chunks} and a "
            f"multiple of P micro-batches per step"
        )
    else:
        need = "ZeRO 0 or 1 (DeepSpeed's pipeline engine)"
    if skipped:
        return (
            f"{asked} cannot be priced on --num-gpus {res.num_gpus}: {replay_note(list(skipped))}; ask for a larger "
            f"--micro-batch-size, fewer pipeline or virtual stages, or drop it"
        )
    return f"{asked} runs on no configuration of --num-gpus {res.num_gpus} here: it needs {need}; change it or drop it"


def no_fit_fix(res: Resolved) -> str:
    """What would make it fit: more parallelism only where pretrain_gpt.py allows it (`search.degree_pairs`)."""
    if res.model().is_moe:  # t = p = 1: more GPUs spread the experts (a larger E) and ZeRO's partitions
        return "add GPUs (a larger --moe-expert-parallel-size holds fewer experts per GPU) or use GPUs with more memory"
    if res.distils:  # p = 1 and the tensor sizes the teacher allows were all tried
        return "add GPUs or use GPUs with more memory (pretrain_gpt.py distils at pipeline size 1)"
    return "add GPUs, use GPUs with more memory, or allow more pipeline/tensor parallelism"


def no_fit_message(
    res: Resolved,
    closest: Candidate | None,
    bounds: list,
    batch_ok: bool,
    also: tuple[str, ...] = (),
    skipped: list[Unreplayed] = (),
) -> str:
    """Why nothing fits; `also` names what was tried beside the flags' own choices (recomputation, ZeRO-2/3,
    offload: what the flags leave open); `skipped`, what the fixed schedule's replay limit left unpriced."""
    usable = format_bytes(res.usable_bytes)
    fix = no_fit_fix(res)
    if len(also) > 1:
        tried = f"{', '.join(also[:-1])} and {also[-1]} were tried too"
    else:
        tried = f"{also[0]} was tried too" if also else "the flags leave nothing else to try"
    if skipped:
        tried += f"; {replay_note(list(skipped))}"
    if not batch_ok:
        return batch_message(res)
    if closest is not None and closest.peak.total <= res.usable_bytes:  # the host memory ruled it out
        return (
            f"the model does not fit: the closest configuration (t={closest.tp}, p={closest.pp}, ZeRO-"
            f"{closest.zero_stage}, optimizer offload {closest.offload_optimizer}) fits the GPUs but keeps "
            f"{format_bytes(closest.host_per_gpu * (res.gpus_per_node or 1))} per node on the host, over "
            f"--cpu-memory-gb {res.raw.cpu_memory_gb:g} ({tried}); give more host memory, or --storage nvme "
            f"to offload to NVMe"
        )
    if closest is not None:
        need, usable = format_apart(closest.peak.total, res.usable_bytes)
        return (
            f"the model does not fit: the closest configuration (t={closest.tp}, p={closest.pp}, micro-batch "
            f"{closest.micro_batch_size}, recompute {closest.recompute}, optimizer offload "
            f"{closest.offload_optimizer}) needs {need} on stage {closest.peak.stage} "
            f"but {usable} is usable ({tried}); {fix}"
        )
    bound, t, p = min(bounds)
    average, usable = format_apart(bound, res.usable_bytes)
    return (
        f"the model does not fit: even with t={t}, p={p} the model states alone average "
        f"{average} per GPU, over the {usable} usable ({tried}); {fix}"
    )
