"""What would make a run fit: the changes that lower the fullest stage's memory, each with its
flags and its cost, and the memory model asked again with each. Pure: no torch.

Two askers read the same changes:

- `fit_advice`, the one-line ending of `--pp-partition-method fastest` / `profile`'s error when no
  split of the layers fits (`run_layout.build_run_layout`): the smallest larger P, recomputation,
  ZeRO-1, optimizer offload and, at pipeline size 1 (DeepSpeed's plain engine), ZeRO-2, ZeRO-3,
  ZeRO-2 with optimizer offload and ZeRO-3 parameter offload, each with the least largest stage any split reaches (exact).
- `ranked_changes`, the planner's `memory` section (`plan/memory_advice.py` renders it): every
  change that applies to a configuration, with its saving on the fullest stage under the layout
  the changed configuration gets, cheapest first; and, when none of them fits alone,
  `fitting_combination`: the cheapest two or three of them together that fit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_ds.config.parallel import DEFAULT_PIPELINE_SCHEDULE
from megatron_ds.estimate.memory_inputs import MemoryInputs
from megatron_ds.estimate.memory_model import stage_memory, stage_memory_for
from megatron_ds.pipeline.balance import minimax_split
from megatron_ds.pipeline.layout import Layout, LayoutError
from megatron_ds.units import format_bytes

LayoutFor = Callable[[MemoryInputs, str], Layout]
"""The layout a layout method (a planner `--layout` choice) gives a configuration; raises LayoutError."""


@dataclass(frozen=True)
class Remedy:
    """A change to the configuration that may lower the fullest stage's memory."""

    name: str
    cost: str
    cost_rank: int
    """0: no throughput cost, 1: some, 2: large (the order the planner lists them in)."""
    change: Callable[[MemoryInputs], MemoryInputs | None]
    """The changed configuration; None where the change does not apply."""
    flags: Callable[[MemoryInputs], str]
    """How to ask for it, given the changed configuration."""
    same_layout: bool = False
    """True: the stage split stays as it is (moving states off the GPU moves no layer)."""
    single_stage: bool = False
    """True: it runs at pipeline size 1 only (DeepSpeed's plain engine)."""
    replaces: Callable[[MemoryInputs], str | None] = lambda before: None
    """A flag of the configuration before the change that must go (pretrain_gpt.py refuses both), or None."""

    def ask(self, before: MemoryInputs, after: MemoryInputs) -> str:
        """The flags that turn `before` into `after`."""
        dropped = self.replaces(before)
        return f"{self.flags(after)} in place of {dropped}" if dropped else self.flags(after)


@dataclass(frozen=True)
class Change:
    """A remedy applied to one configuration: its predicted saving on the fullest stage (bytes)."""

    name: str
    flags: str
    saving: float
    cost: str
    cost_rank: int
    peak: float = 0.0
    """The fullest stage's predicted memory per rank after the change (bytes)."""


def _halved(inputs: MemoryInputs) -> MemoryInputs | None:
    """Half the micro-batch, twice the micro-batches: the same samples per step when they divide."""
    half, samples = inputs.micro_batch_size // 2, inputs.micro_batch_size * inputs.num_micro_batches
    if not half or samples % half:
        return None
    return dataclasses.replace(inputs, micro_batch_size=half, num_micro_batches=samples // half)


ZERO_1 = Remedy(
    "ZeRO-1",
    "same communication volume as data parallelism (ZeRO paper Sec. 7)",
    0,
    lambda i: dataclasses.replace(i, zero_stage=1) if i.zero_stage == 0 and i.data_parallel_size > 1 else None,
    lambda i: "--zero-stage 1",
)
SEQUENCE_PARALLEL = Remedy(
    "sequence parallelism",
    "none in compute; all-gather + reduce-scatter in place of the tensor-parallel all-reduce, the same volume "
    "(Korthikanti et al. 2022, Sec. 4.2.2)",
    0,
    lambda i: (
        dataclasses.replace(i, sequence_parallel=True)
        if i.tensor_parallel_size > 1 and not i.sequence_parallel
        else None
    ),
    lambda i: "--sequence-parallel",
)


def _ulysses(inputs: MemoryInputs) -> MemoryInputs | None:
    """DeepSpeed-Ulysses at the smallest degree N the run allows: N divides the heads, the key/value heads,
    the sequence and the data-parallel ranks it comes out of (T = 1; the caller checks P = 1). The ZeRO group
    stays the same ranks (DP / N x N)."""
    m = inputs.model
    if inputs.tensor_parallel_size > 1 or inputs.ulysses_size > 1:
        return None
    for n in (2, 4, 8):
        sizes = (m.num_attention_heads, m.kv_heads, m.seq_length, inputs.data_parallel_size)
        if all(x % n == 0 for x in sizes):
            return dataclasses.replace(inputs, ulysses_size=n, engine="plain")
    return None


ULYSSES = Remedy(
    "DeepSpeed-Ulysses sequence parallelism",
    "two all-to-alls around each attention (q, k, v in, the context out: 4/N of a layer's activation per GPU; "
    "Jacobs et al. 2023); data parallelism shrinks N times; DeepSpeed's plain engine, T = P = 1",
    1,
    _ulysses,
    lambda i: f"--ds-sequence-parallel-size {i.ulysses_size}",
    single_stage=True,
)
SELECTIVE_RECOMPUTE = Remedy(
    "selective recomputation",
    "each layer's core attention again in backward, a few % more compute (Korthikanti et al. 2022, Sec. 5); "
    "saves the s x s attention tensors, which fused (flash) attention kernels do not keep anyway",
    1,
    lambda i: (
        None if i.checkpoint_activations or i.selective_recompute else dataclasses.replace(i, selective_recompute=True)
    ),
    lambda i: "--recompute-activations",
)
RECOMPUTE = Remedy(
    "activation recomputation",
    "about one extra forward per layer, ~1/3 more compute (Korthikanti et al. 2022)",
    1,
    lambda i: (
        None
        if i.checkpoint_activations
        else dataclasses.replace(i, checkpoint_activations=True, selective_recompute=False)
    ),
    lambda i: "--checkpoint-activations",
    replaces=lambda before: "--recompute-activations" if before.selective_recompute else None,
)
HALVE_MICRO_BATCH = Remedy(
    "halve the micro-batch",
    "smaller matrix multiplies (lower GPU efficiency); twice the micro-batches, which shrinks the bubble",
    1,
    _halved,
    lambda i: f"--micro-batch-size {i.micro_batch_size}",
)


def _optimizer_flags(inputs: MemoryInputs) -> str:
    """The optimizer offload as pretrain_gpt.py spells it: DeepSpeed's CPU Adam for Adam, torch's optimizer
    on the host otherwise (`--cpu-optimizer` is an Adam)."""
    if inputs.offload_optimizer == "cpu" and inputs.optimizer == "adam":
        return "--cpu-optimizer"
    return f"--offload-optimizer {inputs.offload_optimizer}"


def _plain_engine(inputs: MemoryInputs, zero_stage: int, **offload: str) -> MemoryInputs | None:
    """ZeRO 2/3 on DeepSpeed's plain engine, which runs at pipeline size 1 with the 1F1B schedule only
    (`Config._check_engine`; `single_stage` keeps it off P > 1); None under another schedule."""
    if inputs.schedule != DEFAULT_PIPELINE_SCHEDULE or inputs.virtual_stages > 1:
        return None
    return dataclasses.replace(inputs, zero_stage=zero_stage, engine="plain", **offload)


def _zero_stage(stage: int, cost: str, order: int) -> Remedy:
    """ZeRO-`stage` alone on the plain engine: offered over more than one data-parallel rank, below that stage."""
    return Remedy(
        f"ZeRO-{stage}",
        f"{cost}; DeepSpeed's plain engine, pipeline size 1",
        order,
        lambda i: _plain_engine(i, stage) if i.zero_stage < stage and i.data_parallel_size > 1 else None,
        lambda i: f"--zero-stage {stage}",
        same_layout=True,
        single_stage=True,
    )


ZERO_2 = _zero_stage(
    2,
    "same communication volume as data parallelism (a reduce-scatter of the gradients, an all-gather of the "
    "parameters; ZeRO paper Sec. 7.2.1)",
    0,
)
ZERO_3 = _zero_stage(
    3,
    "1.5x data parallelism's communication volume (the parameters all-gathered in forward and again in "
    "backward; ZeRO paper Sec. 7.2.2)",
    1,
)
OFFLOAD_OPTIMIZER = Remedy(
    "offload optimizer states to CPU",
    "PCIe traffic every step and the optimizer step on the CPU (DeepSpeed's CPU Adam); needs host memory",
    2,
    lambda i: (
        dataclasses.replace(i, zero_stage=max(1, i.zero_stage), offload_optimizer="cpu")
        if i.offload_optimizer == "none"
        else None
    ),
    lambda i: f"{_optimizer_flags(i)} --zero-stage {i.zero_stage}",
    same_layout=True,
)
ZERO_2_OFFLOAD = Remedy(
    "ZeRO-2 with optimizer states offloaded to CPU (ZeRO-Offload)",
    "PCIe traffic every step (the gradients to the host, the updated parameters back) and the optimizer step "
    "on the CPU (Ren et al. 2021); needs host memory; DeepSpeed's plain engine, pipeline size 1",
    2,
    lambda i: (
        _plain_engine(i, 2, offload_optimizer="cpu") if i.zero_stage < 2 and i.offload_optimizer == "none" else None
    ),
    lambda i: f"--zero-stage 2 {_optimizer_flags(i)}",
    same_layout=True,
    single_stage=True,
)
OFFLOAD_PARAM = Remedy(
    "ZeRO-3 with parameters and optimizer states offloaded to CPU",
    "the parameters cross PCIe in every forward and backward, the optimizer step on the CPU; needs host memory "
    "(ZeRO-Infinity, Rajbhandari et al. 2021); DeepSpeed's plain engine, pipeline size 1",
    2,
    lambda i: (
        _plain_engine(
            i, 3, offload_param="cpu", offload_optimizer="cpu" if i.offload_optimizer == "none" else i.offload_optimizer
        )
        if i.offload_param == "none"
        else None
    ),
    lambda i: f"--zero-stage 3 {_optimizer_flags(i)} --offload-param {i.offload_param}",
    same_layout=True,
    single_stage=True,
)
ONE_BIT = Remedy(
    "1-bit Adam / 0/1 Adam / 1-bit LAMB",
    "no memory saving: they compress gradient communication and keep Adam's states plus error-"
    "feedback buffers; not in the installed DeepSpeed and incompatible with ZeRO (see `onebit`)",
    2,
    lambda i: i,  # listed because it is often suggested: the memory model finds nothing to save
    lambda i: "optimizer type OneBitAdam etc.",
    same_layout=True,
)
REMEDIES: tuple[Remedy, ...] = (
    ZERO_1,
    ZERO_2,
    SEQUENCE_PARALLEL,
    SELECTIVE_RECOMPUTE,
    ULYSSES,
    RECOMPUTE,
    ZERO_3,
    HALVE_MICRO_BATCH,
    OFFLOAD_OPTIMIZER,
    ZERO_2_OFFLOAD,
    OFFLOAD_PARAM,
    ONE_BIT,
)
"""In the order equal-cost changes are listed."""
REBALANCE_COST = "none in memory or communication; stage times become unequal"


def trains(inputs: MemoryInputs) -> bool:
    """pretrain_gpt.py trains a changed run: not ZeRO-3 or Ulysses with a mixture-of-experts model
    (`Config._check_experts`), not Ulysses with a teacher (`Config._check_distillation`), not ZeRO-3 or T > 1 with a
    mixture-of-experts teacher (`training/checkpoint/teacher.check_experts`)."""
    if inputs.teacher is not None and inputs.ulysses_size > 1:
        return False
    if (
        inputs.teacher is not None
        and inputs.teacher.is_moe
        and (inputs.zero_stage > 2 or inputs.tensor_parallel_size > 1)
    ):
        return False
    return not (inputs.model.is_moe and (inputs.zero_stage > 2 or inputs.ulysses_size > 1))


def least_memory(inputs: MemoryInputs, num_stages: int) -> float:
    """The smallest largest-stage memory any split of the layers over `num_stages` needs (exact)."""
    n = inputs.model.num_layers
    return minimax_split(n, num_stages, lambda s, k: stage_memory_for(inputs, s, num_stages, k).total)[1]


ONE_LINE: tuple[Remedy, ...] = (
    SEQUENCE_PARALLEL,
    RECOMPUTE,
    ZERO_1,
    ZERO_2,
    ZERO_3,
    OFFLOAD_OPTIMIZER,
    ZERO_2_OFFLOAD,
    OFFLOAD_PARAM,
)
"""The changes the one-line advice tries (besides a larger P), in the order it names them."""


def fit_advice(inputs: MemoryInputs, num_stages: int, limit: float) -> str:
    """`it would fit with ...` naming the smallest larger P and each of `ONE_LINE` that fits (ZeRO 2/3 and
    parameter offload at pipeline size 1 only), each with its least largest stage per rank; or what else
    to try when none does."""
    found = []
    max_stages = inputs.model.num_layers + 2
    for p in range(num_stages + 1, max_stages + 1):  # the same data parallelism, more stages (ranks)
        need = least_memory(inputs, p)
        if need <= limit:
            found.append(f"--pipeline-model-parallel-size {p} ({format_bytes(need)} on its largest stage)")
            break
    tried = [r for r in ONE_LINE if num_stages == 1 or not r.single_stage]
    where = " per rank" if num_stages == 1 else " on its largest stage"
    for remedy in tried:
        changed = remedy.change(inputs)
        if changed is not None:
            need = least_memory(changed, num_stages)
            if need <= limit:
                found.append(f"{remedy.ask(inputs, changed)} ({format_bytes(need)}{where})")
    if found:
        return "it would fit with " + ", or ".join(found)
    pair = _fitting_pair(inputs, num_stages, limit, tried)
    alone = (
        f"no larger --pipeline-model-parallel-size (up to {max_stages}), nor {', '.join(r.name for r in tried)} alone"
    )
    if pair is not None:
        return f"{alone} makes it fit; together {pair} would"
    return f"{alone} or two of them together makes it fit; lower --micro-batch-size or raise --pp-memory-limit"


def _fitting_pair(inputs: MemoryInputs, num_stages: int, limit: float, tried: Sequence[Remedy]) -> str | None:
    """The cheapest two of `tried` together whose least largest stage fits (`fitting_combination`'s order
    without a layout: any split), as flags with that stage; None when no pair does."""
    where = " per rank" if num_stages == 1 else " on its largest stage"
    best: tuple[tuple, str] | None = None
    for combo in _pairs(tried):
        steps = _steps(combo, inputs)
        if steps is None:
            continue
        need = least_memory(steps[-1][2], num_stages)
        if need > limit:
            continue
        key = (*_cheapness(combo, [r.cost_rank for r in combo]), need)
        if best is None or key < best[0]:
            flags = " ".join(r.ask(before, after) for r, before, after in steps)
            best = (key, f"{flags} ({format_bytes(need)}{where})")
    return best[1] if best else None


def _peak(inputs: MemoryInputs, layout: Layout) -> float:
    return max(s.total for s in stage_memory(inputs, layout))


def _rebuilt_peak(inputs: MemoryInputs, method: str, layout_for: LayoutFor) -> tuple[float, Layout] | None:
    """The fullest stage under the layout `method` gives `inputs`; None when there is none."""
    try:
        layout = layout_for(inputs, method)
        return _peak(inputs, layout), layout
    except (LayoutError, ValueError, ZeroDivisionError):  # an impossible configuration saves nothing
        return None


def ranked_changes(
    inputs: MemoryInputs,
    layout: Layout,
    method: str,
    layout_for: LayoutFor,
    rebalance: Sequence[str] = (),
    rebalance_flags: Callable[[str, Layout], str] = lambda method, layout: method,
) -> list[Change]:
    """Every change that applies to the configuration `inputs` laid out as `layout` by `method`,
    cheapest first (cost rank, then the larger saving): the other layout methods in `rebalance`
    that lower the fullest stage (their flags from `rebalance_flags`), then each of `REMEDIES`."""
    base, found = _peak(inputs, layout), []
    for other in rebalance:
        rebuilt = None if other == method else _rebuilt_peak(inputs, other, layout_for)
        if rebuilt is not None and base - rebuilt[0] > 0:
            name, flags = f"rebalance stages ({other})", rebalance_flags(other, rebuilt[1])
            found.append(Change(name, flags, base - rebuilt[0], REBALANCE_COST, 0, rebuilt[0]))
    for remedy in REMEDIES:
        changed = remedy.change(inputs)
        if changed is None or (remedy.single_stage and layout.num_stages > 1) or not trains(changed):
            continue
        if remedy.same_layout:
            saving = base - _peak(changed, layout)
        else:
            rebuilt = _rebuilt_peak(changed, method, layout_for)
            saving = 0.0 if rebuilt is None else base - rebuilt[0]
        found.append(
            Change(remedy.name, remedy.ask(inputs, changed), saving, remedy.cost, remedy.cost_rank, base - saving)
        )
    return sorted(found, key=lambda c: (c.cost_rank, -c.saving))


def _steps(remedies: Sequence[Remedy], inputs: MemoryInputs) -> list[tuple[Remedy, MemoryInputs, MemoryInputs]] | None:
    """Each remedy applied to what the ones before it made, with its before and after; None where one does not apply."""
    steps, now = [], inputs
    for remedy in remedies:
        changed = remedy.change(now)
        if changed is None or changed == now:
            return None
        steps.append((remedy, now, changed))
        now = changed
    return steps


def _pairs(remedies: Sequence[Remedy]) -> list[tuple[Remedy, Remedy]]:
    """Each two of `remedies` in their order (halving the micro-batch may come twice)."""
    return [(a, b) for i, a in enumerate(remedies) for b in remedies[i:] if a is not b or a is HALVE_MICRO_BATCH]


def _cheapness(combo: Sequence[Remedy], ranks: Sequence[int]) -> tuple[int, int, int, int]:
    """How cheap changes together are (`ranks`: each part's cost rank, a rebalance's too): the largest cost
    rank, then their sum, then fewer parts, then the milder remedies (REMEDIES lists equal costs mildest first)."""
    return max(ranks), sum(ranks), len(ranks), sum(REMEDIES.index(r) for r in combo)


def fitting_combination(
    inputs: MemoryInputs,
    layout: Layout,
    method: str,
    layout_for: LayoutFor,
    limit: float,
    rebalance: str | None = None,
    rebalance_flags: Callable[[str, Layout], str] = lambda method, layout: method,
) -> Change | None:
    """The cheapest changes together whose fullest stage fits `limit`, for when no single change does: two of
    `REMEDIES` (halving the micro-batch may come twice), one or two of them with the layout method
    `rebalance`. Cheapest: `_cheapness`, then the smaller fullest stage. None when none of these fits."""
    usable = [
        r
        for r in REMEDIES
        if r is not ONE_BIT and not (r.single_stage and layout.num_stages > 1) and r.change(inputs)
        if trains(r.change(inputs))
    ]
    combos: list[tuple[Remedy, ...]] = [(r,) for r in usable] + _pairs(usable)
    methods = [method] + ([rebalance] if rebalance and rebalance != method and layout.num_stages > 1 else [])
    base = _peak(inputs, layout)
    best: tuple[tuple, Change] | None = None
    for combo in combos:
        steps = _steps(combo, inputs)
        if steps is None:
            continue
        changed = steps[-1][2]
        for m in methods:
            if len(combo) + (m != method) < 2:
                continue  # a single change alone is one of `ranked_changes`' rows
            if m == method and all(r.same_layout for r in combo):
                peak, new_layout = _peak(changed, layout), layout
            else:
                rebuilt = _rebuilt_peak(changed, m, layout_for)
                if rebuilt is None:
                    continue
                peak, new_layout = rebuilt
            if peak > limit:
                continue
            parts = [(r.name, r.ask(before, after), r.cost, r.cost_rank) for r, before, after in steps]
            if m != method:
                parts.append((f"rebalance stages ({m})", rebalance_flags(m, new_layout), REBALANCE_COST, 0))
            key = (*_cheapness(combo, [p[3] for p in parts]), peak)
            if best is None or key < best[0]:
                names, flags, costs, ranks = zip(*parts)
                best = (
                    key,
                    Change(" + ".join(names), " ".join(flags), base - peak, "; ".join(costs), max(ranks), peak),
                )
    return best[1] if best else None
