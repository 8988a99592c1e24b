"""The DeepSpeed JSON, generated from the config tree (batch sizes live in one place).

Every section of a user file is first classified by `deepspeed_sections` (passed, ignored with a
notice, implemented by our code, or refused in one line); the fp16 section of a user file rules
loss scaling under `--fp16`, as in Megatron-DeepSpeed.

The one place that writes DeepSpeed config dicts: `pretrain_gpt.py` and `megatron_ds.build_pipeline`
(through `build`), the planner's `--write-config` and snippets (`generate` with optimizer offload,
`zero_snippet` for engines other than ours). A user `--deepspeed_config` file, and a `ds_config`
dict given to `build_pipeline`, are merged in: keys we do not generate are taken as they are; a key
we generate with a different value is an error naming both sources, never silently overridden in
either direction.
"""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple

from megatron_ds.config import Config
from megatron_ds.config.schedules import CURRICULUM_KEY, CurriculumConfig
from megatron_ds.errors import UserError
from megatron_ds.estimate.transients import zero_bucket_elements_for
from megatron_ds.files import read_json
from megatron_ds.model import shapes
from megatron_ds.training import deepspeed_sections
from megatron_ds.training.zero_checks import check_zero_json


class DeepSpeedConfigError(UserError):
    """The user's DeepSpeed JSON contradicts the flags, or cannot be read."""


OFFLOAD_DEVICES = ("none", "cpu", "nvme")
NVME_PATH_PLACEHOLDER = "/local_nvme"
"""Written as `nvme_path` for NVMe offload: a placeholder the user replaces with a local NVMe mount."""


def generate(
    config: Config, offload_optimizer: str | None = None, loss_scale_from_flags: bool = True
) -> dict[str, Any]:
    """DeepSpeed's config dict for this run (before merging a user file).

    The offload devices are the config's (`--offload-optimizer`, `--cpu-optimizer`, `--offload-param`);
    `offload_optimizer` ("none", "cpu" or "nvme") replaces the optimizer's (the planner recommends one). A torch
    optimizer under offload needs `zero_force_ds_cpu_optimizer` off (DeepSpeed's `engine._configure_optimizer`
    refuses a client optimizer with offload otherwise, and warns that it will be slow); `--cpu-optimizer`'s CPU
    Adam is the optimizer DeepSpeed wants there. `loss_scale_from_flags=False`: a user file's fp16 section
    rules loss scaling (`build`), so the flags' values are not written.
    """
    t, o, par = config.training, config.optimizer, config.parallel
    offload = t.optimizer_offload if offload_optimizer is None else offload_optimizer
    zero = zero_section(t.zero_stage, offload, t.offload_param, t.offload_nvme_path or NVME_PATH_PLACEHOLDER)
    if t.zero_stage >= 1:  # DeepSpeed's 5e8-element default is allocated whole (model_states.zero_bucket_elements)
        bucket = zero_bucket_elements_for(
            config.model, par.pipeline_model_parallel_size, par.data_parallel_size, par.tensor_model_parallel_size
        )
        zero.update(reduce_bucket_size=bucket)
        if t.zero_stage < 3:  # ZeRO-3 gathers parameters by its prefetch and live-parameter limits instead
            zero.update(allgather_bucket_size=bucket)
    if t.zero_stage == 3 and par.ds_sequence_parallel_size > 1:
        zero.update(_ulysses_zero3(config, zero["reduce_bucket_size"]))
    if t.zero_stage == 3:
        # DeepSpeed's default swaps torch's F.linear for its own autograd function for good (a memory saving
        # that rounds the bias add differently); megatron-core's and torch's linears are used as they are.
        zero["memory_efficient_linear"] = False
    ds: dict[str, Any] = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": config.grad_accumulation_steps,
        # Always written: DeepSpeed clips at 1.0 when the key is absent.
        "gradient_clipping": float(o.clip_grad),
        "steps_per_print": 2**31 - 1,  # the training loop prints Megatron-style lines itself
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,  # the optimizer is torch's AdamW/SGD
        "zero_optimization": zero,
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": t.precision == "fp16"},
    }
    if t.precision == "fp16":
        ds["fp16"].update({**FP16_DEFAULTS, **(fp16_from_flags(config) if loss_scale_from_flags else {})})
    if offload != "none" and not t.cpu_optimizer:
        ds["zero_force_ds_cpu_optimizer"] = False
    if par.sequence_parallel:
        # The pipeline engine cuts what it sends over the tensor ranks and gathers it again behind the
        # receiver (a saving for replicated activations); sequence-parallel activations are already
        # this rank's own part, so that would mix the ranks' parts (DeepSpeed #4196,
        # Megatron-DeepSpeed #227): send them whole.
        ds["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    return ds


def _ulysses_zero3(config: Config, bucket: int) -> dict[str, Any]:
    """ZeRO-3 under Ulysses: DeepSpeed 0.19.8's reduce-scatter of gradients (`stage3.__avg_scatter_grads`,
    `reduce_scatter_coalesced`) averages over the DP x N ranks of the sequence-data-parallel group, where the
    gradient is the sum over a sequence group averaged over DP: 1/N of it. Its all-reduce path
    (`__avg_scatter_contiguous_grads`) divides by DP x N / N; it runs with `reduce_scatter` off for every bucket
    that fits `reduce_bucket_size`, so the bucket is made to hold the largest parameter tensor."""
    largest = max(max(spec, default=0) for spec in shapes.gpt_spec_tensor_numels(config.model))
    return {"reduce_scatter": False, "reduce_bucket_size": max(bucket, largest + largest % 2)}


def zero_section(
    stage: int, offload_optimizer: str = "none", offload_param: str = "none", nvme_path: str = NVME_PATH_PLACEHOLDER
) -> dict[str, Any]:
    """The `zero_optimization` value for any stage and offload (stages 2 and 3 only outside a pipeline)."""
    assert offload_optimizer in OFFLOAD_DEVICES and offload_param in OFFLOAD_DEVICES, (offload_optimizer, offload_param)
    zero: dict[str, Any] = {"stage": stage}
    if stage >= 2:
        zero.update({"overlap_comm": True, "contiguous_gradients": True})
    for key, device in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if device != "none":
            zero[key] = {"device": device, "pin_memory": True}
            if device == "nvme":
                zero[key]["nvme_path"] = nvme_path
    return zero


def zero_snippet(stage: int, offload_optimizer: str = "none", offload_param: str = "none") -> dict[str, Any]:
    """A `{"zero_optimization": ...}` fragment for a plain (non-pipeline) DeepSpeedEngine: the planner
    shows it when ZeRO 2/3 would fit a model that pretrain_gpt.py's pipeline engine cannot run so."""
    return {"zero_optimization": zero_section(stage, offload_optimizer, offload_param)}


FP16_DEFAULTS = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}
"""DeepSpeed's fp16 section when no loss-scale flag is given (dynamic scaling from 2^16)."""


def fp16_from_flags(config: Config) -> dict[str, Any]:
    """The fp16 keys Megatron's loss-scale flags set (only those given)."""
    t = config.training
    keys: dict[str, Any] = {}
    if t.loss_scale is not None:
        keys["loss_scale"] = t.loss_scale  # static; 0 would mean dynamic
    if t.initial_loss_scale is not None:
        keys["initial_scale_power"] = int(round(math.log2(t.initial_loss_scale)))
    if t.min_loss_scale is not None:
        keys["min_loss_scale"] = t.min_loss_scale
    if t.loss_scale_window is not None:
        keys["loss_scale_window"] = t.loss_scale_window
    if t.hysteresis is not None:
        keys["hysteresis"] = t.hysteresis
    return keys


FP16_FLAG_NAMES = {
    "loss_scale": "--loss-scale",
    "initial_scale_power": "--initial-loss-scale",
    "min_loss_scale": "--min-loss-scale",
    "loss_scale_window": "--loss-scale-window",
    "hysteresis": "--hysteresis",
}


def user_overridable(config: Config, loss_scale_from_flags: bool = True) -> frozenset[str]:
    """Generated keys a user file may set: those no flag gives (fp16 defaults whose flag is absent;
    all of them when the file's fp16 section rules loss scaling)."""
    taken = fp16_from_flags(config) if loss_scale_from_flags else {}
    free_fp16 = {f"fp16.{k}" for k in FP16_DEFAULTS if k not in taken}
    return USER_OVERRIDABLE | free_fp16


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


# Generated keys that carry no flag's value: a user file may set them freely. (A bucket size set
# there is used by DeepSpeed but not seen by the memory model, which counts the generated one.)
USER_OVERRIDABLE = frozenset(
    {
        "steps_per_print",
        "wall_clock_breakdown",
        "zero_allow_untested_optimizer",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.allgather_bucket_size",
        "zero_optimization.memory_efficient_linear",
        "zero_optimization.offload_optimizer.pin_memory",
        "zero_optimization.offload_param.pin_memory",
    }
)


class UserSource(NamedTuple):
    """Where user DeepSpeed keys come from, as the error messages name it."""

    label: str  # "--deepspeed_config ds.json"
    ours: str  # what the generated values come from: "the flags give"
    fix: str  # how to resolve a contradiction on key {key}


def file_source(path: str) -> UserSource:
    return UserSource(
        f"--deepspeed_config {path}", "the flags give", "remove {key} from the file or change the matching flag"
    )


DICT_SOURCE = UserSource(
    "build_pipeline(ds_config=...)",
    "the config gives",
    "remove {key} from ds_config or change the matching config field",
)


def merge(
    generated: dict[str, Any],
    user: dict[str, Any],
    source: UserSource,
    overridable: frozenset[str] = USER_OVERRIDABLE,
) -> dict[str, Any]:
    """`generated` updated with `user`; a differing value for a flag-derived key is an error."""
    ours, theirs = _flatten(generated), _flatten(user)
    for key, value in theirs.items():
        if key in overridable:
            continue
        if key in ours and ours[key] != value and not _same_number(ours[key], value):
            raise DeepSpeedConfigError(
                f"{source.label} sets {key}={value!r} but {source.ours} {ours[key]!r}; {source.fix.format(key=key)}"
            )
    merged = json.loads(json.dumps(generated))
    _deep_update(merged, user)
    return merged


def _same_number(a: Any, b: Any) -> bool:
    numeric = (int, float)
    return isinstance(a, numeric) and isinstance(b, numeric) and not isinstance(a, bool) and float(a) == float(b)


def _deep_update(base: dict[str, Any], extra: dict[str, Any]) -> None:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _deep_update(base[k], v)
        else:
            base[k] = v


def load_user_config(path: str) -> dict[str, Any]:
    """Read a user DeepSpeed JSON; unreadable or invalid files are a one-line error."""
    data = read_json(path, "--deepspeed_config", DeepSpeedConfigError, ("give an existing JSON file", "fix the file"))
    if not isinstance(data, dict):
        raise DeepSpeedConfigError(f"--deepspeed_config {path}: expected a JSON object; fix the file")
    deepspeed_sections.check_shapes(data, f"--deepspeed_config {path}")
    return data


ACTIVATION_CHECKPOINTING_OPTIONS: dict[str, tuple[str, str]] = {
    "partition_activations": ("partition_activations", "--partition-activations"),
    "contiguous_memory_optimization": ("contiguous_checkpointing", "--contigious-checkpointing"),
    "cpu_checkpointing": ("checkpoint_in_cpu", "--checkpoint-in-cpu"),
    "synchronize_checkpoint_boundary": ("synchronize_each_layer", "--synchronize-each-layer"),
    "profile": ("profile_backward", "--profile-backward"),
}
"""A user JSON's activation_checkpointing key -> (the TrainingConfig field, the flag) that configures it."""


def _check_activation_checkpointing(ds: dict[str, Any], config: Config, source: UserSource) -> None:
    """Megatron-DeepSpeed passes every option to deepspeed.checkpointing.configure from its flags, which overrule
    the JSON's section (`training.activation_checkpointing` does the same): a key that says otherwise would be
    silently ignored, so it must agree with the flags."""
    section = ds.get("activation_checkpointing") or {}
    for key, (field, flag) in ACTIVATION_CHECKPOINTING_OPTIONS.items():
        if key not in section:
            continue
        ours = bool(getattr(config.training, field))
        if bool(section[key]) == ours:
            continue
        fix = (
            f"remove the key, set it to true, or drop {flag}"
            if ours
            else f"set it to false or remove it, or give {flag} (with --deepspeed-activation-checkpointing and "
            f"recomputation on, where it takes effect)"
        )
        raise DeepSpeedConfigError(
            f"{source.label} sets activation_checkpointing.{key} {json.dumps(section[key])} but {flag} makes it "
            f"{json.dumps(ours)}; {fix}"
        )


def _number_checkpoints_notice(keys: dict[str, Any], source: UserSource) -> list[str]:
    """number_checkpoints is replaced by each rank's own count, as Megatron-DeepSpeed replaces it by its."""
    section = keys.get("activation_checkpointing")
    if not isinstance(section, dict) or "number_checkpoints" not in section:
        return []
    return [
        f"NOTICE: {source.label} sets activation_checkpointing.number_checkpoints {section['number_checkpoints']}: "
        f"each rank is configured with the checkpoints it keeps at its fullest instead (Megatron-DeepSpeed too "
        f"replaces it, by --num-layers / --checkpoint-num-layers)"
    ]


def _check_curriculum(keys: dict[str, Any], config: Config, source: UserSource) -> None:
    """`curriculum_learning` is run by the training loop (`training/step_plan.py`, from
    `config.training.curriculum`), not by DeepSpeed, which rejects the legacy key (the section table
    withholds it): a file's section must be the curriculum the config holds."""
    section = deepspeed_sections.implemented_section(keys, CURRICULUM_KEY)
    if section is None:
        return
    if CurriculumConfig.from_json(section, source.label) != config.training.curriculum:
        raise DeepSpeedConfigError(
            f"{source.label} has a {CURRICULUM_KEY} section that config.training.curriculum does not hold; set "
            f"config.training.curriculum = CurriculumConfig.from_json(section, ...) (the loop runs it)"
        )


def build(config: Config, user: dict[str, Any] | None = None) -> dict[str, Any]:
    """The final DeepSpeed config: generated, merged with the user file (`--deepspeed_config`) and
    then the `user` dict (`build_pipeline(ds_config=...)`) if any, and checked."""
    return build_with_notices(config, user)[0]


def launch_notices(config: Config) -> list[str]:
    """The NOTICE lines the user file's sections call for (printed once, before launch)."""
    return build_with_notices(config)[1]


def build_with_notices(config: Config, user: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """`build`, and the NOTICE lines: sections DeepSpeed ignores, flags the file overrules."""
    path = config.training.deepspeed_config
    sources = [(file_source(path), load_user_config(path))] if path else []
    if user is not None:
        sources.append((DICT_SOURCE, user))
    notices: list[str] = []
    classified = []
    for source, keys in sources:
        kept, section_notices = deepspeed_sections.classify(keys, source.label)
        classified.append((source, kept))
        notices += section_notices + _number_checkpoints_notice(kept, source)
    fp16_owner = (
        next((src for src, kept in classified if "fp16" in kept), None) if config.training.precision == "fp16" else None
    )
    ds = generate(config, loss_scale_from_flags=fp16_owner is None)
    overridable = user_overridable(config, loss_scale_from_flags=fp16_owner is None)
    for source, kept in classified:
        ds = merge(ds, kept, source, overridable)
        _check_activation_checkpointing(ds, config, source)
    overruled = {k: v for k, v in fp16_from_flags(config).items() if fp16_owner and ds["fp16"].get(k) != v}
    if overruled:
        notices.append(_loss_scale_notice(overruled, fp16_owner, ds["fp16"]))
    if path and "gradient_clipping" not in dict(classified[0][1]):
        notices.append(
            f"NOTICE: --deepspeed_config {path} sets no gradient_clipping: clipping at --clip-grad "
            f"{config.optimizer.clip_grad:g} (written into the JSON, so the clip never depends on the installed "
            f"DeepSpeed's default for a missing key; Megatron-DeepSpeed would use that default)"
        )
    for source, keys in sources:
        _check_curriculum(keys, config, source)
    check_zero_json(config, ds)  # offload as the flags give it; a usable NVMe path
    return ds, notices


def _loss_scale_notice(overruled: dict[str, Any], source: UserSource, fp16: dict[str, Any]) -> str:
    """The flags whose loss-scale values the file's fp16 section overrules (those that differ)."""
    given = {k: 2**v if k == "initial_scale_power" else v for k, v in overruled.items()}  # the flag's own unit
    flags = ", ".join(f"{FP16_FLAG_NAMES[k]} {v:g}" for k, v in given.items())
    scale = fp16.get("loss_scale", 0)
    rule = (
        f"static loss scale {scale:g}"
        if scale
        else f"dynamic loss scaling from 2^{fp16.get('initial_scale_power', FP16_DEFAULTS['initial_scale_power'])}"
    )
    return (
        f"NOTICE: {source.label} has an fp16 section: it rules loss scaling ({rule}), as in Megatron-DeepSpeed, "
        f"whose optimizer never builds Megatron's scaler under DeepSpeed; {flags} ignored"
    )
