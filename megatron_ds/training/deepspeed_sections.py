"""Every top-level section of a user's DeepSpeed JSON, understood before any process starts.

`SECTIONS` is the one table: each section DeepSpeed (any release Megatron-DeepSpeed's scripts were
written for) or Megatron-DeepSpeed reads is

- GENERATED: written from the flags too; `deepspeed_config.merge` checks the file against them;
- IMPLEMENTED: read by our own code (`owner`), and taken out of what DeepSpeed sees;
- PASSED: handed to DeepSpeed as it is, because DeepSpeed does the same with it under our engine as
  under Megatron-DeepSpeed's (logging, monitors, communication dtypes), or because nothing reads it;
- IGNORED: left out, as DeepSpeed ignores it under Megatron-DeepSpeed's launch too (it is given the
  flags' optimizer and schedule): one NOTICE says so;
- REFUSED: a one-line error with the reason and the fix.

A section not in the table is refused too. A REFUSED section whose `enabled` is false changes nothing
and is dropped, so no DeepSpeed release sees a key it may reject (0.19.8 rejects the legacy
`curriculum_learning`, older releases skip it in the pipeline engine). Pure: no torch.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from typing import Any

from megatron_ds.errors import UserError

GENERATED, IMPLEMENTED, PASSED, IGNORED, REFUSED = "generated", "implemented", "passed", "ignored", "refused"


class DeepSpeedSectionError(UserError):
    """A section of the user's DeepSpeed JSON that this launch cannot honour."""


@dataclass(frozen=True)
class Section:
    """One top-level key of a DeepSpeed JSON."""

    name: str
    status: str
    why: str
    """What happens to it (or why it is refused)."""
    fix: str = "remove it from the file"
    """REFUSED: what to do instead."""
    owner: str | None = None
    """IMPLEMENTED: the module that reads it."""
    needs: str | None = None
    """PASSED: the package DeepSpeed imports when the section is enabled (checked before launch)."""
    keys: tuple[str, ...] | None = None
    """PASSED: the only sub-keys accepted (None: any); another is refused with `why`."""


_FLAGS = "written from the flags and checked against the file"
_LOGS = "DeepSpeed's own logging, the same under our engine"
_INERT = "read only by parts of DeepSpeed this launch does not use; passed as it is"
_REMOVED = "removed from DeepSpeed (0.19.8 rejects it) and not implemented here"
_MONITOR = "DeepSpeed's monitor writes the engine's loss and learning rate there, as under Megatron-DeepSpeed"

SECTIONS: tuple[Section, ...] = (
    Section("train_batch_size", GENERATED, f"--global-batch-size; {_FLAGS}"),
    Section("train_micro_batch_size_per_gpu", GENERATED, f"--micro-batch-size; {_FLAGS}"),
    Section("gradient_accumulation_steps", GENERATED, f"global / (micro x data-parallel size); {_FLAGS}"),
    Section("gradient_clipping", GENERATED, f"--clip-grad (the file's value when the flag is absent); {_FLAGS}"),
    Section("zero_optimization", GENERATED, f"stage: --zero-stage (the file's when the flag is absent); {_FLAGS}"),
    Section("fp16", GENERATED, "--fp16; with --fp16 this section rules loss scaling, the loss-scale flags are ignored"),
    Section("bf16", GENERATED, f"--bf16; {_FLAGS} (`bfloat16`, its older name, is read as bf16)"),
    Section("steps_per_print", GENERATED, "DeepSpeed's own progress lines; the file's value is used"),
    Section("wall_clock_breakdown", GENERATED, "DeepSpeed's timers; the file's value is used"),
    Section("zero_allow_untested_optimizer", GENERATED, "the optimizer is torch's; the file's value is used"),
    Section("zero_force_ds_cpu_optimizer", GENERATED, "false is needed with optimizer offload (torch's optimizer)"),
    Section(
        "activation_checkpointing",
        PASSED,
        "each option must agree with its flag (--partition-activations, --contigious-checkpointing, "
        "--checkpoint-in-cpu, --synchronize-each-layer, --profile-backward), which configure deepspeed.checkpointing "
        "as in Megatron-DeepSpeed; number_checkpoints is replaced by each rank's count (a NOTICE says so)",
    ),
    Section(
        "optimizer", IGNORED, "the optimizer is built from the flags (--optimizer, --lr, --adam-*, --weight-decay)"
    ),
    Section(
        "scheduler", IGNORED, "the learning-rate schedule is built from the flags (--lr-decay-style, --lr-warmup-*)"
    ),
    Section("prescale_gradients", PASSED, "DeepSpeed's data-parallel averaging order, the same under our engine"),
    Section(
        "gradient_predivide_factor", PASSED, "DeepSpeed's data-parallel averaging order, the same under our engine"
    ),
    Section("communication_data_type", PASSED, "DeepSpeed's gradient all-reduce dtype, the same under our engine"),
    Section("seq_parallel_communication_data_type", PASSED, f"Ulysses only: {_INERT}"),
    Section(
        "data_types",
        PASSED,
        "grad_accum_dtype only: DeepSpeed's gradient accumulation dtype (bf16: fp32 accumulates in BF16_Optimizer)",
        fix="keep only grad_accum_dtype",
        keys=("grad_accum_dtype",),
    ),
    Section("tensorboard", PASSED, _MONITOR, needs="tensorboard"),
    Section("wandb", PASSED, _MONITOR, needs="wandb"),
    Section("comet", PASSED, _MONITOR, needs="comet_ml"),
    Section("csv_monitor", PASSED, _MONITOR),
    Section("flops_profiler", PASSED, _LOGS),
    Section("comms_logger", PASSED, _LOGS),
    Section("timers", PASSED, _LOGS),
    Section("memory_breakdown", PASSED, _LOGS),
    Section("dump_state", PASSED, _LOGS),
    Section("log_level", PASSED, _LOGS),
    Section("disable_python_gc", PASSED, "DeepSpeed's garbage-collection switch; numerics unchanged"),
    Section("aio", PASSED, f"NVMe offload only: {_INERT}"),
    Section("dataloader_drop_last", PASSED, f"DeepSpeed's data loader only: {_INERT}"),
    Section("autotuning", PASSED, f"DeepSpeed's autotuning launcher only: {_INERT}"),
    Section(
        "use_data_before_expert_parallelism",
        PASSED,
        "mixture-of-experts only: DeepSpeed's engine reads it when it builds the expert-parallel groups (data-parallel "
        "ranks first or expert-parallel ranks first), as under Megatron-DeepSpeed; checkpoints record the order used",
    ),
    Section(
        "checkpoint",
        PASSED,
        "tag validation and parallel writes only",
        fix="keep tag_validation / parallel_write (--load converts to the universal form by itself)",
        keys=("tag_validation", "parallel_write"),
    ),
    Section(
        "curriculum_learning",
        IMPLEMENTED,
        "the legacy sequence-length curriculum, as Megatron-DeepSpeed runs it (batches cut to the scheduled "
        "length, the pipeline's shapes reset when it changes); DeepSpeed 0.19.8 itself rejects the key",
        owner="config/schedules.py (read at parse time), run by training/step_plan.py",
    ),
    Section(
        "data_efficiency",
        REFUSED,
        "DeepSpeed's data-efficiency library (curriculum data sampling, random-LTD) is not implemented",
        fix="remove the section (or set enabled false)",
    ),
    Section(
        "compression_training",
        REFUSED,
        "DeepSpeed compression (quantization, pruning, distillation) is not implemented (0.19.8 removed the library)",
    ),
    Section("pipeline", REFUSED, "the pipeline is configured from the flags (--pipeline-model-parallel-size, --pp-*)"),
    Section("tensor_parallel", REFUSED, "tensor parallelism is --tensor-model-parallel-size (megatron-core layers)"),
    Section(
        "expert_parallel",
        REFUSED,
        "DeepSpeed's AutoEP (its MoE layers swapped in by the engine) is not built; mixture-of-experts models come "
        "from --num-experts",
    ),
    Section("torch_autocast", REFUSED, "the precision is --bf16 / --fp16 (DeepSpeed's bf16/fp16 engines)"),
    Section("compile", REFUSED, "torch.compile is not set up for the pipeline engine"),
    Section("hybrid_engine", REFUSED, "DeepSpeed's RLHF hybrid engine is not used"),
    Section("weight_quantization", REFUSED, "weight quantization is not implemented"),
    Section("datastates_ckpt", REFUSED, "checkpoints are written synchronously and renamed atomically when complete"),
    Section("disable_allgather", REFUSED, "a legacy ZeRO switch the pipeline engine's ZeRO-1 does not read"),
    Section("gradient_allreduce_op", REFUSED, "gradients are averaged over data-parallel ranks, as Megatron does"),
    Section("managed_gradient_accumulation", REFUSED, "the pipeline engine accumulates micro-batches itself"),
    Section("sparse_gradients", REFUSED, _REMOVED),
    Section("sparse_attention", REFUSED, _REMOVED),
    Section("progressive_layer_drop", REFUSED, _REMOVED),
    Section("elasticity", REFUSED, _REMOVED, fix="give the batch sizes with --global-batch-size / --micro-batch-size"),
    Section("amp", REFUSED, _REMOVED, fix="use --bf16 or --fp16"),
    Section("quantize_training", REFUSED, _REMOVED),
    Section("eigenvalue", REFUSED, _REMOVED),
    Section("graph_harvesting", REFUSED, _REMOVED),
    Section("nebula", REFUSED, _REMOVED),
)
BY_NAME = {s.name: s for s in SECTIONS}
ALIASES = {"bfloat16": "bf16"}
"""Older names DeepSpeed still reads; the file's section is checked and passed under the new name."""


OBJECTS = frozenset(
    {
        *("zero_optimization", "fp16", "bf16", "activation_checkpointing", "data_types", "checkpoint", "aio"),
        *("tensorboard", "wandb", "comet", "csv_monitor", "flops_profiler", "comms_logger", "timers", "autotuning"),
        "curriculum_learning",
    }
)
"""Sections DeepSpeed (or our owner) reads as a JSON object: another value was a TypeError traceback at start-up."""


def check_shapes(user: dict[str, Any], label: str) -> None:
    """Every section in OBJECTS is a JSON object (`{...}`), before anything reads one."""
    for name, value in user.items():
        if ALIASES.get(name, name) in OBJECTS and not isinstance(value, dict):
            raise DeepSpeedSectionError(
                f"{label}: {name} is {json.dumps(value)}, not a JSON object; write it as {name}: {{...}} (see "
                "DeepSpeed's config documentation) or remove it"
            )


def classify(user: dict[str, Any], label: str) -> tuple[dict[str, Any], list[str]]:
    """What DeepSpeed is given of the user's file, and the notices to print; raises
    DeepSpeedSectionError for a refused section (`label` names the file, e.g. `--deepspeed_config ds.json`)."""
    user = _renamed(user, label)
    kept: dict[str, Any] = {}
    notices: list[str] = []
    for name, value in user.items():
        section = BY_NAME.get(name)
        if section is None:
            raise DeepSpeedSectionError(
                f"{label}: section {name!r} is not a DeepSpeed setting this launch knows (a typo, or one of a newer "
                f"release); remove it, see docs/compatibility.md for the sections understood"
            )
        if section.status == REFUSED:
            if not _disabled(value):
                raise DeepSpeedSectionError(f"{label}: {name} is not supported: {section.why}; {section.fix}")
            continue  # off: changes nothing, and no release sees a key it may reject
        if section.status == IMPLEMENTED:
            continue  # read by its owner (`implemented_section`)
        if section.status == IGNORED:  # left out: DeepSpeed would not use it either
            notices.append(
                f"NOTICE: {label}: its {name} section is ignored: {section.why}, and DeepSpeed ignores the JSON's "
                f"{name} when given them, as under Megatron-DeepSpeed"
            )
            continue
        if section.status == PASSED:
            _check_passed(section, value, label)
        kept[name] = value
    return kept, notices


def implemented_section(user: dict[str, Any], name: str) -> Any:
    """The value of an IMPLEMENTED section in the user's file (None when absent or disabled)."""
    assert BY_NAME[name].status == IMPLEMENTED, name
    value = _renamed(user, "").get(name)
    return None if value is None or _disabled(value) else value


def _renamed(user: dict[str, Any], label: str) -> dict[str, Any]:
    out = dict(user)
    for old, new in ALIASES.items():
        if old in out:
            if new in out:
                raise DeepSpeedSectionError(f"{label}: both {old} and {new} are given (the same section); keep {new}")
            out[new] = out.pop(old)
    return out


def _disabled(value: Any) -> bool:
    return isinstance(value, dict) and value.get("enabled") is False


def _check_passed(section: Section, value: Any, label: str) -> None:
    if section.keys is not None and isinstance(value, dict):
        extra = sorted(set(value) - set(section.keys))
        if extra:
            raise DeepSpeedSectionError(
                f"{label}: {section.name}.{extra[0]} is not supported: {section.why}; {section.fix}"
            )
    if section.needs and isinstance(value, dict) and value.get("enabled"):
        if importlib.util.find_spec(section.needs) is None:
            raise DeepSpeedSectionError(
                f"{label}: {section.name} is enabled but {section.needs} is not installed; pip install "
                f"{section.needs}, or set {section.name}.enabled false"
            )


def markdown_table() -> str:
    """docs/compatibility.md's table of DeepSpeed JSON sections."""
    lines = ["| section | here | what happens |", "|---|---|---|"]
    for s in SECTIONS:
        note = f"{s.why}; {s.fix}" if s.status == REFUSED else s.why
        lines.append(f"| `{s.name}` | {s.status} | {note.replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"
