"""The step-time model's input and its result: `StepInputs`, one configuration whose training step is timed
(its stages' layers and parameters, batch, parallelism, precision, ZeRO stage, recomputation, schedule), and
`StepTime`, the predicted step and where its seconds go, with its throughput (TFLOP/s, MFU, tokens/s).
`step_time.predict_step` makes one from the other. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_ds.config import ModelConfig
from megatron_ds.config.parallel import DEFAULT_PIPELINE_SCHEDULE


@dataclass(frozen=True)
class StepInputs:
    """One configuration whose step is timed."""

    model: ModelConfig
    layers_per_stage: tuple[int, ...]
    """Per flat stage (v x P with virtual stages; flat stage c x P + r is chunk c of rank r)."""
    stage_params: tuple[int, ...]
    """Parameters per tensor rank on each pipeline rank, its chunks together (what its gradients and optimizer
    hold)."""
    micro_batch_size: int
    num_micro_batches: int
    tp: int
    dp: int
    precision: str
    zero_stage: int
    checkpoint_activations: bool
    gpus_per_node: int
    schedule: str = DEFAULT_PIPELINE_SCHEDULE
    selective_recompute: bool = False
    """Each layer's core attention forward again in its backward (`--recompute-activations`)."""
    attention_dropout: bool = True
    checkpoint_num_layers: int = 1
    virtual_stages: int = 1
    """Model chunks per rank v (the interleaved schedule; 1 otherwise)."""
    expert_parallel_size: int = 1
    """E (a mixture-of-experts student or teacher): each MoE layer's all-to-alls run over E consecutive data-parallel
    ranks."""
    stage_expert_params: tuple[int, ...] = ()
    """Of `stage_params`, the experts' on each rank (empty: none): their gradients are reduced, and their optimizer
    state partitioned, over the d / E ranks of the expert-data-parallel group."""
    teacher: ModelConfig | None = None
    """Knowledge distillation's teacher (`--kd`, P = 1): its forward and the kd loss join every micro-batch
    (`distillation_costs.step_times`); model FLOPs stay the student's, as the trainer's log line counts them."""

    @property
    def pp(self) -> int:
        """Pipeline ranks P."""
        return len(self.layers_per_stage) // self.virtual_stages

    @property
    def num_flat(self) -> int:
        """Flat stages v x P."""
        return len(self.layers_per_stage)

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_micro_batches * self.dp


@dataclass(frozen=True)
class StepTime:
    """A predicted step and where its seconds go."""

    seconds: float
    forward: tuple[float, ...]
    """Per flat stage: one micro-batch's forward (seconds)."""
    backward: tuple[float, ...]
    """Per flat stage: one micro-batch's backward, recomputation and exposed per-micro-batch reduction included."""
    optimizer: tuple[float, ...]
    """Per rank (its chunks together)."""
    reduce_grads: tuple[float, ...]
    """Per rank: the exposed data-parallel reduction after the last backward."""
    send: float
    tied_reduce: float
    model_flops: float
    """Model FLOPs of the step over all GPUs (no recomputation)."""
    hardware_flops: float
    """FLOPs run, recomputation included (eq. 3's counting with recomputation on), and a distilling run's teacher
    forward."""
    num_gpus: int
    tokens: int
    peak_flops: float
    parts: dict = field(default_factory=dict)
    """Seconds per micro-batch on the slowest stage by kind (matmul, attention, memory, tp-comm, recompute)."""
    dp_per_micro_batch: tuple[float, ...] = ()
    """Per rank: data-parallel communication exposed inside every micro-batch's passes (ZeRO-2/3)."""
    ideal: float = 0.0
    """The same compute in equal stages with no pipeline bubble and no communication between stages."""
    simulated: bool = True
    """Replayed through the schedule's instructions (else 1F1B's closed form, `closed_form_step`)."""
    virtual_stages: int = 1

    def per_rank(self, values: Sequence[float]) -> tuple[float, ...]:
        """Per-flat-stage values summed over each rank's chunks (flat stage c x P + r)."""
        p = len(values) // self.virtual_stages
        return tuple(sum(values[c * p + r] for c in range(self.virtual_stages)) for r in range(p))

    @property
    def rank_forward(self) -> tuple[float, ...]:
        """Per rank: one micro-batch's forward over its chunks."""
        return self.per_rank(self.forward)

    @property
    def rank_backward(self) -> tuple[float, ...]:
        return self.per_rank(self.backward)

    @property
    def tflops_per_gpu(self) -> float:
        """Model TFLOP/s per GPU (Megatron-LM's throughput line)."""
        return self.model_flops / self.seconds / self.num_gpus / 1e12

    @property
    def hardware_tflops_per_gpu(self) -> float:
        return self.hardware_flops / self.seconds / self.num_gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / self.seconds / self.num_gpus / self.peak_flops

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds
