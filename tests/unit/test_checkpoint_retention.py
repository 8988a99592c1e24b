"""Megatron-LM's `--save-retain-interval` (`save_load._retire`) and Megatron-DeepSpeed's `--load-tag`
(`directory.load_tag`), on directories made here. Runs that use them: tests/e2e/test_pretrain_gpt.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megatron_ds.config import CheckpointConfig
from megatron_ds.errors import ConfigError
from megatron_ds.training.checkpoint import save_load
from megatron_ds.training.checkpoint.directory import META, CheckpointError, load_tag


def checkpoint(root: Path, tag: str, iteration: int) -> Path:
    path = root / tag
    path.mkdir(parents=True)
    (path / META).write_text(json.dumps({"config": {}, "train_state": {"iteration": iteration}}))
    return path


def test_the_previous_checkpoint_goes_unless_retained_a_link_or_not_ours(tmp_path: Path, capsys) -> None:
    save_load._retire(str(tmp_path), checkpoint(tmp_path, "global_step6", 6).name, 4)
    assert not (tmp_path / "global_step6").exists()
    assert "(iteration 6: not a multiple of --save-retain-interval 4)" in capsys.readouterr().out
    save_load._retire(str(tmp_path), checkpoint(tmp_path, "global_step8", 8).name, 4)
    assert (tmp_path / "global_step8").is_dir()  # a multiple of 4: retained
    target = checkpoint(tmp_path / "elsewhere", "global_step2", 2)
    os.symlink(target, tmp_path / "global_step2")
    save_load._retire(str(tmp_path), "global_step2", 4)
    assert (tmp_path / "global_step2").is_symlink() and target.is_dir()  # links are kept, as Megatron-LM
    (tmp_path / "global_step3").mkdir()
    save_load._retire(str(tmp_path), "global_step3", 4)
    assert (tmp_path / "global_step3").is_dir()  # no metadata: not a checkpoint of ours


def test_a_retired_checkpoint_takes_its_universal_form_along(tmp_path: Path, capsys) -> None:
    # the universal form a resume at another layout converted (larger than the checkpoint) was left behind forever
    checkpoint(tmp_path, "global_step3", 3)
    (tmp_path / "global_step3.universal" / "zero").mkdir(parents=True)
    save_load._retire(str(tmp_path), "global_step3", 4)
    assert not (tmp_path / "global_step3").exists() and not (tmp_path / "global_step3.universal").exists()
    assert f"and its universal form {tmp_path / 'global_step3.universal'} (iteration 3" in capsys.readouterr().out


def test_the_retain_interval_is_a_multiple_of_the_save_interval() -> None:
    assert CheckpointConfig(save="s", save_interval=2, save_retain_interval=4).save_retain_interval == 4
    with pytest.raises(ConfigError, match="--save-retain-interval 5 must be a multiple of --save-interval 2"):
        CheckpointConfig(save="s", save_interval=2, save_retain_interval=5)
    with pytest.raises(ConfigError, match="add --save-interval"):
        CheckpointConfig(save="s", save_retain_interval=4)


def test_load_tag_names_a_complete_checkpoint(tmp_path: Path) -> None:
    for step in (9, 10):
        checkpoint(tmp_path, f"global_step{step}", step)
    (tmp_path / "latest").write_text("global_step10")
    assert load_tag(str(tmp_path), None) == "global_step10"
    assert load_tag(str(tmp_path), "global_step9") == "global_step9"
    (tmp_path / "global_step11").mkdir()  # an interrupted save: no metadata
    with pytest.raises(CheckpointError) as err:
        load_tag(str(tmp_path), "global_step11")
    assert "(its last: global_step9, global_step10)" in str(err.value)  # in iteration order, not by name
    with pytest.raises(CheckpointError, match="it holds no complete checkpoint"):
        load_tag(str(tmp_path / "new"), "global_step1")


def test_a_stop_during_a_save_says_it_interrupted_the_save(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ctrl-C while checkpoint 338 was written said "stopped in iteration 339"
    import contextlib
    from types import SimpleNamespace

    from megatron_ds.training import loop, signals
    from megatron_ds.training.state import TrainState

    seen = []
    monkeypatch.setattr(save_load, "save", lambda *a: seen.append(signals.current().progress()) or "global_step338")
    run = SimpleNamespace(
        config=SimpleNamespace(checkpoint=CheckpointConfig(save="ck"), logging=SimpleNamespace(log_progress=False)),
        state=TrainState(iteration=338),
        watchdog=SimpleNamespace(watch=lambda what: contextlib.nullcontext()),
        engine=None,
        layout=None,
        rank=1,
    )
    signals.install()
    try:
        loop.save(run)
        assert seen == ["while saving the checkpoint of iteration 338 (left incomplete)"]
        assert signals.current().progress() == "in iteration 339"
    finally:
        signals.uninstall()


def test_latest_naming_a_damaged_checkpoint_of_ours_names_the_complete_ones(tmp_path: Path) -> None:
    # global_step6 lost its megatron_ds.json: it was called 'a DeepSpeed checkpoint that pretrain_gpt.py did not
    # write' with a conversion that then failed, and global_step3 beside it went unmentioned
    checkpoint(tmp_path, "global_step3", 3)
    damaged = tmp_path / "global_step6"
    damaged.mkdir()
    (damaged / "mp_rank_00_model_states.pt").write_bytes(b"")
    (tmp_path / "latest").write_text("global_step6")
    with pytest.raises(CheckpointError) as err:
        load_tag(str(tmp_path), None)
    assert str(err.value) == (
        f"--load {tmp_path}: 'latest' names 'global_step6', which is incomplete or missing; point 'latest' at a "
        "complete global_step directory, or resume from one of its last (global_step3) with --load-tag"
    )


def test_a_save_that_cannot_be_written_is_one_line_naming_the_kept_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a full disk during a save was torch's 'basic_ios::clear: iostream error' traceback
    import contextlib
    from types import SimpleNamespace

    from megatron_ds.training import loop
    from megatron_ds.training.state import TrainState

    checkpoint(tmp_path, "global_step4", 4)
    (tmp_path / "latest").write_text("global_step4")

    def full(*args: object) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 354112 vs 354004\nframe 0")

    monkeypatch.setattr(save_load, "save", full)
    run = SimpleNamespace(
        config=SimpleNamespace(checkpoint=CheckpointConfig(save=str(tmp_path))),
        state=TrainState(iteration=6),
        watchdog=SimpleNamespace(watch=lambda what: contextlib.nullcontext()),
        engine=None,
        layout=None,
    )
    with pytest.raises(CheckpointError) as err:
        loop.save(run)
    message = str(err.value)
    assert message.startswith(
        f"--save {tmp_path}: writing the checkpoint of iteration 6 failed ([enforce fail at inline_container.cc:672] "
        ". unexpected pos 354112 vs 354004; "
    )
    assert message.endswith(
        "the last checkpoint, global_step4, is kept: free space or fix the directory, then relaunch to resume from it"
    )
    assert "\n" not in message
