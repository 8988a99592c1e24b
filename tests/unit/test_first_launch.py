"""A `--load` without a checkpoint: the first launch of a `--save DIR --load DIR` line starts from
scratch with one NOTICE (as Megatron-DeepSpeed); anything else in the directory is named."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ds.config import CheckpointConfig, Config, ModelConfig
from megatron_ds.training.checkpoint import save_load
from megatron_ds.training.checkpoint.directory import CheckpointError
from megatron_ds.training.checkpoint.first_launch import check_without_checkpoint, first_launch_notice

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=128,
    seq_length=16,
    max_position_embeddings=16,
    vocab_size=128,
)


def config(**checkpoint: object) -> Config:
    return Config(model=MODEL, checkpoint=CheckpointConfig(**checkpoint))


def test_missing_empty_or_only_our_hidden_leftovers_is_a_first_launch(tmp_path: Path) -> None:
    new = tmp_path / "new"
    assert check_without_checkpoint(str(new), exit_on_missing=False) == first_launch_notice(str(new))
    new.mkdir()
    (new / ".incomplete.global_step2").mkdir()  # a save that crashed before the first checkpoint
    (new / ".write_probe_123").write_text("ok")
    # DeepSpeed's ZeRO save copies its recovery scripts into the directory before the checkpoint: a first save that
    # failed (a full disk) left them, and the relaunch of the same line was refused as holding foreign files
    (new / "zero_to_fp32.py").write_text("# DeepSpeed's")
    (new / "zero_to_torch.py").write_text("# DeepSpeed's")
    assert save_load.check_dirs(config(load=str(new), save=str(new))) == [first_launch_notice(str(new))]
    assert first_launch_notice(str(new)) == (
        f"NOTICE: --load {new} holds no checkpoint yet: starting from scratch, as Megatron-DeepSpeed does "
        "(--exit-on-missing-checkpoint makes this an error)"
    )


def test_finetune_from_nothing_is_a_warning(tmp_path: Path) -> None:
    """finetune_llama.sh's --finetune --load of a missing directory trains from random weights (upstream carries on)."""
    assert save_load.check_dirs(config(load=str(tmp_path / "none"), finetune=True)) == [
        f"WARNING: --finetune --load {tmp_path / 'none'}: no checkpoint there, so nothing is fine-tuned: the weights "
        "start random, as Megatron-DeepSpeed carries on (--exit-on-missing-checkpoint makes this an error)"
    ]


def test_exit_on_missing_checkpoint_makes_it_an_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint yet and --exit-on-missing-checkpoint is given"):
        save_load.check_dirs(config(load=str(tmp_path), exit_on_missing_checkpoint=True))


def test_anything_else_is_named(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "run1").mkdir()
    (tmp_path / "run1" / "latest").write_text("global_step4")
    (tmp_path / "global_step6").mkdir()
    (tmp_path / "global_step6" / "megatron_ds.json").write_text("{}")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("6")
    with pytest.raises(CheckpointError) as err:
        check_without_checkpoint(str(tmp_path), exit_on_missing=False)
    message = str(err.value)
    assert message.startswith(f"--load {tmp_path}: no checkpoint (no 'latest' file) but it holds global_step6/ ")
    assert f"write 'global_step6' into {tmp_path / 'latest'}" in message
    assert "latest_checkpointed_iteration.txt (Megatron's checkpoint tracker" in message
    assert f"run1/ (it holds 'latest': --load {tmp_path / 'run1'}?)" in message and "\n" not in message
    for i in range(5):
        (tmp_path / f"z{i}").write_text("x")
    with pytest.raises(CheckpointError, match="and 5 more; give the directory that holds 'latest'"):
        check_without_checkpoint(str(tmp_path), exit_on_missing=False)


def test_a_hugging_face_directory_says_to_import_it(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_text("x")
    with pytest.raises(CheckpointError) as err:
        check_without_checkpoint(str(tmp_path), exit_on_missing=False)
    assert str(err.value) == (
        f"--load {tmp_path}: a Hugging Face model directory (config.json), not a checkpoint; import it first: "
        f"python tools/convert_checkpoint.py --from hf {tmp_path} OUT, then --load OUT with the flags it prints"
    )


def test_a_file_is_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="a file, not a directory"):
        check_without_checkpoint(str(tmp_path / "f"), exit_on_missing=False)


def test_a_dry_run_creates_nothing_but_checks_the_save_directory(tmp_path: Path) -> None:
    save = tmp_path / "a" / "b"
    assert save_load.check_dirs(config(save=str(save)), dry_run=True) == []
    assert not (tmp_path / "a").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="file is a file, not a directory; choose a directory"):
        save_load.check_dirs(config(save=str(tmp_path / "file" / "sub")), dry_run=True)
    save_load.check_dirs(config(save=str(save)))
    assert save.is_dir()  # a launch creates it


def test_one_checkpoints_own_directory_says_to_name_its_tag(tmp_path: Path) -> None:
    # --load DIR/global_step3 listed the files inside it
    step = tmp_path / "ckpt" / "global_step3"
    step.mkdir(parents=True)
    (step / "megatron_ds.json").write_text("{}")
    (step / "mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError) as err:
        check_without_checkpoint(str(step), exit_on_missing=False)
    assert str(err.value) == (
        f"--load {step}: the directory of one checkpoint, not of the checkpoints; give --load {tmp_path / 'ckpt'} "
        "--load-tag global_step3"
    )
