"""ZeRO 2/3 and offload before any process starts: the flags, the config's rules, the generated JSON, a user
file that contradicts the flags, the NVMe path, the ops offload needs and its host memory (issue 22)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ds.errors import ConfigError
from megatron_ds.flags.parser import parse_config
from megatron_ds.model import naming, shapes
from megatron_ds.testing.scenario import tiny_config
from megatron_ds.training import deepspeed_config as dsc
from megatron_ds.training import zero_checks

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
BASE += ["--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2"]
BASE += ["--lr", "1e-3"]


def parse(*argv: str, world_size: int = 2):
    return parse_config([*BASE, *argv], world_size=world_size)[0]


def test_zero_two_and_three_parse_at_pipeline_size_one_and_pick_the_plain_engine() -> None:
    for stage in (2, 3):
        config = parse("--zero-stage", str(stage), "--no-pipeline-parallel")
        assert config.training.zero_stage == stage and config.engine_kind == "plain"
    assert parse("--zero-stage", "1").engine_kind == "pipeline"  # ZeRO 0/1 keep the pipeline engine, also at P=1
    t = parse("--zero-stage", "2", "--cpu-optimizer").training
    assert t.cpu_optimizer and t.optimizer_offload == "cpu"  # --cpu-optimizer alone offloads to the host
    t = parse(
        "--zero-stage", "3", "--cpu-optimizer", "--offload-optimizer", "nvme", "--offload-nvme-path", "/x"
    ).training
    assert t.optimizer_offload == "nvme"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--zero-stage", "3", "--pipeline-model-parallel-size", "2"], "--zero-stage 3 with --pipeline-model-parallel"),
        (["--zero-stage", "2", "--offload-param", "cpu"], "--offload-param cpu needs --zero-stage 3"),
        (["--cpu-optimizer"], "--cpu-optimizer needs ZeRO"),
        (["--offload-optimizer", "cpu"], "--offload-optimizer cpu needs ZeRO"),
        (["--zero-stage", "1", "--cpu-optimizer", "--optimizer", "sgd"], "--cpu-optimizer runs DeepSpeed's CPU Adam"),
        (["--zero-stage", "3", "--offload-param", "nvme"], "--offload-param nvme needs --offload-nvme-path"),
        (["--zero-stage", "2", "--offload-optimizer", "nvme", "--offload-nvme-path", "/x"], "needs --zero-stage 3"),
    ],
)
def test_bad_zero_flags_are_one_line_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(*argv)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_generated_json_for_zero_two_and_three_with_offload() -> None:
    z2 = dsc.generate(tiny_config(training__zero_stage=2, training__cpu_optimizer=True))
    zero = z2["zero_optimization"]
    assert zero["stage"] == 2 and zero["overlap_comm"] and zero["contiguous_gradients"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] < 5e8  # not DeepSpeed's 5e8 default
    assert "zero_force_ds_cpu_optimizer" not in z2  # CPU Adam is the optimizer DeepSpeed wants there
    z3 = dsc.generate(
        tiny_config(training__zero_stage=3, training__offload_param="nvme", training__offload_nvme_path="/nvme")
    )
    zero = z3["zero_optimization"]
    assert zero["offload_param"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/nvme"}
    assert zero["memory_efficient_linear"] is False and "allgather_bucket_size" not in zero
    torch_offload = dsc.generate(tiny_config(training__zero_stage=2, training__offload_optimizer="cpu"))
    assert torch_offload["zero_force_ds_cpu_optimizer"] is False  # a torch optimizer under offload


def test_deepspeed_accepts_the_zero_two_and_three_json() -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    for overrides in ({"training__zero_stage": 2, "training__cpu_optimizer": True}, {"training__zero_stage": 3}):
        ds = dsc.generate(tiny_config(**overrides))
        parsed = DeepSpeedConfig(ds)
        assert parsed.zero_optimization_stage == ds["zero_optimization"]["stage"]


def test_a_user_file_offloading_what_the_flags_do_not_is_refused(tmp_path: Path) -> None:
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    config = tiny_config(training__zero_stage=2, training__deepspeed_config=str(user))
    with pytest.raises(zero_checks.ZeroConfigError) as err:
        dsc.build(config)
    assert "offload_optimizer.device='cpu' but the flags give 'none'; give --offload-optimizer cpu" in str(err.value)
    merged = dsc.build(config.replace(training__cpu_optimizer=True))  # Megatron-DeepSpeed's pairing: agreed
    assert merged["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_nvme_offload_needs_a_directory_and_the_async_io_op(tmp_path: Path) -> None:
    missing = tiny_config(
        training__zero_stage=3, training__offload_param="nvme", training__offload_nvme_path=str(tmp_path / "no")
    )
    dsc.build(missing)  # the directory is the launch machine's fact, checked before launch:
    with pytest.raises(zero_checks.ZeroConfigError, match="not a directory"):
        zero_checks.check_offload_runs_here(missing)
    present = missing.replace(training__offload_nvme_path=str(tmp_path))
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().create_op_builder("AsyncIOBuilder").is_compatible(verbose=False):
        zero_checks.check_offload_runs_here(present)  # the directory and the op are fine
    else:
        with pytest.raises(zero_checks.ZeroConfigError) as err:
            zero_checks.check_offload_runs_here(present)
        assert str(err.value) == (  # names the flag to drop (it said "drop the flag")
            "NVMe offload (--offload-param nvme) swaps through DeepSpeed's async_io op (it needs libaio: apt install "
            "libaio-dev), which cannot be built on this machine; install what it needs or drop --offload-param nvme "
            "(offload to cpu instead)"
        )


def test_offload_beyond_the_host_memory_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    config = tiny_config(training__zero_stage=2, training__cpu_optimizer=True)
    need = zero_checks.predicted_host_bytes(config)
    specs = shapes.gpt_spec_params(config.model, 1)
    num_params = sum(
        sp.num_params
        for name, sp in zip(naming.gpt_spec_groups(config.model).names, specs)
        if name != naming.TIED_LM_HEAD
    )
    largest = max(sp.largest for sp in specs)
    # fp32 master, gradient and Adam's moments (16 B), the pinned fp32 copy of the partition (4 B) and the
    # accumulated gradients (4 B: 4 micro-batches per step), and the host staging buffer of the largest tensor
    assert config.grad_accumulation_steps > 1 and need == (16 + 4 + 4) * num_params + 4 * largest
    assert zero_checks.predicted_host_bytes(tiny_config(training__zero_stage=2)) == 0
    fake = type("VM", (), {"available": int(need) - 1})
    monkeypatch.setattr(psutil, "virtual_memory", lambda: fake)
    with pytest.raises(zero_checks.ZeroConfigError, match="offload needs .* of host memory on this node"):
        zero_checks.check_offload_runs_here(config)
    fake.available = int(need) + 1
    zero_checks.check_offload_runs_here(config)
