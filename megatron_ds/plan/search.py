"""Choose tensor/pipeline/data-parallel degrees, micro-batch, ZeRO stage, recomputation and layout.

Preference order (a heuristic, stated so it can be argued with):
  1. the largest predicted stage memory fits the usable GPU memory;
  2. the smallest model-parallel size t*p: data parallelism scales best (Narayanan et al. 2021,
     "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Sec. 3);
  3. no activation recomputation, then selective recomputation of the core attention (its scores,
     softmax and attention over values run again: ~4% more compute for a 5x smaller activation
     footprint with sequence parallelism), then full recomputation (each layer's forward again, ~1/3
     more compute; Korthikanti et al. 2022, Sec. 5 and Table 4);
  4. for equal t*p, larger t up to the GPUs of one node (Narayanan et al. 2021, Takeaway #1);
  5. the largest micro-batch that keeps the pipeline bubble at or below 25% (the schedule's step on
     equal stages, `estimate/step_simulator.bubble_ratio`; (p-1)/m for DeepSpeed's 1F1B);
  6. the layout with the smallest simulated step time among those that fit (the schedule replayed
     over the compute model's stage FLOPs, `estimate/layout_costs.py`; ties: the smaller
     largest stage, then the simplest flag). `fastest` is exact over all splits, so it wins unless
     another method's split is as fast.
Sequence parallelism (`--sequence-parallel`) is on whenever t > 1 (unless `--no-sequence-parallel`): it
splits the norms', dropouts' and residuals' activations t ways for the same communication volume
(all-gather + reduce-scatter in place of all-reduce; Korthikanti et al. 2022, Sec. 4.2.2), as
Megatron-LM's scripts pass it with tensor parallelism.
ZeRO is 1 when data-parallel ranks > 1 (it partitions optimizer states at no extra communication,
Rajbhandari et al. 2020, Sec. 7), else 0; only 0 and 1 run on DeepSpeed's pipeline engine.
When no configuration fits, ZeRO-2 and then ZeRO-3 are tried at pipeline size 1 (DeepSpeed's plain
engine, which pretrain_gpt.py uses for them), and then the model states partly off the GPU
(`plan/zero_options.py`): ZeRO-1 with the optimizer offloaded to the CPU at any t x p, ZeRO-2 and ZeRO-3
with it at p = 1, ZeRO-3 with the parameters too, and with `--storage nvme` ZeRO-3 to NVMe (Ren et al.
2021, "ZeRO-Offload"; Rajbhandari et al. 2021, "ZeRO-Infinity"); of those that fit, the one with the
smallest estimated step (compute at the GPU's peak plus the traffic and CPU optimizer time each adds,
`estimate/zero_time.py`). Offload costs PCIe traffic and a CPU optimizer step every iteration, so it
comes after every GPU-resident option.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_ds.config import DEDICATED_CHOICES
from megatron_ds.estimate import pipeline_schedules
from megatron_ds.estimate.layout_costs import flop_stage_time, method_costs
from megatron_ds.estimate.memory_inputs import MemoryInputs, StageMemory
from megatron_ds.estimate.memory_model import stage_memory, stage_memory_for
from megatron_ds.estimate.step_simulator import balanced_step_time, bubble_ratio, idle_fraction, simulate
from megatron_ds.model.naming import gpt_spec_groups
from megatron_ds.pipeline import methods as partition_methods
from megatron_ds.pipeline.costs import StageTime
from megatron_ds.pipeline.layout import Layout, LayoutError, build_layout
from megatron_ds.plan.hardware import PlanError
from megatron_ds.plan.inputs import Resolved
from megatron_ds.units import format_bytes

DEFAULT = "none"
# The layout choices (`--layout`) in tie-break order, the simplest flag first: none, the bare
# --pp-dedicated-embedding-stages (both), pre, post, then the registry's planned partition methods.
METHODS = (DEFAULT, "both", "pre", "post", *partition_methods.planned_methods())
MICRO_BATCH_CHOICES = (1, 2, 4, 8, 16)
MAX_BUBBLE = 0.25
RECOMPUTE = ("none", "selective", "full")
"""Activation recomputation in preference order (the least compute first)."""


@dataclass(frozen=True)
class Candidate:
    """One complete parallel configuration and its predicted memory."""

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    num_micro_batches: int
    zero_stage: int
    precision: str
    checkpoint_activations: bool
    method: str
    layout: Layout
    stages: tuple[StageMemory, ...]
    inputs: MemoryInputs
    times: tuple[StageTime, ...] = ()
    """Per stage: one micro-batch's forward and backward (recomputation included) in GFLOP."""
    step: float = 0.0
    """The schedule's simulated step of those times (GFLOP-time units: FLOPs at one rate on every device)."""
    ideal: float = 0.0
    """The same work in equal stages through the same schedule."""

    @property
    def peak(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    @property
    def selective_recompute(self) -> bool:
        return self.inputs.selective_recompute

    @property
    def sequence_parallel(self) -> bool:
        return self.inputs.sequence_parallel

    @property
    def recompute(self) -> str:
        """`none`, `selective` (the core attention) or `full` (whole layers)."""
        return "full" if self.checkpoint_activations else "selective" if self.selective_recompute else "none"

    @property
    def offload_optimizer(self) -> str:
        return self.inputs.offload_optimizer

    @property
    def offload_param(self) -> str:
        return self.inputs.offload_param

    @property
    def engine(self) -> str:
        """DeepSpeed's `pipeline` engine (ZeRO 0/1, any P) or its `plain` one (ZeRO 2/3, P = 1)."""
        return "plain" if self.zero_stage >= 2 else "pipeline"

    @property
    def host_per_gpu(self) -> float:
        """Offloaded model states of the fullest stage's GPU, held in host memory."""
        return max(s.host for s in self.stages)

    @property
    def schedule(self) -> pipeline_schedules.PipelineSchedule:
        return pipeline_schedules.find(self.inputs.schedule)

    @property
    def bubble(self) -> float:
        """Bubble time over ideal time with equal stages and unit passes (1F1B: (p - 1) / m, Narayanan
        et al. 2021 eq. 1; `step_simulator.bubble_ratio`)."""
        return bubble_ratio(self.inputs.schedule, self.num_micro_batches, self.pp)

    @property
    def idle_fraction(self) -> float:
        """Share of the step a stage idles with equal stages (1F1B: (p - 1) / (m + p - 1))."""
        return idle_fraction(self.inputs.schedule, self.num_micro_batches, self.pp)


def layout_options(method: str) -> dict[str, str]:
    """`build_layout` keyword arguments for a `--layout` choice."""
    if method == DEFAULT:
        return {}
    if method in DEDICATED_CHOICES:
        return {"dedicated": method}
    return {"partition_method": method}


def layout_flag(method: str, layout: Layout) -> str:
    """The pretrain_gpt.py flags that give `layout` for this choice. A partition method is passed as
    its layout string, so the run gets the planned layout whatever its own cost model would say."""
    opts = layout_options(method)
    if "dedicated" in opts:
        return f"--pp-dedicated-embedding-stages {method}"
    return f"--pp-layout '{layout.to_string()}'" if opts else ""


def layout_for(res: Resolved, tp: int, pp: int, method: str, inputs: MemoryInputs) -> Layout:
    """The layout `pretrain_gpt.py --print-layout` prints for the command of this choice."""
    model = res.model(tp)
    groups = gpt_spec_groups(model)
    opts = layout_options(method)
    if "partition_method" not in opts:
        return build_layout(groups, pp, **opts)
    limit = res.usable_bytes
    costs = method_costs(partition_methods.find(method), model, pp, lambda: inputs, memory_limit=lambda: limit)
    chosen = build_layout(groups, pp, costs=costs, **opts)
    return build_layout(groups, pp, layout=chosen.to_string())


def evaluate(
    res: Resolved,
    tp: int,
    pp: int,
    mb: int,
    zero: int,
    precision: str,
    ckpt: bool,
    method: str,
    offload: str = "none",
    offload_param: str = "none",
    selective: bool = False,
) -> Candidate:
    """Predicted memory and step of one configuration (raises LayoutError if the layout is impossible);
    `ckpt` full recomputation, `selective` the core attention's; sequence parallelism at tp > 1 unless
    `--no-sequence-parallel`."""
    dp = res.num_gpus // (tp * pp)
    inputs = MemoryInputs(
        model=res.model(tp),
        micro_batch_size=mb,
        num_micro_batches=res.global_batch_size // (mb * dp),
        precision=precision,
        zero_stage=zero,
        data_parallel_size=dp,
        tensor_parallel_size=tp,
        checkpoint_activations=ckpt,
        selective_recompute=selective and not ckpt,
        sequence_parallel=tp > 1 and res.raw.sequence_parallel is not False,
        offload_optimizer=offload,
        offload_param=offload_param,
        engine="plain" if zero >= 2 else "pipeline",
    )
    layout = layout_for(res, tp, pp, method, inputs)
    flops = flop_stage_time(inputs, pp)
    times = tuple(flops(s, k) for s, k in enumerate(layout.layers_per_stage))
    fwd, bwd = [t.forward for t in times], [t.backward for t in times]
    return Candidate(
        tp=tp,
        pp=pp,
        dp=dp,
        micro_batch_size=mb,
        num_micro_batches=inputs.num_micro_batches,
        zero_stage=zero,
        precision=precision,
        checkpoint_activations=ckpt,
        method=method,
        layout=layout,
        stages=tuple(stage_memory(inputs, layout)),
        inputs=inputs,
        times=times,
        step=simulate(inputs.num_micro_batches, fwd, bwd, schedule=inputs.schedule).step_time,
        ideal=balanced_step_time(inputs.num_micro_batches, fwd, bwd, inputs.schedule),
    )


def degree_pairs(res: Resolved) -> list[tuple[int, int]]:
    """(t, p) pairs in preference order: smallest t*p, then larger t."""
    raw, dims = res.raw, res.dims
    ts = (
        [raw.tensor_model_parallel_size]
        if raw.tensor_model_parallel_size
        else [t for t in (1, 2, 4, 8, 16) if t <= (res.gpus_per_node or 1)]
    )
    ps = [raw.pipeline_model_parallel_size] if raw.pipeline_model_parallel_size else range(1, dims["num_layers"] + 3)
    ffn = dims["ffn_hidden_size"] or 4 * dims["hidden_size"]
    pairs = [
        (t, p)
        for t in ts
        for p in ps
        if res.num_gpus % (t * p) == 0 and dims["num_attention_heads"] % t == 0 and ffn % t == 0
    ]
    if not pairs:
        fixed = " ".join(
            f"--{n.replace('_', '-')} {getattr(raw, n)}"
            for n in ("tensor_model_parallel_size", "pipeline_model_parallel_size")
            if getattr(raw, n)
        )
        raise PlanError(
            f"no tensor x pipeline degree divides --num-gpus {res.num_gpus}"
            + (f" with {fixed}" if fixed else "")
            + f" (t must also divide {dims['num_attention_heads']} "
            f"heads and FFN {ffn}); choose degrees whose product divides the GPU count"
        )
    return sorted(pairs, key=lambda tp: (tp[0] * tp[1], -tp[0]))


def micro_batches(res: Resolved, dp: int) -> list[int]:
    """Micro-batch sizes whose arithmetic works: global batch divisible by micro x data-parallel."""
    gbs = res.global_batch_size
    choices = [res.raw.micro_batch_size] if res.raw.micro_batch_size else MICRO_BATCH_CHOICES
    return sorted(mb for mb in choices if gbs % (mb * dp) == 0)


def states_lower_bound(
    res: Resolved, t: int, p: int, zero: int, precision: str, offload: str = "none", offload_param: str = "none"
) -> float:
    """Model states averaged over the p stages: no layout can put less on its fullest stage."""
    dp = res.num_gpus // (t * p)
    inputs = MemoryInputs(
        model=res.model(t),
        micro_batch_size=1,
        num_micro_batches=1,
        precision=precision,
        zero_stage=zero,
        data_parallel_size=dp,
        tensor_parallel_size=t,
        offload_optimizer=offload,
        offload_param=offload_param,
    )
    whole = stage_memory_for(inputs, 0, 1, res.dims["num_layers"])
    return whole.model_states / p


def fits(res: Resolved, cand: Candidate) -> bool:
    """The fullest stage fits the usable GPU memory and, with offload and --cpu-memory-gb, the host
    memory of a node holds what its GPUs offload."""
    if cand.peak.total > res.usable_bytes:
        return False
    cpu_gb = res.raw.cpu_memory_gb
    return not (cpu_gb and cand.host_per_gpu * (res.gpus_per_node or 1) > cpu_gb * 2**30)


def _fitting_at(
    res: Resolved,
    t: int,
    p: int,
    recompute: str,
    precision: str,
    methods: list[str],
    offload: str = "none",
    zero: int | None = None,
    offload_param: str = "none",
) -> tuple[list[Candidate], Candidate | None, float | None]:
    """(configurations of this (t, p, recompute, ZeRO option) that fit, the closest miss, the states lower
    bound when that alone rules this (t, p) out). `zero` None: ZeRO-1 with offload or data parallelism, else 0."""
    dp = res.num_gpus // (t * p)
    if zero is None:
        zero = (
            1 if offload != "none" else res.raw.zero_stage if res.raw.zero_stage is not None else (1 if dp > 1 else 0)
        )
    bound = states_lower_bound(res, t, p, zero, precision, offload, offload_param)
    if bound > res.usable_bytes:
        return [], None, bound
    fitting, miss = [], None
    for mb in micro_batches(res, dp):  # ascending: once one misses, larger ones miss too (more activations)
        best = _best_layout(res, t, p, mb, zero, precision, recompute, methods, offload, offload_param)
        if best is None:
            continue
        if not fits(res, best):
            miss = best
            break
        fitting.append(best)
    return fitting, miss, None


def _best_layout(
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
) -> Candidate | None:
    """The fastest layout that fits (ties: smaller largest stage, then the simplest flag in METHODS
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
                )
            )
        except LayoutError:
            continue
    fitting = [c for c in found if fits(res, c)]
    if fitting:
        return min(fitting, key=lambda c: (round(c.step / c.ideal, 9), round(c.peak.total), METHODS.index(c.method)))
    return min(found, key=lambda c: (round(c.peak.total), METHODS.index(c.method)), default=None)


def recompute_modes(raw: Any) -> list[str]:
    """The recomputation modes to try, in `RECOMPUTE` order: those the planner's flags leave open
    (`--checkpoint-activations`: full; `--recompute-activations`: selective; `--no-checkpoint-activations`:
    not full)."""
    if raw.checkpoint_activations:
        return ["full"]
    if raw.recompute_activations:
        return ["selective"]
    return ["none", "selective"] if raw.checkpoint_activations is False else list(RECOMPUTE)


class Search:
    """Searches configurations for one ZeRO option at a time, remembering the closest miss over all."""

    def __init__(self, res: Resolved, precision: str) -> None:
        raw = res.raw
        self.res, self.precision = res, precision
        self.recomputes = recompute_modes(raw)
        self.methods = [raw.layout] if raw.layout else list(METHODS)
        self.closest: Candidate | None = None
        self.bounds: list[tuple[float, int, int]] = []
        self.batch_ok = False

    def first_fit(self, option: Any, pairs: list[tuple[int, int]]) -> Candidate | None:
        """The preferred fitting configuration of `option` (a `zero_options.ZeroOption`; None: ZeRO 0/1 by the
        data-parallel rule) over these (t, p), in preference order."""
        res = self.res
        zero, offload, offload_param = (None, "none", "none") if option is None else option.fields
        for t, p in pairs:
            self.batch_ok = self.batch_ok or bool(micro_batches(res, res.num_gpus // (t * p)))
            for recompute in self.recomputes:
                fitting, miss, bound = _fitting_at(
                    res, t, p, recompute, self.precision, self.methods, offload, zero, offload_param
                )
                if fitting:
                    low_bubble = [c for c in fitting if c.bubble <= MAX_BUBBLE]
                    return (
                        max(low_bubble, key=lambda c: c.micro_batch_size)
                        if low_bubble
                        else min(fitting, key=lambda c: c.bubble)
                    )
                if bound is not None:
                    self.bounds.append((bound, t, p))
                if miss is not None and (self.closest is None or miss.peak.total < self.closest.peak.total):
                    self.closest = miss
        return None


def no_fit_message(res: Resolved, closest: Candidate | None, bounds: list, batch_ok: bool) -> str:
    usable = format_bytes(res.usable_bytes)
    fix = "add GPUs, use GPUs with more memory, or allow more pipeline/tensor parallelism"
    tried = "recomputation, ZeRO-2/3 at pipeline size 1 and optimizer/parameter offload were tried too"
    if not batch_ok:
        return (
            f"--global-batch-size {res.global_batch_size} does not divide into micro-batch x data-parallel size "
            f"for any tensor/pipeline degree on --num-gpus {res.num_gpus}; use a multiple of {res.num_gpus}"
        )
    if closest is not None and closest.peak.total <= res.usable_bytes:  # the host memory ruled it out
        return (
            f"the model does not fit: the closest configuration (t={closest.tp}, p={closest.pp}, ZeRO-"
            f"{closest.zero_stage}, optimizer offload {closest.offload_optimizer}) fits the GPUs but keeps "
            f"{format_bytes(closest.host_per_gpu * (res.gpus_per_node or 1))} per node on the host, over "
            f"--cpu-memory-gb {res.raw.cpu_memory_gb:g} ({tried}); give more host memory, or --storage nvme "
            f"to offload to NVMe"
        )
    if closest is not None:
        return (
            f"the model does not fit: the closest configuration (t={closest.tp}, p={closest.pp}, micro-batch "
            f"{closest.micro_batch_size}, recompute {closest.recompute}, optimizer offload "
            f"{closest.offload_optimizer}) needs {format_bytes(closest.peak.total)} on stage {closest.peak.stage} "
            f"but {usable} is usable ({tried}); {fix}"
        )
    bound, t, p = min(bounds)
    return (
        f"the model does not fit: even with t={t}, p={p} the model states alone average "
        f"{format_bytes(bound)} per GPU, over the {usable} usable ({tried}); {fix}"
    )
