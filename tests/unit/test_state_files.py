"""DeepSpeed's ZeRO partition files read for a conversion: each file unpickled once, its fragments read from disk
equal to the memory-mapped file's, a fragment outside its partition refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_ds.training.checkpoint.universal import state_files
from megatron_ds.training.checkpoint.universal.state_files import StateFiles, load_file, narrow


def partition_file(tmp_path: Path, dtype: torch.dtype) -> tuple[str, torch.Tensor]:
    """A file shaped like a ZeRO-1 partition file whose second flat group is a view at an offset into a larger
    storage (torch saves the whole storage and the view's offset)."""
    whole = torch.randn(300, generator=torch.Generator().manual_seed(0)).to(dtype)
    state = {"optimizer_state_dict": {"single_partition_of_fp32_groups": [whole[:50].clone(), whole[100:250]]}}
    path = str(tmp_path / f"zero_pp_rank_0_mp_rank_00_optim_states_{dtype}.pt")
    torch.save(state, path)
    return path, whole[100:250]


def counting_loader() -> tuple[list[str], object]:
    calls: list[str] = []

    def load(path: str, map_location: str = "cpu") -> dict:
        calls.append(map_location)
        return load_file(path, map_location)

    return calls, load


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fragments_read_from_disk_equal_the_files_and_the_file_is_unpickled_once(tmp_path: Path, dtype) -> None:
    path, flat = partition_file(tmp_path, dtype)
    calls, load = counting_loader()
    files = StateFiles(load)
    for start, numel in ((0, 150), (7, 31), (149, 1), (40, 0)):
        saved = files.open(path)["optimizer_state_dict"]["single_partition_of_fp32_groups"][1]
        assert saved.is_meta
        got = narrow(saved, start, numel, path)
        assert got.dtype == dtype and not got.is_meta
        assert torch.equal(got, flat[start : start + numel])
    assert calls == ["meta"]


def test_a_fragment_outside_its_partition_is_refused(tmp_path: Path) -> None:
    path, _ = partition_file(tmp_path, torch.float32)
    saved = StateFiles(load_file).open(path)["optimizer_state_dict"]["single_partition_of_fp32_groups"][1]
    with pytest.raises(RuntimeError, match=r"elements 140\.\.160 are outside a flat partition of 150"):
        narrow(saved, 140, 20, path)


def test_a_file_of_another_byte_order_is_memory_mapped_as_before(tmp_path: Path, monkeypatch) -> None:
    path, flat = partition_file(tmp_path, torch.float32)
    monkeypatch.setattr(state_files, "_byte_order", lambda _: "big")
    calls, load = counting_loader()
    saved = StateFiles(load).open(path)["optimizer_state_dict"]["single_partition_of_fp32_groups"][1]
    assert not saved.is_meta and calls == ["cpu"]
    assert torch.equal(narrow(saved, 3, 40, path), flat[3:43])


def test_any_tensor_of_the_structure_reads_back_as_saved(tmp_path: Path) -> None:
    """A torch optimizer's per-parameter state (a non-flat checkpoint): a transposed view, a scalar step, a
    non-tensor kept as it is."""
    matrix = torch.randn(6, 9, generator=torch.Generator().manual_seed(1))
    state = {"optimizer": {"state": {0: {"exp_avg": matrix.t(), "step": torch.tensor(7.0)}, 1: {"step": 3}}}}
    path = str(tmp_path / "mp_rank_00_model_states.pt")
    torch.save(state, path)
    saved = StateFiles(load_file).open(path)["optimizer"]["state"]
    got = state_files.materialize(saved[0]["exp_avg"], path)
    assert saved[0]["exp_avg"].is_meta and got.shape == (9, 6) and torch.equal(got, matrix.t())
    assert state_files.materialize(saved[0]["step"], path).item() == 7.0
    assert state_files.materialize(saved[1]["step"], path) == 3
