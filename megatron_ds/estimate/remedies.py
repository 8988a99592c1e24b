"""The changes that may lower the fullest stage's memory (`Remedy`): each with when it applies (the changed
configuration, or None), the flags that ask for it and its throughput cost, from the cheapest (ZeRO-1, sequence
parallelism) to the parameters offloaded to the CPU; `REMEDIES` lists them all, and `trains` says whether
pretrain_gpt.py runs a changed configuration. Pure: no torch.

`fit_advice.py` asks the memory model again with each of them (its one-line advice and the planner's `memory`
section).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from megatron_ds.config.parallel import DEFAULT_PIPELINE_SCHEDULE
from megatron_ds.estimate.memory_inputs import MemoryInputs


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
