"""The memory model's inputs (`MemoryInputs`) and results (`SpecMemory`, `StageMemory`). Pure: no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.config.parallel import DEFAULT_PIPELINE_SCHEDULE
from megatron_ds.estimate import activation_kernels, pipeline_schedules
from megatron_ds.estimate.model_states import OPTIMIZER_STATE_BYTES, PRECISION_BYTES, StateFactors, state_factors

ZERO3_PERSISTENCE_THRESHOLD = 100_000
"""DeepSpeed's default `stage3_param_persistence_threshold` (elements)."""
ZERO3_PREFETCH_ELEMENTS = 50_000_000
"""DeepSpeed's default `stage3_prefetch_bucket_size` (elements)."""


@dataclass(frozen=True)
class MemoryInputs:
    """What the memory of one pipeline stage depends on."""

    model: ModelConfig
    micro_batch_size: int
    """Samples per micro-batch per data-parallel rank."""
    num_micro_batches: int
    """Micro-batches per optimizer step on each pipeline (gradient accumulation steps)."""
    precision: str = "bf16"
    """`fp32`, `bf16` or `fp16`."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage 0-3 (the pipeline engine accepts 0 and 1 only)."""
    data_parallel_size: int = 1
    """Ranks that ZeRO partitions over (one stage's data-parallel group)."""
    tensor_parallel_size: int = 1
    """Tensor-parallel degree t: layer matrices, vocab and attention heads are split t ways."""
    checkpoint_activations: bool = False
    """Recompute transformer layers in backward (`--checkpoint-activations`)."""
    checkpoint_num_layers: int = 1
    """Layers per recomputed chunk (`--checkpoint-num-layers`)."""
    selective_recompute: bool = False
    """Recompute each layer's core attention in backward (`--recompute-activations`)."""
    partition_activations: bool = False
    """Full recomputation's checkpoints partitioned over the tensor ranks (`--partition-activations`): each keeps
    1/t of every recomputed chunk's input."""
    checkpoint_in_cpu: bool = False
    """Full recomputation's checkpoints kept in host memory (`--checkpoint-in-cpu` on a GPU): none on the device."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (`--sequence-parallel`, t > 1): the replicated activations, and what
    passes between stages, split t ways along the sequence."""
    ulysses_size: int = 1
    """DeepSpeed-Ulysses degree N (`--ds-sequence-parallel-size`): every activation split N ways.
    `data_parallel_size` is then the ZeRO group, DP x N ranks."""
    expert_parallel_size: int = 1
    """Mixture-of-experts expert parallelism E (`--moe-expert-parallel-size`): a layer with experts holds experts / E
    of them (`model.shapes.moe_layer_params`), the student's and a mixture-of-experts teacher's."""
    teacher: ModelConfig | None = None
    """Knowledge distillation's teacher (`--kd`, `--mos`; at the student's tensor size, the plain engine): its
    weights beside the student, the kd loss's saved tensors and its forward's transients (`distillation_costs`)."""
    engine: str = "pipeline"
    """`pipeline` (DeepSpeed's PipelineEngine and its pipe buffers) or `plain` (its DeepSpeedEngine: ZeRO 2/3
    at P = 1 and Ulysses, `Config.engine_kind`), which keeps no buffer but the micro-batch it loaded."""
    optimizer: str = "adam"
    """`adam` or `sgd` (momentum)."""
    offload_optimizer: str = "none"
    """`none`, `cpu` or `nvme`: ZeRO-Offload of master weights, fp32 grads and optimizer states."""
    offload_param: str = "none"
    """`none`, `cpu` or `nvme`: ZeRO-3 parameter offload."""
    device: str = "cuda"
    """`cuda` or `cpu`: whose kernels' saved tensors to count (see `activation_kernels.kernels`), and which
    optimizer kernel runs (`model_states.OPTIMIZER_KERNEL`)."""
    attention: str | None = None
    """`flash`, `math`, or None for what torch's SDPA picks on `device`."""
    document_ids: bool = False
    """Packed documents (`--reset-position-ids` or `--reset-attention-mask`): two int64 ids per token travel with
    every activation between stages and into each recomputed chunk."""
    document_mask: bool = False
    """`--reset-attention-mask`: every layer's attention takes a dense (b, 1, s, s) mask
    (`attention_activations.document_mask_bytes`)."""
    regularization: RegularizationConfig = RegularizationConfig()
    """The run's dropout (which masks are saved, which attention kernel runs); Megatron's defaults
    (0.1) unless given, as the planner assumes."""
    schedule: str = DEFAULT_PIPELINE_SCHEDULE
    """The pipeline schedule (`pipeline_schedules.REGISTRY`): micro-batches in flight, pipe buffers."""
    virtual_stages: int = 1
    """Model chunks per rank (the interleaved schedule; 1 otherwise)."""
    zero3_persistence_threshold: int = ZERO3_PERSISTENCE_THRESHOLD
    """ZeRO-3 keeps a parameter tensor of at most this many elements whole on every rank
    (`stage3_param_persistence_threshold`; DeepSpeed's default, which the generated JSON leaves as it is)."""
    zero3_prefetch_elements: int = ZERO3_PREFETCH_ELEMENTS
    """ZeRO-3 gathers up to this many parameter elements ahead of their use (`stage3_prefetch_bucket_size`,
    DeepSpeed's default)."""

    def __post_init__(self) -> None:
        for name in (
            "micro_batch_size",
            "num_micro_batches",
            "data_parallel_size",
            "tensor_parallel_size",
            "checkpoint_num_layers",
            "ulysses_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.precision not in PRECISION_BYTES:
            raise ValueError(f"precision {self.precision!r} is not one of {', '.join(PRECISION_BYTES)}")
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise ValueError(f"optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZER_STATE_BYTES)}")
        if self.schedule not in pipeline_schedules.REGISTRY:
            raise ValueError(f"schedule {self.schedule!r} is not one of {', '.join(pipeline_schedules.REGISTRY)}")
        if (self.virtual_stages > 1) != pipeline_schedules.find(self.schedule).virtual:
            raise ValueError(f"schedule {self.schedule!r} with {self.virtual_stages} virtual stages per rank")
        if self.engine not in ("pipeline", "plain"):
            raise ValueError(f"engine {self.engine!r} is not one of pipeline, plain")
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise ValueError("sequence_parallel needs tensor_parallel_size > 1")
        if self.selective_recompute and self.checkpoint_activations:
            raise ValueError("selective_recompute and checkpoint_activations are one granularity or the other")
        if (self.partition_activations or self.checkpoint_in_cpu) and not self.checkpoint_activations:
            raise ValueError("partition_activations and checkpoint_in_cpu place full recomputation's checkpoints")
        self.factors  # noqa: B018 - validates zero stage and offload combination
        self.kernels  # noqa: B018 - validates device and attention

    @property
    def pipeline_schedule(self) -> pipeline_schedules.PipelineSchedule:
        """The registry entry, with this run's virtual stages."""
        return pipeline_schedules.find(self.schedule, self.virtual_stages)

    @property
    def factors(self) -> StateFactors:
        return state_factors(
            self.precision,
            self.zero_stage,
            self.optimizer,
            self.offload_optimizer,
            self.offload_param,
            accumulating=self.num_micro_batches > 1,
        )

    @property
    def split(self) -> activation_kernels.Split:
        """How a layer's activations are cut on one rank (`activation_kernels.Split`)."""
        return activation_kernels.Split(
            self.tensor_parallel_size, self.sequence_parallel, self.ulysses_size, self.selective_recompute
        )

    @property
    def kernels(self) -> activation_kernels.SavedWidths:
        return activation_kernels.kernels(
            self.precision, self.device, self.regularization.attention_dropout, self.attention
        )


@dataclass(frozen=True)
class SpecMemory:
    """One layer spec's share of a GPU's memory (bytes; params counted per tensor-parallel rank)."""

    index: int
    name: str
    group: str
    num_params: int
    largest_param: int
    params: float
    grads: float
    optimizer: float
    host: float
    activations: float
    """Saved for backward by one micro-batch without recomputation."""
    checkpointed_activations: float
    """Saved by one micro-batch when this spec is recomputed (transformer layers only)."""
    activation_terms: dict = field(default_factory=dict)
    tied: bool = False
    """The tied LM head: the same matrix as WordEmbedding, a second copy only on another stage."""
    no_decay_params: int = 0
    """Parameters in the no-weight-decay group (biases, norm weights: `training/optimizer.py`)."""
    deferrable_params: int = 0
    """Weights of the spec's linear layers (`model/weight_grad.py`), whose gradients a split backward
    (ZB-H1's BackwardOnlyPass) leaves to the weight pass; every other parameter gets its gradient in the
    backward itself."""
    largest_deferrable: int = 0
    largest_undeferred: int = 0
    """The largest parameter tensors of each kind (elements)."""

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class StageMemory:
    """Predicted peak bytes on one GPU of one pipeline stage."""

    stage: int
    num_layers: int
    num_params: int
    params: float
    grads: float
    optimizer: float
    host: float
    """Offloaded model states per GPU rank, on CPU or NVMe (not in `total`)."""
    activation_per_micro_batch: float
    in_flight: int
    activations: float
    pipe_buffers: float
    transient: float
    """The predicted peak minus model states, activations and pipe buffers, so that `total` is the
    peak. The peak is the largest of the step's moments (`transient_source` names it): a backward
    before the step's gradients exist, a later backward with them, a weight pass (ZB-H1), and the optimizer step (see
    `stage_memory_for`). Positive when a short-lived buffer tops the sum; negative when the
    activation peak and the gradients are never alive together."""
    transient_source: str
    backward_transient: float = 0.0
    """The largest short-lived buffer of a backward on its own (not part of `total`; for callers
    that add it to activations, as `plan/zero.py` does for pure data parallelism)."""
    weight_store_per_micro_batch: float = 0.0
    """ZB-H1: what one micro-batch keeps from its input-gradient backward to its weight pass."""
    teacher: float = 0.0
    """Of `params`, knowledge distillation's teacher's weights (`distillation_costs.teacher_weight_bytes`)."""

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.pipe_buffers + self.transient
