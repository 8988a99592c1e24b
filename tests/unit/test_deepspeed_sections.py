"""Every section of a user's DeepSpeed JSON is understood before any process starts (implemented,
passed, ignored with a NOTICE, or refused in one line), and flags absent mean the JSON's value."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron_ds.errors import ConfigError, UserError
from megatron_ds.flags.parser import parse_config
from megatron_ds.training import deepspeed_config as dsc
from megatron_ds.training import deepspeed_sections as sections

ROOT = Path(__file__).resolve().parents[2]
FLAGS = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 128 --lr 1e-3 "
FLAGS += "--train-iters 2 --mock-data"
LABEL = "--deepspeed_config ds.json"


def with_json(tmp_path: Path, content: dict, *extra: str):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(content))
    return parse_config([*FLAGS.split(), "--deepspeed_config", str(path), *extra])[0], str(path)


def test_the_megatron_deepspeed_template_sections_are_understood() -> None:
    """The sections of the JSONs Megatron-DeepSpeed's GPT scripts write (examples_deepspeed/)."""
    template = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1,
        "zero_optimization": {"stage": 1},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "fp16": {"enabled": False, "loss_scale": 0, "initial_scale_power": 11},
        "bf16": {"enabled": True},
        "data_types": {"grad_accum_dtype": "fp32"},
        "wall_clock_breakdown": False,
    }
    kept, notices = sections.classify(template, LABEL)
    assert kept == template and notices == []


@pytest.mark.parametrize(
    "name,value,message",
    [
        ("data_efficiency", {"enabled": True}, "data_efficiency is not supported: DeepSpeed's data-efficiency"),
        ("compression_training", {"weight_quantization": {}}, "compression_training is not supported"),
        ("sparse_attention", {"mode": "fixed"}, "removed from DeepSpeed"),
        ("pipeline", {"pipe_partitioned": False}, "configured from the flags"),
        ("torch_autocast", {"enabled": True}, "the precision is --bf16 / --fp16"),
        ("data_types", {"grad_accum_dtype": "fp32", "param_dtype": "bf16"}, "data_types.param_dtype"),
        ("checkpoint", {"load_universal": True}, "checkpoint.load_universal is not supported"),
        ("zero_optimisation", {"stage": 1}, "'zero_optimisation' is not a DeepSpeed setting this launch knows"),
    ],
)
def test_refused_sections_are_one_line_naming_the_file(name: str, value: object, message: str) -> None:
    with pytest.raises(sections.DeepSpeedSectionError) as err:
        sections.classify({name: value}, LABEL)
    assert str(err.value).startswith(f"{LABEL}: ") and message in str(err.value) and "\n" not in str(err.value)


def test_a_refused_section_turned_off_is_dropped() -> None:
    """Off changes nothing, and leaving it out means no DeepSpeed release sees a key it may reject
    (0.19.8 rejects the legacy curriculum_learning at engine start)."""
    off = {"curriculum_learning": {"enabled": False}, "data_efficiency": {"enabled": False}, "steps_per_print": 1}
    assert sections.classify(off, LABEL) == ({"steps_per_print": 1}, [])
    with pytest.raises(sections.DeepSpeedSectionError):  # no `enabled: false`: not off
        sections.classify({"data_efficiency": {}}, LABEL)


def test_optimizer_and_scheduler_sections_are_ignored_with_a_notice() -> None:
    kept, notices = sections.classify({"optimizer": {"type": "Adam"}, "scheduler": {"type": "WarmupLR"}}, LABEL)
    assert kept == {} and len(notices) == 2
    assert notices[0].startswith(f"NOTICE: {LABEL}: its optimizer section is ignored: the optimizer is built from")


def test_monitors_need_their_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    assert sections.classify({"wandb": {"enabled": False}}, LABEL)[0] == {"wandb": {"enabled": False}}
    with pytest.raises(sections.DeepSpeedSectionError, match="wandb is enabled but wandb is not installed"):
        sections.classify({"wandb": {"enabled": True}}, LABEL)


def test_bfloat16_is_read_as_bf16(tmp_path: Path) -> None:
    assert sections.classify({"bfloat16": {"enabled": True}}, LABEL)[0] == {"bf16": {"enabled": True}}
    config, path = with_json(tmp_path, {"bfloat16": {"enabled": True}})
    with pytest.raises(dsc.DeepSpeedConfigError, match="sets bf16.enabled=True but the flags give False"):
        dsc.build(config)  # no longer slips past the contradiction check under its old name
    with pytest.raises(sections.DeepSpeedSectionError, match="both bfloat16 and bf16"):
        sections.classify({"bfloat16": {}, "bf16": {}}, LABEL)


def test_offload_is_checked_before_launch(tmp_path: Path) -> None:
    """The flags decide what is offloaded (they pick the optimizer and what the memory model counts): a
    file that offloads what they do not is refused, one that agrees keeps DeepSpeed's own checks away."""
    config, _ = with_json(tmp_path, {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}})
    with pytest.raises(UserError, match="offload_optimizer.device='cpu' but the flags give 'none'"):
        dsc.build(config)
    agreed = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
    config, _ = with_json(tmp_path, agreed, "--offload-optimizer", "cpu")
    assert dsc.build(config)["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    config, _ = with_json(tmp_path, {**agreed, "zero_force_ds_cpu_optimizer": True}, "--offload-optimizer", "cpu")
    with pytest.raises(dsc.DeepSpeedConfigError, match="sets zero_force_ds_cpu_optimizer=True but the flags give"):
        dsc.build(config)  # torch's optimizer under offload: DeepSpeed would refuse it at engine start


def test_zero_stage_absent_is_the_stage_the_json_names(tmp_path: Path) -> None:
    config, _ = with_json(tmp_path, {"zero_optimization": {"stage": 1}})
    assert config.training.zero_stage == 1 and dsc.build(config)["zero_optimization"]["stage"] == 1
    assert with_json(tmp_path, {"steps_per_print": 1})[0].training.zero_stage == 0
    config, _ = with_json(tmp_path, {"zero_optimization": {"stage": 1}}, "--zero-stage", "0")
    with pytest.raises(dsc.DeepSpeedConfigError, match="sets zero_optimization.stage=1 but the flags give 0"):
        dsc.build(config)
    assert with_json(tmp_path, {"zero_optimization": {"stage": 2}})[0].training.zero_stage == 2  # P=1: plain engine
    with pytest.raises(ConfigError, match="ZeRO"):  # but not on the pipeline engine
        with_json(
            tmp_path, {"zero_optimization": {"stage": 2}}, "--pipeline-model-parallel-size", "2", "--world-size", "2"
        )


def test_clip_grad_absent_is_the_jsons_and_a_json_without_one_takes_the_flags(tmp_path: Path) -> None:
    config, _ = with_json(tmp_path, {"gradient_clipping": 0.5})
    assert config.optimizer.clip_grad == 0.5 and dsc.launch_notices(config) == []
    config, path = with_json(tmp_path, {"steps_per_print": 1}, "--clip-grad", "2")
    assert dsc.build(config)["gradient_clipping"] == 2.0  # written: DeepSpeed's own default never applies
    assert dsc.launch_notices(config) == [
        f"NOTICE: --deepspeed_config {path} sets no gradient_clipping: clipping at --clip-grad 2 (written into the "
        "JSON, so the clip never depends on the installed DeepSpeed's default for a missing key; Megatron-DeepSpeed "
        "would use that default)"
    ]
    assert with_json(tmp_path, {"steps_per_print": 1})[0].optimizer.clip_grad == 1.0  # Megatron's default
    config, _ = with_json(tmp_path, {"gradient_clipping": 0.5}, "--clip-grad", "1.0")
    with pytest.raises(dsc.DeepSpeedConfigError, match="sets gradient_clipping=0.5 but the flags give 1.0"):
        dsc.build(config)


def test_the_docs_table_is_generated_from_the_sections() -> None:
    doc = (ROOT / "docs" / "compatibility.md").read_text()
    block = re.search(r"<!-- ds-sections:begin -->\n(.*?)<!-- ds-sections:end -->", doc, re.S)
    assert block, "docs/compatibility.md lacks the ds-sections markers"
    assert block.group(1) == sections.markdown_table(), (
        "docs/compatibility.md's DeepSpeed section table is stale: paste deepspeed_sections.markdown_table()"
    )


def test_an_implemented_section_is_kept_from_deepspeed_and_given_to_its_owner() -> None:
    """How a section our code implements travels: the legacy curriculum (config/schedules.py reads it)."""
    assert sections.BY_NAME["curriculum_learning"].status == sections.IMPLEMENTED
    user = {"curriculum_learning": {"enabled": True, "min_difficulty": 8}, "steps_per_print": 1}
    assert sections.classify(user, LABEL) == ({"steps_per_print": 1}, [])
    assert sections.implemented_section(user, "curriculum_learning") == {"enabled": True, "min_difficulty": 8}
    assert sections.implemented_section({"curriculum_learning": {"enabled": False}}, "curriculum_learning") is None
