"""The costs a partition method balances, built from the model, the memory model and the compute
model. Pure: no torch.

The layout engine (`megatron_ds.pipeline`) measures nothing: a method's registry entry says what
it `needs`, and `method_costs` builds exactly that (parameter counts per spec from
`model/naming.py`, the memory model's `cost(stage, num_layers)`, the compute model's stage times,
the schedule simulator's step, the memory limit), for runs (`estimate/run_layout.py`) and the
planner (`plan/search.py`) alike. Measured stage times (`profile`) come in from the caller, which
may run torch (`estimate/calibrate.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from megatron_ds.config import ModelConfig
from megatron_ds.config.parallel import DEFAULT_PIPELINE_SCHEDULE
from megatron_ds.estimate import pipeline_schedules
from megatron_ds.estimate.compute import ComputeInputs, stage_flops_for
from megatron_ds.estimate.memory_inputs import MemoryInputs, StageMemory
from megatron_ds.estimate.memory_model import stage_memory_for
from megatron_ds.estimate.step_simulator import balanced_step_time, simulate, step_estimator
from megatron_ds.model.shapes import gpt_spec_param_counts
from megatron_ds.pipeline import methods
from megatron_ds.pipeline.costs import StageTime, StageTimeFn
from megatron_ds.pipeline.methods import Costs, PartitionMethod
from megatron_ds.units import format_bytes, format_number

GFLOP = 1e9


def compute_inputs(mem: MemoryInputs) -> ComputeInputs:
    """The compute model's inputs for the run the memory model describes. Causal attention is
    counted as the triangle when the flash kernel runs (it skips the blocks above the diagonal), the whole
    square under `--reset-attention-mask`'s explicit mask (a masked kernel computes every block)."""
    return ComputeInputs(
        mem.model,
        micro_batch_size=mem.micro_batch_size,
        tensor_parallel_size=mem.tensor_parallel_size,
        checkpoint_activations=mem.checkpoint_activations,
        checkpoint_num_layers=mem.checkpoint_num_layers,
        causal_attention=mem.kernels.attention == "flash" and not mem.document_mask,
        selective_recompute=mem.selective_recompute,
        ulysses_size=mem.ulysses_size,
    )


def flop_stage_time(mem: MemoryInputs, num_stages: int) -> StageTimeFn:
    """`time(stage, num_layers)` in GFLOP of one micro-batch (forward; backward with recomputation, of
    which `weight` the linear layers' weight gradients); the optimizer step is not counted (no FLOPs of
    matmul kind). `num_stages`: the layout's (flat) stages."""
    inputs = compute_inputs(mem)

    def stage_time(stage: int, num_layers: int) -> StageTime:
        st = stage_flops_for(inputs, stage, num_stages, num_layers)
        return StageTime(st.forward / GFLOP, st.backward_total / GFLOP, weight=st.weight / GFLOP)

    return stage_time


def method_costs(
    entry: PartitionMethod | None,
    model: ModelConfig,
    num_stages: int,
    inputs: Callable[[], MemoryInputs],
    memory_limit: Callable[[], float] | None = None,
    measured_time: Callable[[], StageTimeFn] | None = None,
    max_visits: int | None = None,
) -> Costs:
    """The costs `entry` needs, and only those (each callable is called only if its cost is needed);
    `max_visits` limits the exact search's work (`Costs.max_visits`)."""
    if entry is None:
        return Costs()
    needs = set(entry.needs)
    weights = gpt_spec_param_counts(model) if methods.SPEC_WEIGHTS in needs else None
    mem = inputs() if needs & {methods.STAGE_MEMORY, methods.STAGE_TIME, methods.STEP_TIME} else None

    def stage_cost(stage: int, num_layers: int) -> float:
        assert mem is not None
        return stage_memory_for(mem, stage, num_stages, num_layers).total

    return Costs(
        spec_weights=weights,
        stage_memory=stage_cost if methods.STAGE_MEMORY in needs else None,
        stage_time=flop_stage_time(mem, num_stages) if mem is not None and methods.STAGE_TIME in needs else None,
        measured_stage_time=measured_time() if measured_time and methods.MEASURED_STAGE_TIME in needs else None,
        step_time=step_estimator(
            mem.num_micro_batches,
            tied=not model.untie_embeddings_and_output_weights,
            schedule=mem.schedule,
            virtual_stages=mem.virtual_stages,
        )
        if mem is not None and methods.STEP_TIME in needs
        else None,
        memory_limit=memory_limit() if memory_limit and methods.MEMORY_LIMIT in needs else None,
        max_visits=max_visits,
    )


def format_memory_table(stages: Sequence[StageMemory], usable_bytes: float | None = None) -> str:
    """The predicted memory per stage (`StageMemory` list) as a table to print under `Layout.format()`."""
    head = (
        f"{'stage':>5} {'layers':>6} {'params':>10} {'grads':>10} {'optim':>10} {'activ.':>10} "
        f"{'in-flight':>9} {'buffers':>10} {'total':>10}"
    )
    lines = ["predicted memory per GPU (estimate, see docs/planner.md for the formulas)", head]
    for st in stages:
        lines.append(
            f"{st.stage:>5} {st.num_layers:>6} {format_bytes(st.params):>10} {format_bytes(st.grads):>10} "
            f"{format_bytes(st.optimizer):>10} {format_bytes(st.activations):>10} {st.in_flight:>9} "
            f"{format_bytes(st.pipe_buffers + st.transient):>10} {format_bytes(st.total):>10}"
        )
    peak = max(stages, key=lambda st: st.total)
    summary = f"largest: stage {peak.stage} {format_bytes(peak.total)}"
    if usable_bytes is not None:
        summary += (
            f" of {format_bytes(usable_bytes)} usable ({'fits' if peak.total <= usable_bytes else 'DOES NOT FIT'})"
        )
    lines.append(summary)
    return "\n".join(lines)


def format_time_table(
    times: Sequence[StageTime],
    memories: Sequence[StageMemory],
    num_micro_batches: int,
    unit: str,
    source: str,
    memory_limit: float | None = None,
    schedule: str = DEFAULT_PIPELINE_SCHEDULE,
    virtual_stages: int = 1,
) -> str:
    """Per stage: one micro-batch's forward and backward, the optimizer step, the step's compute
    (M x (forward + backward) + optimizer) and the predicted memory; then the step simulated
    through `schedule` against the ideal (the same work in equal stages, through the same schedule).
    With virtual stages the times are per flat stage and the memory per rank."""
    m = num_micro_batches
    head = (
        f"{'stage':>5} {'layers':>6} {'forward':>10} {'backward':>10} {'optimizer':>10} {'per step':>10} {'memory':>10}"
    )
    lines = [f"predicted time per stage ({unit}; {source}) and memory (memory model)", head]
    p = len(times) // virtual_stages
    for i, t in enumerate(times):
        st = memories[i % p]
        per_step = m * (t.forward + t.backward) + t.optimizer
        layers = st.num_layers if virtual_stages == 1 else ""
        memory = format_bytes(st.total) if i < p else ""  # with virtual stages a rank's memory: on its first chunk
        lines.append(
            f"{i:>5} {layers:>6} {format_number(t.forward):>10} {format_number(t.backward):>10} "
            f"{format_number(t.optimizer):>10} {format_number(per_step):>10} {memory:>10}"
        )
    fwd, bwd, opt, wgt = ([getattr(t, a) for t in times] for a in ("forward", "backward", "optimizer", "weight"))
    step = simulate(m, fwd, bwd, opt, schedule=schedule, weight=wgt, virtual_stages=virtual_stages).step_time
    ideal = balanced_step_time(m, fwd, bwd, schedule, wgt, virtual_stages) + sum(opt) / p
    peak = max(st.total for st in memories)
    limit = f" of the {format_bytes(memory_limit)} limit" if memory_limit is not None else ""
    label = pipeline_schedules.find(schedule, virtual_stages).display
    lines.append(
        f"simulated {label} step (M={m}, one device per stage): {format_number(step)} {unit} = {step / ideal:.3f} x the ideal "
        f"(the same work in {len(times)} equal stages); largest stage {format_bytes(peak)}{limit}"
    )
    return "\n".join(lines)
