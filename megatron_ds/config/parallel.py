"""How the model is split over processes (`ParallelConfig`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from megatron_ds.config.checks import at_least, check, one_of, positive
from megatron_ds.errors import ConfigError

DEDICATED_CHOICES = ("none", "pre", "post", "both")
BACKENDS = ("nccl", "gloo")
PIPELINE_SCHEDULES = ("1f1b", "zbh1", "interleaved")
"""The registered pipeline schedules (`estimate.pipeline_schedules.REGISTRY`, which checks that the
two agree: the config layer sits below it)."""
DEFAULT_PIPELINE_SCHEDULE = PIPELINE_SCHEDULES[0]
"""DeepSpeed's own TrainSchedule, what every default in the code means."""
INTERLEAVED = PIPELINE_SCHEDULES[2]
"""The schedule that runs several model chunks (virtual stages) per rank."""


def pipeline_engine_only(schedule: str) -> str:
    """Why a pipeline schedule other than 1F1B cannot run with ZeRO-2/3 (the Config check's and the planner's words)."""
    return (
        f"--pp-schedule {schedule} runs on DeepSpeed's pipeline engine, which runs ZeRO 0 and 1 only; "
        f"use --zero-stage 1, or the {DEFAULT_PIPELINE_SCHEDULE} schedule"
    )


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over processes.

    The data-parallel size is derived, never stored: `world_size` / (P x T). Storing the world
    size (what the launcher starts) instead of the data-parallel size makes the two impossible to
    set inconsistently, and an impossible split (a world size that P x T does not divide) is an
    error when the config is built.
    """

    pipeline_model_parallel_size: int = 1
    """Pipeline stages P (`--pipeline-model-parallel-size`)."""
    tensor_model_parallel_size: int = 1
    """Tensor-parallel ranks T inside each stage (`--tensor-model-parallel-size`)."""
    world_size: int | None = None
    """All ranks of the run (the launcher's WORLD_SIZE, or `--world-size` for `--print-layout`); a
    multiple of P x T. None: P x T, one data-parallel replica."""
    pp_dedicated_embedding_stages: str = "none"
    """`none`, `pre`, `post` or `both`: stages reserved for the pre/post-processing groups."""
    pp_layout: str | None = None
    """Explicit layout string in Megatron-LM's grammar, e.g. `E|t*3|t*3|L`, or `auto` (`--pp-layout`)."""
    pp_partition_method: str | None = None
    """How stage boundaries are balanced (`--pp-partition-method`: `uniform`, `parameters`, `memory`,
    `fastest`, `profile`, `type:REGEX`, weighted types); None: `type:transformer`."""
    pipeline_schedule: str = DEFAULT_PIPELINE_SCHEDULE
    """The order each stage runs its forwards, backwards and sends (`--pp-schedule`,
    `--enable-zbh1-pipeline`; one of `PIPELINE_SCHEDULES`, defined in `estimate/pipeline_schedules.py`)."""
    virtual_stages: int = 1
    """Model chunks per rank v (megatron-core's virtual pipeline stages): flat stage c x P + r is chunk c
    of rank r. Above 1 only with the interleaved schedule (`--num-virtual-stages-per-pipeline-rank`, a
    layout string of v x P stages, `--num-layers-per-virtual-pipeline-stage`)."""
    pp_memory_limit: str | None = None
    """Bytes each device may hold, for `--pp-partition-method fastest` / `profile`
    (`--pp-memory-limit`): a number of bytes or one with a unit, `80GiB`, `500MB` (`memory_limit_bytes`).
    None: the GPU's memory; required on CPU."""
    pp_device: str | None = None
    """The GPU the layout and its memory prediction are for (`--pp-device`: a planner GPU name of
    `estimate/devices.py`, or `cpu`); its memory is the default `--pp-memory-limit`. None: this
    process's device. It does not change where the run executes."""
    pipeline_model_parallel_layout: str | None = None
    """Megatron-LM's `--pipeline-model-parallel-layout`: a layout string with megatron-core's meaning
    (the `--pp-layout` grammar, without our `auto`)."""
    decoder_first_pipeline_num_layers: int | None = None
    """Megatron-LM's `--decoder-first-pipeline-num-layers`: transformer layers on the first stage; the
    rest split evenly over the stages in between (see `megatron_ds.pipeline.megatron_lm`)."""
    decoder_last_pipeline_num_layers: int | None = None
    """Megatron-LM's `--decoder-last-pipeline-num-layers`: transformer layers on the last stage."""
    account_for_embedding_in_pipeline_split: bool = False
    """Megatron-LM's `--account-for-embedding-in-pipeline-split`: the embedding counts as one layer
    when the layers are split evenly over the stages."""
    account_for_loss_in_pipeline_split: bool = False
    """Megatron-LM's `--account-for-loss-in-pipeline-split`: the loss head counts as one layer."""
    distributed_backend: str | None = None
    """`nccl` or `gloo`; None picks nccl on GPU and gloo on CPU (`--distributed-backend`)."""
    distributed_timeout_minutes: float = 10.0
    """A collective stalled longer than this is an error on every rank, never a silent hang."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (`--sequence-parallel`, T > 1 only): the activations outside the
    tensor-parallel matmuls (norms, dropout, residuals, what passes between stages) are split along the
    sequence over the T ranks of a stage (`megatron_ds.model.sequence_parallel`)."""
    ds_sequence_parallel_size: int = 1
    """DeepSpeed-Ulysses sequence parallelism N (`--ds-sequence-parallel-size`): groups of N ranks carved
    out of data parallelism split each sequence N ways, attention exchanges heads for sequence with two
    all-to-alls (`megatron_ds.model.ulysses`); T = P = 1, as Megatron-DeepSpeed requires."""
    expert_parallel_size: int = 1
    """Mixture-of-experts expert parallelism E (`--moe-expert-parallel-size`): each group of E data-parallel ranks
    shares out every MoE layer's experts (E divides the data-parallel size and each layer's experts), tokens reach
    their expert through DeepSpeed's all-to-all; 1 for a dense model."""

    def __post_init__(self) -> None:
        p, t = self.pipeline_model_parallel_size, self.tensor_model_parallel_size
        check(
            p >= 1 and t >= 1,
            f"--pipeline-model-parallel-size {p} and --tensor-model-parallel-size {t} must be >= 1",
        )
        self._check_sequence_parallel()
        at_least("--moe-expert-parallel-size", self.expert_parallel_size, 1)
        if self.world_size is not None:
            at_least("world size", self.world_size, 1)
            n = self.ds_sequence_parallel_size
            check(
                self.world_size % (p * t * n) == 0,
                f"world size {self.world_size} is not divisible by --pipeline-model-parallel-size {p} x "
                f"--tensor-model-parallel-size {t}"
                + (f" x --ds-sequence-parallel-size {n}" if n > 1 else "")
                + f"; launch a multiple of {p * t * n} processes",
            )
        one_of("--pp-dedicated-embedding-stages", self.pp_dedicated_embedding_stages, DEDICATED_CHOICES)
        one_of("--pp-schedule", self.pipeline_schedule, PIPELINE_SCHEDULES)
        at_least("--num-virtual-stages-per-pipeline-rank", self.virtual_stages, 1)
        interleaved = self.pipeline_schedule == INTERLEAVED
        check(
            interleaved or self.virtual_stages == 1,
            f"{self.virtual_stages} virtual stages per rank run only on the interleaved schedule, not "
            f"--pp-schedule {self.pipeline_schedule}; use --pp-schedule interleaved or one stage per rank",
        )
        check(
            not interleaved or self.virtual_stages >= 2,
            "--pp-schedule interleaved needs 2 or more model chunks per rank: give "
            "--num-virtual-stages-per-pipeline-rank V, or a layout string of V x P stages",
        )
        check(
            not interleaved or p >= 2,
            f"the interleaved schedule ({self.virtual_stages} model chunks per rank: --num-virtual-stages-per-pipeline-rank"
            f" {self.virtual_stages} or --pp-schedule interleaved) needs --pipeline-model-parallel-size 2 or more (its "
            f"chunks pass between ranks); give it, or drop the virtual stages",
        )
        if self.distributed_backend is not None:
            one_of("--distributed-backend", self.distributed_backend, BACKENDS)
        positive("--distributed-timeout-minutes", self.distributed_timeout_minutes)
        if self.pp_memory_limit is not None:
            parse_memory_size(self.pp_memory_limit)
        check(
            not (self.pp_device is not None and self.pp_partition_method == "profile"),
            f"--pp-device {self.pp_device} and --pp-partition-method profile were both given: profile measures this "
            f"machine; drop --pp-device or choose another method",
        )

    def _check_sequence_parallel(self) -> None:
        p, t, n = self.pipeline_model_parallel_size, self.tensor_model_parallel_size, self.ds_sequence_parallel_size
        check(
            not self.sequence_parallel or t > 1,
            "sequence_parallel needs --tensor-model-parallel-size > 1 (at 1 Megatron-LM turns it off)",
        )
        at_least("--ds-sequence-parallel-size", n, 1)
        check(
            not (n > 1 and self.sequence_parallel),
            f"--ds-sequence-parallel-size {n} and --sequence-parallel were both given: DeepSpeed's and Megatron's "
            f"sequence parallelism do not combine (Megatron-DeepSpeed refuses them together); keep one",
        )
        check(
            n == 1 or (t == 1 and p == 1),
            f"--ds-sequence-parallel-size {n} needs --tensor-model-parallel-size 1 and --pipeline-model-parallel-size "
            f"1 (got {t} and {p}): as in Megatron-DeepSpeed, Ulysses runs on DeepSpeed's plain engine, whose "
            f"sequence-parallel group comes out of data parallelism; use T = P = 1 (--no-pipeline-parallel), or "
            f"--sequence-parallel with tensor parallelism",
        )

    @property
    def memory_limit_bytes(self) -> float | None:
        """`pp_memory_limit` in bytes (None when not given)."""
        return None if self.pp_memory_limit is None else parse_memory_size(self.pp_memory_limit)

    @property
    def num_flat_stages(self) -> int:
        """Pipeline stages of the layout: v x P (P without interleaving)."""
        return self.pipeline_model_parallel_size * self.virtual_stages

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one copy of the model: P x T."""
        return self.pipeline_model_parallel_size * self.tensor_model_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """Replicas of the model that read different samples: world size / (P x T x N), N the Ulysses
        degree (the N ranks of a sequence-parallel group read the same samples)."""
        if self.world_size is None:
            return 1
        return self.world_size // (self.model_parallel_size * self.ds_sequence_parallel_size)

    @property
    def layout_method(self) -> str:
        """A short description of how stage boundaries are chosen."""
        layout = self.pp_layout or self.pipeline_model_parallel_layout
        if layout is not None:
            return f"layout {layout!r}"
        if self.pp_dedicated_embedding_stages != "none":
            return f"dedicated {self.pp_dedicated_embedding_stages}"
        megatron_split = (
            self.decoder_first_pipeline_num_layers,
            self.decoder_last_pipeline_num_layers,
            self.account_for_embedding_in_pipeline_split or None,
            self.account_for_loss_in_pipeline_split or None,
        )
        if any(v is not None for v in megatron_split):
            return "Megatron-LM split"
        return self.pp_partition_method or "type:transformer"


SIZE_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}
SIZE_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_memory_size(value: object, flag: str = "--pp-memory-limit") -> float:
    """Bytes from `80GiB` (binary units), `80GB` (decimal), `1e9` or `1073741824`; ConfigError otherwise."""
    text = str(value).strip().lower().replace(" ", "")
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)([a-z]*)", text)
    size = float(match.group(1)) * SIZE_UNITS[match.group(2)] if match and match.group(2) in SIZE_UNITS else math.nan
    if not (math.isfinite(size) and size > 0):
        raise ConfigError(
            f"{flag} {value!r} is not a memory size; give bytes or a number with a unit (B, KB, MB, GB, KiB, MiB, "
            f"GiB, TiB), e.g. {flag} 80GiB"
        )
    return size
