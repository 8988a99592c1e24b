"""Choose tensor/pipeline/data-parallel degrees, micro-batch, ZeRO stage, recomputation and layout:
the configuration with the smallest predicted step in seconds among those whose largest stage fits the
usable GPU memory (the step-time model, `estimate/step_time.py`, priced by `plan/timing.py`).

The search: every (t, p) whose product divides the GPUs (t within a node, dividing the heads and FFN),
with no, selective (the core attention) and full recomputation, every micro-batch that divides the batch, ascending until one misses
memory (a larger one holds more activations), each under every pipeline schedule it can run
(`runnable_schedules.schedules_for`: 1F1B, ZB-H1, interleaved with v = 2) and the default layout (or `--layout`'s); a (t, p)
whose model states alone overflow is skipped. The fastest then gets the other layouts and schedules,
interleaving at v = 2-4 (`ranking.alternatives`; the exact `fastest` split only up to `FASTEST_MAX_STAGES`
stages and `FASTEST_MAX_REPLAY` micro-batches x stages: its search replays the schedule many times and
grows quickly with P). Ties: the smaller t x p,
then the larger t, then less recomputation (none, selective, full), then the simpler layout flag.
Sequence parallelism (`--sequence-parallel`) is on whenever t > 1 (unless `--no-sequence-parallel`): it
splits the norms', dropouts' and residuals' activations t ways for the same communication volume
(all-gather + reduce-scatter in place of all-reduce; Korthikanti et al. 2022, Sec. 4.2.2), as
Megatron-LM's scripts pass it with tensor parallelism.
ZeRO is 1 when data-parallel ranks > 1 (it partitions optimizer states at no extra communication,
Rajbhandari et al. 2020, Sec. 7), else 0; only 0 and 1 run on DeepSpeed's pipeline engine. ZeRO-2
and ZeRO-3 at pipeline size 1 (DeepSpeed's plain engine, which pretrain_gpt.py uses for them) compete
by time too. When nothing fits on the GPUs, the model states go partly off the GPU
(`plan/zero_options.py`): ZeRO-1 with the optimizer offloaded to the CPU at any t x p, ZeRO-2 and ZeRO-3
with it at p = 1, ZeRO-3 with the parameters too, and with `--storage nvme` ZeRO-3 to NVMe (Ren et al.
2021, "ZeRO-Offload"; Rajbhandari et al. 2021, "ZeRO-Infinity"); of those that fit, the one with the
smallest estimated step (compute at the GPU's peak plus the traffic and CPU optimizer time each adds,
`estimate/zero_time.py`). Offload costs PCIe traffic and a CPU optimizer step every iteration, so it
comes after every GPU-resident option.
"""

from __future__ import annotations

import dataclasses
import functools

from megatron_ds.config import DEDICATED_CHOICES, ModelConfig
from megatron_ds.config.parallel import DEFAULT_PIPELINE_SCHEDULE
from megatron_ds.estimate.layout_costs import flop_stage_time, method_costs
from megatron_ds.estimate.memory_inputs import MemoryInputs, StageMemory
from megatron_ds.estimate.memory_model import rank_memory_for, stage_memory, stage_memory_for
from megatron_ds.estimate.step_inputs import StepInputs
from megatron_ds.model import shapes
from megatron_ds.model.naming import gpt_spec_groups
from megatron_ds.pipeline import methods as partition_methods
from megatron_ds.pipeline.layout import Layout, build_layout
from megatron_ds.plan import timing
from megatron_ds.plan.candidate import Candidate
from megatron_ds.plan.hardware import PlanError
from megatron_ds.plan.inputs import Resolved

DEFAULT = "none"
# The layout choices (`--layout`) in tie-break order, the simplest flag first: none, the bare
# --pp-dedicated-embedding-stages (both), pre, post, then the registry's planned partition methods.
METHODS = (DEFAULT, "both", "pre", "post", *partition_methods.planned_methods())
MICRO_BATCH_CHOICES = (1, 2, 4, 8, 16)
REPLAY_LIMIT = 32_768
"""Micro-batches x stages x chunks per rank up to which ZB-H1 and interleaving are priced (their replay costs
about a second per 300,000 steps here; 1F1B beyond `estimate/step_time.SIMULATE_LIMIT` has its closed form)."""
FASTEST_MAX_STAGES = 16
"""The exact `fastest` split is tried for the chosen configuration up to this many stages."""
FASTEST_MAX_REPLAY = 4096
"""... and up to this many micro-batches x stages (each of its many replays costs that many steps)."""
FASTEST_MAX_VISITS = 5_000
"""... and stopped after this many nodes expanded or leaves replayed (under a second here; a tight memory limit
makes it wander: 171,448 nodes for Llama 3 405B over 8 stages of MI300X, 9,496 leaves for GPT-3 13B over 16
stages of L40S)."""
RECOMPUTE = ("none", "selective", "full")
"""Activation recomputation in tie-break order (the least compute first)."""


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


@functools.lru_cache(maxsize=512)
def plain_layout(model: ModelConfig, pp: int, method: str, virtual_stages: int = 1) -> Layout:
    """A layout that needs no costs (the default partition, a dedicated mode): the same for every micro-batch,
    recomputation and ZeRO option, so built once."""
    return build_layout(gpt_spec_groups(model), pp, virtual_stages=virtual_stages, **layout_options(method))


def layout_for(
    res: Resolved, tp: int, pp: int, method: str, inputs: MemoryInputs, max_visits: int | None = None
) -> Layout:
    """The layout `pretrain_gpt.py --print-layout` prints for the command of this choice (`max_visits`: the
    exact search's limit, `pipeline/fastest.SearchBudgetError` past it)."""
    model = res.model(tp)
    groups = gpt_spec_groups(model)
    opts, v = layout_options(method), inputs.virtual_stages
    if "partition_method" not in opts:
        return plain_layout(model, pp, method, v)
    limit = res.usable_bytes
    costs = method_costs(
        partition_methods.find(method), model, pp * v, lambda: inputs, memory_limit=lambda: limit, max_visits=max_visits
    )
    chosen = build_layout(groups, pp, costs=costs, virtual_stages=v, **opts)
    return build_layout(groups, pp, layout=chosen.to_string(), virtual_stages=v)


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
    schedule: str = DEFAULT_PIPELINE_SCHEDULE,
    virtual_stages: int = 1,
    time_misses: bool = True,
    timed: bool = True,
    max_visits: int | None = None,
) -> Candidate:
    """Predicted memory and step of one configuration (raises LayoutError if the layout is impossible;
    `time_misses` False: a configuration that misses memory is not timed, its `time` None; `timed` False:
    none is, and only the end ranks' memory is computed);
    `ckpt` full recomputation, `selective` the core attention's; sequence parallelism at tp > 1 unless
    `--no-sequence-parallel`; `schedule` a registered pipeline schedule with `virtual_stages` chunks per rank;
    `max_visits` limits an exact layout search (`layout_for`)."""
    dp = res.num_gpus // (tp * pp)
    recompute, offloads = (ckpt, selective), (offload, offload_param)
    inputs = _memory_inputs(res, (tp, pp, dp), mb, zero, precision, recompute, offloads, (schedule, virtual_stages))
    layout = layout_for(res, tp, pp, method, inputs, max_visits)
    cand = Candidate(
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
        stages=(),
        inputs=inputs,
    )
    # the ends hold the most (in flight on rank 0, ZB-H1's weight store on P - 1); not so with experts in the middle
    if not time_misses and pp > 1 and not inputs.model.is_moe:
        ends = _end_ranks(res, inputs, layout)
        if ends[-1].total > res.usable_bytes or not timed:  # a miss, or the ends asked: no other rank's streams
            return dataclasses.replace(cand, stages=ends)
    flops = flop_stage_time(inputs, layout.num_stages)
    times = tuple(flops(s, k) for s, k in enumerate(layout.layers_per_stage))
    cand = dataclasses.replace(cand, stages=tuple(stage_memory(inputs, layout)), times=times)
    if not timed or (not time_misses and not fits(res, cand)):
        return cand  # the search only reads a miss's memory
    hw = timing.hardware(res.gpu_name, precision, res.gpus_per_node or 1, res.raw.kernel_profile)
    run = res.run_features or timing.features(zero, precision, inputs.sequence_parallel)
    return dataclasses.replace(cand, time=timing.step_time(_step_inputs(res, cand), hw, run))


def _memory_inputs(
    res: Resolved,
    degrees: tuple[int, int, int],
    mb: int,
    zero: int,
    precision: str,
    recompute: tuple[bool, bool],
    offload: tuple[str, str],
    schedule: tuple[str, int],
) -> MemoryInputs:
    """What the memory model reads of one configuration: (t, p, d) `degrees`, `recompute` (full, selective),
    `offload` (optimizer, parameters), `schedule` (name, virtual stages per rank)."""
    tp, pp, dp = degrees
    ckpt, selective = recompute
    model, teacher = res.model(tp), res.teacher(tp)
    ep = res.expert_parallel_size if model.is_moe or (teacher is not None and teacher.is_moe) else 1
    return MemoryInputs(
        model=model,
        micro_batch_size=mb,
        num_micro_batches=res.global_batch_size // (mb * dp),
        precision=precision,
        zero_stage=zero,
        data_parallel_size=dp,
        tensor_parallel_size=tp,
        checkpoint_activations=ckpt,
        selective_recompute=selective and not ckpt,
        partition_activations=ckpt and bool(res.raw.partition_activations),
        checkpoint_in_cpu=ckpt and bool(res.raw.checkpoint_in_cpu),
        sequence_parallel=sequence_parallel_at(res, tp),
        offload_optimizer=offload[0],
        offload_param=offload[1],
        # pretrain_gpt.py's engine: the plain one for ZeRO-2/3, a one-stage MoE model and distillation
        engine="plain" if zero >= 2 or (model.is_moe and pp == 1) or teacher is not None else "pipeline",
        teacher=teacher,
        schedule=schedule[0],
        virtual_stages=schedule[1],
        expert_parallel_size=ep,
    )


def _end_ranks(res: Resolved, inputs: MemoryInputs, layout: Layout) -> tuple[StageMemory, ...]:
    """The first and last pipeline ranks' memory; the first alone when it already misses."""
    pp = layout.num_ranks
    ends: list[StageMemory] = []
    for rank in (0, pp - 1):
        chunk_layers = tuple(layout.layers_per_stage[i] for i in layout.rank_stages(rank))
        ends.append(rank_memory_for(inputs, rank, pp, chunk_layers))
        if ends[-1].total > res.usable_bytes:
            break
    return tuple(ends)


def _step_inputs(res: Resolved, cand: Candidate) -> StepInputs:
    """What the step-time model reads of a configuration whose memory is known."""
    inputs, layout, ep = cand.inputs, cand.layout, cand.inputs.expert_parallel_size
    return StepInputs(
        model=inputs.model,
        layers_per_stage=tuple(layout.layers_per_stage),
        stage_params=tuple(s.num_params for s in cand.stages),
        micro_batch_size=cand.micro_batch_size,
        num_micro_batches=inputs.num_micro_batches,
        tp=cand.tp,
        dp=cand.dp,
        precision=cand.precision,
        zero_stage=cand.zero_stage,
        checkpoint_activations=cand.checkpoint_activations,
        selective_recompute=inputs.selective_recompute,
        gpus_per_node=res.gpus_per_node or 1,
        schedule=inputs.schedule,
        attention_dropout=inputs.regularization.attention_dropout > 0,
        virtual_stages=inputs.virtual_stages,
        expert_parallel_size=ep,
        stage_expert_params=_rank_expert_params(inputs.model, cand.tp, ep, layout) if ep > 1 else (),
        teacher=inputs.teacher,
    )


def sequence_parallel_at(res: Resolved, tp: int) -> bool:
    """Sequence parallelism is planned whenever t > 1, unless `--no-sequence-parallel`."""
    return tp > 1 and res.raw.sequence_parallel is not False


def recompute_modes(raw: object) -> list[str]:
    """The recomputation modes to try, in `RECOMPUTE` order: those the planner's flags leave open
    (`--checkpoint-activations`: full; `--recompute-activations`: selective; `--no-checkpoint-activations`:
    not full)."""
    if getattr(raw, "checkpoint_activations", None):
        return ["full"]
    if getattr(raw, "recompute_activations", None):
        return ["selective"]
    return ["none", "selective"] if getattr(raw, "checkpoint_activations", None) is False else list(RECOMPUTE)


def _rank_expert_params(model: ModelConfig, tp: int, ep: int, layout: Layout) -> tuple[int, ...]:
    """Per pipeline rank, the expert parameters it holds (its stages' layers' experts / `ep`)."""
    specs = shapes.gpt_spec_params(model, tp, ep)
    return tuple(
        sum(sp.expert_params for s in layout.rank_stages(r) for sp in specs[layout.parts[s] : layout.parts[s + 1]])
        for r in range(layout.num_ranks)
    )


def degree_pairs(res: Resolved) -> list[tuple[int, int]]:
    """(t, p) pairs in preference order: smallest t*p, then larger t."""
    raw, dims = res.raw, res.dims
    if res.model().is_moe:  # experts at t = 1 (plan/experts.py); p = 1 unless --pipeline-model-parallel-size fixes it
        return [(1, raw.pipeline_model_parallel_size or 1)]
    if res.distils:  # pretrain_gpt.py distils at p = 1, at the tensor sizes the teacher allows (plan/distillation.py)
        return [(t, 1) for t, _ in res.teachers if res.num_gpus % t == 0]
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
        expert_parallel_size=res.expert_parallel_size,
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
