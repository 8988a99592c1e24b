"""The planner's inputs: what the user told us (flags or a saved profile), checked and resolved.

Precedence: command-line flags > `--profile FILE` > model preset defaults (`plan/profile.py` reads and writes
the profile).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatron_ds.config import DEDICATED_CHOICES, ModelConfig
from megatron_ds.config.parallel import DEFAULT_PIPELINE_SCHEDULE, INTERLEAVED, ParallelConfig, pipeline_engine_only
from megatron_ds.config.training import BOTH_RECOMPUTATIONS
from megatron_ds.errors import ConfigError
from megatron_ds.flags.schedule_flags import named_schedule
from megatron_ds.pipeline.methods import planned_methods
from megatron_ds.plan import distillation, experts, hardware
from megatron_ds.plan.hardware import PlanError

GIB = 1024**3
MAX_LAYERS = 512
"""The deepest model the planner prices: 4 x the deepest published GPT (Megatron's 1T, 128 layers). The layouts'
dynamic programmes grow with the square of the layers: 512 on 4096 GPUs take about 3 s (tests/unit/test_plan_time.py),
1024 about 7 s, 2048 about 30 s, 100000 would not finish."""


@dataclass
class PlanInputs:
    """Everything a user may answer; None means not given."""

    model: str | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    seq_length: int | None = None
    vocab_size: int | None = None
    ffn_hidden_size: int | None = None
    architecture: list | None = None
    """pretrain_gpt.py's architecture flags as given (`--swiglu`, `--num-key-value-heads 8`, ...), in order."""
    num_gpus: int | None = None
    gpus_per_node: int | None = None
    gpu: str | None = None
    gpu_memory_gb: float | None = None
    compute_capability: str | None = None
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    zero_stage: int | None = None
    tensor_model_parallel_size: int | None = None
    pipeline_model_parallel_size: int | None = None
    precision: str | None = None
    checkpoint_activations: bool | None = None
    recompute_activations: bool | None = None
    partition_activations: bool | None = None
    checkpoint_in_cpu: bool | None = None
    sequence_parallel: bool | None = None
    pp_schedule: str | None = None
    num_virtual_stages_per_pipeline_rank: int | None = None
    enable_zbh1_pipeline: bool | None = None
    moe_expert_parallel_size: int | None = None
    expert_model_parallel_size: int | None = None
    """Megatron-LM's spelling of `moe_expert_parallel_size`, which the command line copies it into."""
    create_moe_param_group: bool | None = None
    kd: bool | None = None
    mos: bool | None = None
    load_teacher: str | None = None
    num_layers_teacher: int | None = None
    hidden_size_teacher: int | None = None
    num_attention_heads_teacher: int | None = None
    num_experts_teacher: list | None = None
    layout: str | None = None
    memory_headroom: float | None = None
    cpu_memory_gb: float | None = None
    interconnect: str | None = None
    storage: str | None = None
    tensor_device: str | None = None
    reported_mb: str | None = None
    oom_stage: int | None = None
    kernel_profile: str | None = None
    handled: list = field(default_factory=list)

    def merged_over(self, base: PlanInputs) -> PlanInputs:
        """These values where given, else `base`'s (flags over a profile)."""
        vals = {
            f.name: getattr(self, f.name) if getattr(self, f.name) is not None else getattr(base, f.name)
            for f in dataclasses.fields(self)
            if f.name != "handled"
        }
        return PlanInputs(**vals, handled=list(base.handled))

    def answers(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None and k != "handled"}


QUESTIONS = {
    "model": "Which model? --model PRESET (" + ", ".join(hardware.PRESETS) + ") or --num-layers "
    "--hidden-size --num-attention-heads --seq-length --vocab-size",
    "num_gpus": "How many GPUs in total? (--num-gpus)",
    "gpu_memory": "Which GPU? --gpu NAME (e.g. A100-80GB), or --gpu-memory-gb with --compute-capability",
    "compute_capability": "Which GPU generation? --gpu NAME, or --compute-capability MAJOR.MINOR (e.g. 8.0)",
    "global_batch_size": "How many samples per optimizer step? (--global-batch-size)",
    "precision": "Which GPU generation (it decides bf16 or fp16)? --gpu NAME, --compute-capability MAJOR.MINOR "
    "(e.g. 8.0), or --precision",
}


@dataclass(frozen=True)
class Resolved:
    """Checked inputs with defaults applied; absent facts stay None."""

    raw: PlanInputs
    dims: dict | None
    num_gpus: int | None
    gpus_per_node: int | None
    gpus_per_node_assumed: bool
    gpu_name: str | None
    gpu_memory_bytes: float | None
    cc: tuple[int, int] | None
    global_batch_size: int | None
    lr: float | None
    headroom: float
    schedule: tuple[str | None, int | None] = (None, None)
    """The pipeline schedule and its chunks per rank the flags fix (`fixed_schedule`); None: the planner chooses."""
    expert_parallel_size: int = 1
    """A mixture-of-experts plan's expert-parallel size (the search sets each it tries, `plan/experts.py`)."""
    teachers: tuple = ()
    """Knowledge distillation (`--kd`, `--mos`): per tensor size the trainer accepts the teacher at, (t, its own
    fields) (`plan/distillation.py`); empty without a teacher."""
    run_features: Any = None
    """The training software the step is priced for (`estimate.run_features.RunFeatures`); None: what
    pretrain_gpt.py runs. benchmarks/planner_vs_published.py sets Megatron's."""

    def model(self, tensor_parallel_size: int = 1) -> ModelConfig:
        assert self.dims is not None
        return hardware.model_config(**self.dims, tensor_parallel_size=tensor_parallel_size)

    @property
    def distils(self) -> bool:
        """`--kd` or `--mos`: a teacher's forward and kd loss join every training micro-batch."""
        return bool(self.teachers)

    def teacher(self, tensor_parallel_size: int = 1) -> ModelConfig | None:
        """The teacher at this tensor size (the student's architecture with its own sizes); None without one."""
        fields = dict(self.teachers).get(tensor_parallel_size)
        if fields is None:
            return None
        return dataclasses.replace(self.model(tensor_parallel_size), **dict(fields))

    @property
    def moe_teacher(self) -> ModelConfig | None:
        """A mixture-of-experts teacher (T = 1 only): it shares out its experts over the student's expert-parallel
        groups, so a dense student has them too (`plan/distillation.py`); None without one."""
        teacher = self.teacher(1)
        return teacher if teacher is not None and teacher.is_moe else None

    @property
    def usable_bytes(self) -> float | None:
        return None if self.gpu_memory_bytes is None else self.gpu_memory_bytes * (1 - self.headroom)

    @property
    def non_nvidia_gpu(self) -> bool:
        """`--gpu` names a table row of another vendor (it has no compute capability; its peaks say what it runs)."""
        device = hardware.find_named(self.gpu_name) if self.gpu_name else ()
        return len(device) == 1 and device[0].vendor != "nvidia"

    @property
    def num_nodes(self) -> int | None:
        if self.num_gpus is None or self.gpus_per_node is None:
            return None
        return -(-self.num_gpus // self.gpus_per_node)

    def missing(self, needs: list[str]) -> list[str]:
        have = {
            "model": self.dims is not None,
            "num_gpus": self.num_gpus is not None,
            "gpu_memory": self.gpu_memory_bytes is not None,
            "compute_capability": self.cc is not None or self.non_nvidia_gpu,
            "global_batch_size": self.global_batch_size is not None,
            "precision": self.cc is not None or self.non_nvidia_gpu or self.raw.precision is not None,
        }
        if any(not have[n] and n in needs for n in ("compute_capability", "gpu_memory")):
            needs = [n for n in needs if n != "precision"]  # their questions ask for the GPU already
        return [self._question(n) for n in needs if not have[n]]

    def _question(self, need: str) -> str:
        if need == "gpu_memory" and self.gpu_name is not None:  # a table row without a memory figure
            return f"How much memory has one {self.gpu_name}? (--gpu-memory-gb; estimate/devices.py has no figure)"
        return QUESTIONS[need]

    def require(self, needs: list[str], what: str) -> None:
        questions = self.missing(needs)
        if questions:
            raise PlanError(
                f"{what} needs more inputs: {' | '.join(questions)} (answer with the flags, or "
                f"reuse a saved --profile FILE)"
            )


def _positive(name: str, value: Any) -> None:
    if value is not None and not value > 0:
        raise PlanError(f"--{name.replace('_', '-')} {value} must be > 0; give a positive value")


def resolve(raw: PlanInputs) -> Resolved:
    """Check the values and apply presets/defaults (raises PlanError naming the flag and fix)."""
    for name in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "vocab_size",
        "ffn_hidden_size",
        "num_gpus",
        "gpus_per_node",
        "gpu_memory_gb",
        "global_batch_size",
        "micro_batch_size",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "moe_expert_parallel_size",
        "cpu_memory_gb",
    ):
        _positive(name, getattr(raw, name))
    dims, preset = _dims(raw)
    layers = (dims or {}).get("num_layers") or 0
    if layers > MAX_LAYERS:
        raise PlanError(
            f"--num-layers {layers}: the planner prices models of at most {MAX_LAYERS} transformer "
            f"layers (4 x the deepest published GPT's 128) in seconds; give at most {MAX_LAYERS}"
        )
    gpu_name, mem_gb, cc = _gpu(raw)
    _check_choices(raw)
    gpn = raw.gpus_per_node or (min(raw.num_gpus, 8) if raw.num_gpus else None)
    if raw.num_gpus and gpn and raw.num_gpus % gpn:
        raise PlanError(
            f"--num-gpus {raw.num_gpus} is not a multiple of --gpus-per-node {gpn}; give whole nodes "
            f"(or set --gpus-per-node)"
        )
    headroom = 0.10 if raw.memory_headroom is None else raw.memory_headroom
    if not 0 <= headroom < 1:
        raise PlanError(f"--memory-headroom {headroom} must be in [0, 1); e.g. 0.1 keeps 10% free")
    if dims is not None:
        _check_experts(raw, dims)
    teachers = _teachers(raw, dims, gpn) if raw.kd or raw.mos else ()
    gbs = raw.global_batch_size or (preset.global_batch_size if preset else None)
    return Resolved(
        raw=raw,
        dims=dims,
        num_gpus=raw.num_gpus,
        gpus_per_node=gpn,
        gpus_per_node_assumed=raw.gpus_per_node is None and raw.num_gpus is not None,
        gpu_name=gpu_name,
        gpu_memory_bytes=None if mem_gb is None else mem_gb * GIB,
        cc=cc,
        global_batch_size=gbs,
        lr=preset.lr if preset else None,
        headroom=headroom,
        schedule=fixed_schedule(raw),
        expert_parallel_size=raw.moe_expert_parallel_size or 1,
        teachers=teachers,
    )


def _teachers(raw: PlanInputs, dims: dict | None, gpus_per_node: int | None) -> tuple:
    """(t, the teacher's fields) for every tensor size a distilling plan may use (`--tensor-model-parallel-size`, else
    1, 2, 4, ... within a node) where the trainer accepts the configuration and the teacher; a PlanError with the
    trainer's line where the flags fix what it refuses (or no size is left)."""
    if dims is None:
        return ()
    tp, pp = raw.tensor_model_parallel_size, raw.pipeline_model_parallel_size or 1
    model = hardware.model_config(**dims, tensor_parallel_size=tp or 1)
    world = raw.num_gpus if raw.num_gpus and raw.num_gpus % ((tp or 1) * pp) == 0 else None
    why = distillation.refusal(raw, model, tp or 1, pp, world, raw.zero_stage or 0, raw.moe_expert_parallel_size or 1)
    if why is not None:
        raise PlanError(why)
    sizes = [tp] if tp else [t for t in (1, 2, 4, 8, 16) if t <= (gpus_per_node or 1)]
    out, first_error = [], None
    for t in sizes:
        try:
            out.append((t, distillation.teacher_fields(raw, dims, t)))
        except (PlanError, ConfigError) as e:
            first_error = first_error or str(e)
    if not out:
        raise PlanError(first_error or "no tensor size fits the teacher")
    return tuple(out)


def _check_experts(raw: PlanInputs, dims: dict) -> None:
    """A mixture-of-experts model with what the flags fix (pipeline and tensor size, ZeRO, expert-parallel size, the
    GPUs) is refused with pretrain_gpt.py's own message where it would refuse it (`plan/experts.py`)."""
    model = hardware.model_config(**dims, tensor_parallel_size=raw.tensor_model_parallel_size or 1)
    if not model.is_moe:
        return
    ep = raw.moe_expert_parallel_size or 1
    tp, pp = raw.tensor_model_parallel_size or 1, raw.pipeline_model_parallel_size or 1
    world = raw.num_gpus if raw.num_gpus and raw.num_gpus % (tp * pp) == 0 else None
    schedule = fixed_schedule(raw)[0] or DEFAULT_PIPELINE_SCHEDULE  # at P > 1 with experts: 1F1B only
    why = experts.refusal(
        model, tp, pp, world, raw.zero_stage or 0, ep, None, bool(raw.checkpoint_activations), schedule
    )
    if why is not None:
        raise PlanError(why)


def fixed_schedule(raw: PlanInputs) -> tuple[str | None, int | None]:
    """(schedule, chunks per rank) that `--pp-schedule`, `--enable-zbh1-pipeline` and
    `--num-virtual-stages-per-pipeline-rank` fix, each None where the planner chooses; refused as
    pretrain_gpt.py refuses them (`config.parallel.ParallelConfig`'s checks)."""
    v = raw.num_virtual_stages_per_pipeline_rank
    try:  # pretrain_gpt.py's own rules for the three flags together
        name, _ = named_schedule(raw.pp_schedule, raw.enable_zbh1_pipeline, v or 1)
    except ConfigError as e:
        raise PlanError(str(e)) from None
    if name is None and v is None:
        return None, None
    pp = raw.pipeline_model_parallel_size
    try:
        ParallelConfig(
            pipeline_model_parallel_size=pp or 2,
            pipeline_schedule=name or DEFAULT_PIPELINE_SCHEDULE,
            virtual_stages=v if v is not None else (2 if name == INTERLEAVED else 1),
        )
    except ConfigError as e:
        raise PlanError(str(e)) from None
    if name not in (None, DEFAULT_PIPELINE_SCHEDULE) and raw.zero_stage in (2, 3):
        raise PlanError(pipeline_engine_only(name))
    return name, (v if name == INTERLEAVED else 1) if name else v


def _dims(raw: PlanInputs) -> tuple[dict | None, hardware.Preset | None]:
    preset = hardware.find_preset(raw.model) if raw.model else None
    dims = {
        "num_layers": raw.num_layers or (preset.num_layers if preset else None),
        "hidden_size": raw.hidden_size or (preset.hidden_size if preset else None),
        "num_attention_heads": raw.num_attention_heads or (preset.num_attention_heads if preset else None),
        "seq_length": raw.seq_length or (preset.seq_length if preset else None),
        "vocab_size": raw.vocab_size or (preset.vocab_size if preset else None),
        "ffn_hidden_size": raw.ffn_hidden_size or (preset.ffn_hidden_size if preset else None),
    }
    required = [k for k in dims if k != "ffn_hidden_size"]
    given = [k for k in required if dims[k] is not None]
    if not given:
        return None, preset
    if len(given) < len(required):
        flags = ", ".join("--" + k.replace("_", "-") for k in required if dims[k] is None)
        raise PlanError(f"model size is incomplete: also give {flags} (or --model PRESET)")
    dims["architecture"] = (*(preset.architecture if preset else ()), *(raw.architecture or ()))
    try:
        model = hardware.model_config(**dims)  # pretrain_gpt.py's flag rules, checks and vocabulary padding
    except ConfigError as e:
        raise PlanError(str(e)) from None
    dims["ffn_hidden_size"] = model.ffn_hidden_size
    return dims, preset


def _gpu(raw: PlanInputs) -> tuple[str | None, float | None, tuple[int, int] | None]:
    cc = hardware.parse_compute_capability(raw.compute_capability) if raw.compute_capability else None
    if raw.gpu:
        try:
            gpu = hardware.find_gpu(raw.gpu)
        except PlanError:
            if raw.gpu_memory_gb is None:
                raise
            return raw.gpu, raw.gpu_memory_gb, cc  # a GPU not in the table, described by the user
        return gpu.name, raw.gpu_memory_gb or gpu.memory_gb, cc or gpu.compute_capability
    return None, raw.gpu_memory_gb, cc


CHOICES = {
    "precision": ("fp32", "bf16", "fp16"),
    # `none` is the default partition; then the dedicated modes and the registry's planned methods.
    "layout": (*DEDICATED_CHOICES, *planned_methods()),
    "interconnect": ("infiniband", "ethernet", "nvlink"),
    "storage": ("nvme", "sata-ssd", "network", "none"),
    "tensor_device": ("cuda", "cpu"),
}


def _check_choices(raw: PlanInputs) -> None:
    for name, choices in CHOICES.items():
        value = getattr(raw, name)
        if value is not None and value not in choices:
            raise PlanError(f"--{name.replace('_', '-')} {value!r} is not one of {', '.join(choices)}")
    if raw.zero_stage is not None and raw.zero_stage not in (0, 1, 2, 3):
        raise PlanError(f"--zero-stage {raw.zero_stage} is not one of 0, 1, 2, 3")
    if raw.checkpoint_activations and raw.recompute_activations:  # as pretrain_gpt.py refuses them
        raise PlanError(BOTH_RECOMPUTATIONS)
    if raw.partition_activations and raw.sequence_parallel is not False:  # as pretrain_gpt.py refuses the pair
        raise PlanError(
            "--partition-activations: the planner plans sequence parallelism at t > 1, whose checkpoints are split "
            "already and cannot be partitioned; add --no-sequence-parallel"
        )
    pp = raw.pipeline_model_parallel_size
    if raw.zero_stage in (2, 3) and pp is not None and pp > 1:
        raise PlanError(
            f"--zero-stage {raw.zero_stage} with --pipeline-model-parallel-size {pp}: DeepSpeed's "
            f"pipeline engine supports ZeRO 0 and 1 only; use --zero-stage 1 or "
            f"--pipeline-model-parallel-size 1"
        )
