"""megatron-core's index caches as we drive them: atomic writes, a torn file rebuilt or named in one line, and
no warning for a blend index built in memory."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import pytest

from megatron_ds.config import DataConfig
from megatron_ds.data.gpt_data import build_gpt_datasets
from megatron_ds.data.index_cache import DamagedIndexCache, cache_io, rebuilt_if_damaged
from megatron_ds.data.indexed import write_indexed_dataset
from megatron_ds.data.tokenizer import NullTokenizer

VOCAB = 100


def _corpus(prefix: Path, seed: int) -> str:
    rng = np.random.default_rng(seed)
    write_indexed_dataset(str(prefix), [list(rng.integers(0, VOCAB, rng.integers(4, 30))) for _ in range(60)], VOCAB)
    return str(prefix)


def _samples(data: DataConfig) -> list[list[int]]:
    train, _, _ = build_gpt_datasets(data, 16, 3, (40, 0, 0), NullTokenizer(VOCAB), VOCAB)
    return [train[i]["tokens"].tolist() for i in range(len(train))]


def test_a_torn_cache_file_is_rebuilt_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A shuffle index cut to half (a rank 0 killed inside megatron-core's numpy.save) counted as a cache hit, and
    every later run failed with `ValueError: mmap length is greater than file size`."""
    cache = tmp_path / "cache"
    data = DataConfig(data_path=(_corpus(tmp_path / "a", 1),), split="98,2,0", data_cache_path=str(cache))
    first = _samples(data)
    (shuffle,) = cache.glob("*-train-shuffle_index.npy")
    whole = shuffle.read_bytes()
    shuffle.write_bytes(whole[: len(whole) // 2])
    capsys.readouterr()
    assert _samples(data) == first
    notices = [ln for ln in capsys.readouterr().out.splitlines() if "index cache" in ln]
    assert notices == [
        f"NOTICE: index cache {shuffle} was unreadable (mmap length is greater than file size): deleted, rebuilding"
    ]
    assert shuffle.read_bytes() == whole


def test_a_torn_cache_file_elsewhere_is_one_line_naming_it(tmp_path: Path) -> None:
    """Where the indices are only read (not rank 0), the file is named with the fix, not deleted."""
    torn = tmp_path / "x-GPTDataset-train-sample_index.npy"
    np.save(torn, np.arange(1000))
    torn.write_bytes(torn.read_bytes()[:200])
    from megatron.core.datasets import gpt_dataset

    def read() -> object:
        return gpt_dataset.numpy.load(str(torn), allow_pickle=True, mmap_mode="r")

    with cache_io(), pytest.raises(DamagedIndexCache) as err:
        rebuilt_if_damaged(read, builds_caches=False)
    assert str(err.value) == (
        f"index cache {torn} is unreadable (mmap length is greater than file size), e.g. cut short by a process "
        "killed while writing it; delete it and start again: the indices are rebuilt"
    )
    assert torn.exists()
    torn.write_bytes(b"")
    with cache_io(), pytest.raises(DamagedIndexCache, match=r"is unreadable \(No data left in file\)"):
        read()
    assert gpt_dataset.numpy is np  # megatron-core's module is left as it was


def test_a_cache_write_cut_short_leaves_no_cache_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A write stopped half-way (here after the magic bytes) leaves neither a short cache file under the final name
    nor a temporary file; the next build is a plain cache miss."""
    cache = tmp_path / "cache"
    data = DataConfig(data_path=(_corpus(tmp_path / "a", 2),), split="98,2,0", data_cache_path=str(cache))

    def killed(fp, array, *args, **kwargs) -> None:
        fp.write(b"\x93NUMPY")
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(np.lib.format, "write_array", killed)
        with pytest.raises(KeyboardInterrupt):
            _samples(data)
    assert not [p.name for p in cache.iterdir() if p.suffix != ".txt"]
    built = _samples(data)
    assert built == _samples(DataConfig(data_path=data.data_path, split="98,2,0", data_cache_path=str(tmp_path / "c2")))
    assert "unreadable" not in capsys.readouterr().out


def test_a_blend_says_nothing_about_its_unsaved_index(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """Without a process group the blend's (cheap) index is built in memory: megatron-core's warning 'Cannot save
    the BlendedDataset indexes because path_to_cache is None' (once per split, with --data-cache-path given) is
    dropped."""
    a, b = _corpus(tmp_path / "a", 3), _corpus(tmp_path / "b", 4)
    for cache in (str(tmp_path / "cache"), None):
        data = DataConfig(data_path=("0.7", a, "0.3", b), split="90,5,5", data_cache_path=cache)
        with contextlib.redirect_stdout(io.StringIO()):
            build_gpt_datasets(data, 16, 3, (40, 8, 8), NullTokenizer(VOCAB), VOCAB)
        assert "Cannot save" not in capfd.readouterr().err
