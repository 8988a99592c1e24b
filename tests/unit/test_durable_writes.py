"""What a rename publishes is on the device first: every file of a checkpoint or conversion is fsynced before the
rename that makes it complete, and the directory after it (a power cut must not leave a complete-looking
checkpoint of empty or torn files, nor `latest` naming one)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_ds import files
from megatron_ds.config import CheckpointConfig
from megatron_ds.data.indexed import IndexedWriter
from megatron_ds.testing.scenario import tiny_config
from megatron_ds.training.checkpoint import save_load
from megatron_ds.training.state import TrainState


class Recorder:
    """The fsyncs and renames of a test, in order: ('fsync', path) and ('rename', source); `moves` maps each
    rename's destination to its source."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.moves: dict[str, str] = {}

    def flushed_before(self, paths: list[str], renamed: str) -> None:
        """Each of `paths` was fsynced before `renamed` was moved, under its own name or under the temporary name it
        was written as and renamed from."""
        moved = self.events.index(("rename", os.path.abspath(renamed)))
        flushed = {p for kind, p in self.events[:moved] if kind == "fsync"}
        missing = [p for p in paths if os.path.realpath(p) not in flushed and self.moves.get(p) not in flushed]
        assert not missing, f"not fsynced before {renamed} was renamed: {missing}"


@pytest.fixture
def record(monkeypatch) -> Recorder:
    seen = Recorder()
    fsync, rename, replace = os.fsync, os.rename, os.replace

    def record_fsync(fd: int) -> None:
        seen.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recorded(real):
        def move(src, dst, *args, **kwargs):
            seen.events.append(("rename", os.path.abspath(src)))
            seen.moves[os.path.abspath(dst)] = os.path.abspath(src)
            return real(src, dst, *args, **kwargs)

        return move

    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(os, "rename", recorded(rename))
    monkeypatch.setattr(os, "replace", recorded(replace))
    return seen


def _tree(root: Path) -> list[str]:
    return [str(p) for p in sorted(root.rglob("*"))] + [str(root)]


def test_a_conversion_directory_is_flushed_before_its_rename_and_its_parent_after(tmp_path, record) -> None:
    with files.atomic_directory(str(tmp_path / "out"), "--output") as tmp:
        (Path(tmp) / "sub").mkdir()
        (Path(tmp) / "sub" / "weights.bin").write_bytes(b"w" * 100)
        (Path(tmp) / "config.json").write_text("{}")
        written = _tree(Path(tmp))
    assert (tmp_path / "out" / "sub" / "weights.bin").read_bytes() == b"w" * 100
    record.flushed_before(written, tmp)
    assert record.events[-1] == ("fsync", str(tmp_path))  # the rename itself is on the device


@pytest.fixture
def single_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Engine:
    """DeepSpeed's engine as `save_load.save` uses it: `save_checkpoint` writes a tag directory; its `module` has no
    mixture-of-experts layers (a MoE model's save also records where its experts are)."""

    module = None

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool) -> None:
        (Path(save_dir) / tag).mkdir()
        (Path(save_dir) / tag / "mp_rank_00_model_states.pt").write_bytes(b"m" * 64)


class _Layout:
    def to_string(self) -> str:
        return "E|tttt|L"


def test_a_training_checkpoint_is_on_the_device_before_it_is_renamed_and_before_latest_names_it(
    tmp_path, record, single_rank_group
) -> None:
    save = tmp_path / "ckpt"
    save.mkdir()
    config = tiny_config(checkpoint=CheckpointConfig(save=str(save)))
    tag = save_load.save(_Engine(), config, _Layout(), TrainState(iteration=3), str(save))
    assert tag == "global_step3" and (save / "latest").read_text() == tag
    tmp = save / f".incomplete.{tag}"
    written = [str(tmp / p.name) for p in sorted((save / tag).iterdir())] + [str(tmp)]
    assert {Path(p).name for p in written} >= {"mp_rank_00_model_states.pt", "rng_rank0.pt", save_load.META}
    record.flushed_before(written, str(tmp))
    renamed = record.events.index(("rename", str(tmp)))
    latest = record.events.index(("rename", record.moves[str(save / "latest")]))
    assert ("fsync", str(save)) in record.events[
        renamed:latest
    ]  # the new tag is on the device before `latest` names it
    assert record.events[-1] == ("fsync", str(save))


def test_a_preprocessed_pair_is_flushed_before_its_renames(tmp_path, record) -> None:
    writer = IndexedWriter(str(tmp_path / "corpus"), vocab_size=100)
    writer.add([1, 2, 3])
    tmp = writer._tmp
    writer.close()
    record.flushed_before([f"{tmp}.bin", f"{tmp}.idx"], f"{tmp}.bin")
    assert record.events[-1] == ("fsync", str(tmp_path))


def test_a_file_system_that_cannot_flush_is_tolerated_and_a_failing_device_is_not(tmp_path, monkeypatch) -> None:
    import errno

    def refuse(code: int):
        def fsync(fd: int) -> None:
            raise OSError(code, os.strerror(code))

        return fsync

    monkeypatch.setattr(os, "fsync", refuse(errno.EINVAL))  # some network and FUSE file systems, for directories
    files.fsync_tree(str(tmp_path))
    monkeypatch.setattr(os, "fsync", refuse(errno.EIO))
    with pytest.raises(OSError) as err:
        files.fsync_directory(str(tmp_path))
    assert err.value.errno == errno.EIO and files.write_failure(err.value) == os.strerror(errno.EIO)
