"""`--print-layout` is a true dry run on any machine: no GPU needed for any precision, memory predicted
for the GPUs the run will use (`--pp-device`), and every check a launch runs, creating nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import pretrain_gpt

SEVEN_B = [
    "--num-layers",
    "32",
    "--hidden-size",
    "4096",
    "--num-attention-heads",
    "32",
    "--seq-length",
    "4096",
    "--vocab-size",
    "32000",
    "--pipeline-model-parallel-size",
    "4",
    "--pp-partition-method",
    "memory",
    "--global-batch-size",
    "64",
]
TINY = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 128".split()
LAUNCH = "--lr 1e-3 --train-iters 2 --mock-data".split()


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    rc = pretrain_gpt.main([*argv, "--print-layout"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_fp16_previews_on_a_cpu_node_and_the_warning_says_a_launch_here_would_stop(
    capsys: pytest.CaptureFixture,
) -> None:
    rc, out, err = run(capsys, *SEVEN_B, "--fp16", *LAUNCH)
    assert rc == 0 and "transformer layers per stage:" in out
    assert err.splitlines() == [
        "WARNING: a launch on this machine would stop here: --fp16 needs a GPU (DeepSpeed's CPU accelerator has no "
        "fp16); use --bf16 or fp32 (--print-layout previews it anyway)"
    ]
    assert pretrain_gpt.main([*TINY, "--fp16", *LAUNCH]) == 2  # a launch still refuses it
    assert "error: --fp16 needs a GPU" in capsys.readouterr().err


def layout(out: str) -> str:
    return re.search(r"\(layout (\S+), method memory\)", out).group(1)


def test_memory_is_predicted_for_the_named_gpu(capsys: pytest.CaptureFixture) -> None:
    rc, here, _ = run(capsys, *SEVEN_B, "--bf16")
    assert rc == 0 and "memory predicted for CPU processes (this machine has no GPU); give --pp-device" in here
    rc, h100, err = run(capsys, *SEVEN_B, "--bf16", "--pp-device", "h100")
    assert rc == 0 and h100.splitlines()[-1] == "memory predicted for --pp-device h100: H100-80GB, 80.00 GiB each"
    largest = [ln for ln in h100.splitlines() if ln.startswith("largest:")]
    assert largest and "GiB" in largest[0] and float(largest[0].split()[3]) < 80  # fits an H100
    assert layout(h100) != layout(here)  # CPU processes hold attention scores that flash kernels do not
    assert "WARNING: to launch, this line also needs --lr; --train-iters" in err


def test_an_unknown_device_is_a_one_line_error(capsys: pytest.CaptureFixture) -> None:
    rc, _, err = run(capsys, *TINY, "--pp-device", "B200")
    assert rc == 2 and err.startswith("error: --pp-device B200 is not a GPU of estimate/devices.py; give cpu or one")
    rc, _, err = run(capsys, *TINY, "--pp-device", "A100")
    assert rc == 2 and "--pp-device A100 is ambiguous; give cpu or one of A100-40GB, A100-80GB" in err


def test_it_runs_the_launch_checks_and_creates_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "notes.txt").write_text("x")
    rc, _, err = run(capsys, *TINY, *LAUNCH, "--load", str(tmp_path / "old"))
    assert rc == 2 and "holds notes.txt" in err
    clash = tmp_path / "ds.json"
    clash.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4}))
    rc, _, err = run(capsys, *TINY, *LAUNCH, "--deepspeed_config", str(clash))
    assert rc == 2 and "sets train_micro_batch_size_per_gpu=4 but the flags give 1" in err
    clash.write_text(json.dumps({"data_efficiency": {"enabled": True}}))
    rc, _, err = run(capsys, *TINY, *LAUNCH, "--deepspeed_config", str(clash))
    assert rc == 2 and "data_efficiency is not supported" in err
    rc, _, err = run(capsys, *TINY, *LAUNCH, "--data-path", str(tmp_path / "nothing"), "--vocab-file", str(clash))
    assert rc == 2 and "error:" in err
    rc, _, err = run(capsys, *TINY, *LAUNCH, "--exit-signal-handler")
    assert rc == 2 and "--exit-signal-handler saves a checkpoint on SIGTERM and needs --save DIR" in err
    rc, out, err = run(capsys, *TINY, *LAUNCH, "--save", str(tmp_path / "new" / "ck"), "--load", str(tmp_path / "new"))
    assert rc == 0 and err == "" and not (tmp_path / "new").exists()
    assert out.startswith(f"NOTICE: --load {tmp_path / 'new'} holds no checkpoint yet: starting from scratch")


def test_optional_packages_are_checked(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from megatron_ds.training import logger

    monkeypatch.setattr(logger, "tensorboard_available", lambda: False)
    rc, _, err = run(capsys, *TINY, *LAUNCH, "--tensorboard-dir", "tb")
    assert rc == 2 and "--tensorboard-dir tb: tensorboard is not installed" in err
    from megatron_ds.training import scalar_writers

    monkeypatch.setattr(scalar_writers, "wandb_available", lambda: False)
    rc, _, err = run(capsys, *TINY, *LAUNCH, "--wandb-project", "gpt")
    assert rc == 2 and "--wandb-project gpt: wandb is not installed; pip install wandb" in err
