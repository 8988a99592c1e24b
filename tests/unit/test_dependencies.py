"""DeepSpeed releases with the pipeline gradient-accumulation bug (issue #8152, 0.18.3-0.19.2) are
refused for the runs they would train wrongly, in one line, before any process group; setup.py's
tested bounds exclude them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from megatron_ds.errors import ConfigError
from megatron_ds.flags.parser import parse_config
from megatron_ds.training import dependencies

ROOT = Path(__file__).resolve().parents[2]
FLAGS = (
    "--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --vocab-size 64 --micro-batch-size 1 "
    "--global-batch-size 4 --train-iters 1 --lr 1e-3 --mock-data"
).split()


def _config(pipeline: int, global_batch: int = 4):
    argv = [*FLAGS, "--pipeline-model-parallel-size", str(pipeline), "--global-batch-size", str(global_batch)]
    return parse_config(argv, world_size=pipeline)[0]


@pytest.mark.parametrize("version", ["0.18.3", "0.18.9", "0.19.0", "0.19.2", "0.19.2+8e2c9d0"])
def test_broken_releases_are_refused_for_pipelines_that_accumulate(version: str) -> None:
    with pytest.raises(ConfigError) as err:
        dependencies.check_deepspeed(_config(pipeline=2), version)
    message = str(err.value)
    assert f"DeepSpeed {version} scales pipeline gradients wrongly" in message and "#8152" in message
    assert "2 stages and 4 micro-batches per step" in message and "pip install 'deepspeed>=0.19.8,<0.20'" in message
    assert "\n" not in message


@pytest.mark.parametrize("version", ["0.18.2", "0.19.3", "0.19.8", "0.20.0", "unknown"])
def test_other_releases_pass(version: str) -> None:
    dependencies.check_deepspeed(_config(pipeline=2), version)


@pytest.mark.parametrize(("pipeline", "global_batch"), [(1, 4), (2, 1)])
def test_runs_the_bug_cannot_reach_pass(pipeline: int, global_batch: int) -> None:
    # One stage, or one micro-batch per step: the scaling is right in the broken releases too.
    dependencies.check_deepspeed(_config(pipeline, global_batch), "0.19.2")


def test_the_installed_release_is_read_without_importing_deepspeed() -> None:
    assert dependencies.release(dependencies.deepspeed_version()) >= (0, 19, 8)


def test_both_entry_points_refuse_before_any_process_group(monkeypatch, capsys) -> None:
    import pretrain_gpt
    from megatron_ds.training.builder import build_pipeline

    monkeypatch.setattr(dependencies, "deepspeed_version", lambda: "0.19.1")
    with pytest.raises(ConfigError, match="DeepSpeed 0.19.1 scales"):
        build_pipeline(_config(pipeline=2))
    assert not torch.distributed.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert pretrain_gpt.main([*FLAGS, "--pipeline-model-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: DeepSpeed 0.19.1 scales") and err.count("\n") == 1
    assert not torch.distributed.is_initialized()


def test_setup_bounds_exclude_the_broken_releases_and_leave_torch_alone() -> None:
    setup = (ROOT / "setup.py").read_text()
    assert re.search(r'"deepspeed>=0\.19\.8,<0\.20"', setup)
    assert re.search(r'"megatron-core>=[0-9.]+,<[0-9.]+"', setup)
    assert '"torch>=2.3"' in setup  # the CPU pin is the Makefile's (README): no bound here pulls another torch
