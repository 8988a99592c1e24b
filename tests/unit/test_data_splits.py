"""Each upstream's split and blend rules, `--data-upstream`, empty splits, and content-keyed index caches."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import shutil
from pathlib import Path

import numpy as np
import pytest

from megatron_ds.config import DataConfig
from megatron_ds.data import DataError
from megatron_ds.data.gpt_data import build_gpt_datasets, plan_data
from megatron_ds.data.indexed import write_indexed_dataset
from megatron_ds.data.splits import absent_notice, absent_splits, blend_sizes, plan_parts, split_log, split_ranges
from megatron_ds.data.tokenizer import NullTokenizer
from megatron_ds.flags.parser import parse_config

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_deepspeed"
MDS, MLM = "megatron-deepspeed", "megatron-lm"


def test_megatron_deepspeed_moves_every_boundary_by_the_rounding_error() -> None:
    assert split_ranges(825, "98,2,0", MDS) == [(0, 809), (809, 825), None]
    assert split_ranges(825, "98,2,0", MLM) == [(0, 808), (808, 825), None]
    assert split_ranges(75, "98,2,0", MDS) == [(0, 73), (73, 75), None]
    assert split_ranges(25, "98,2,0", MDS) == [(0, 25), None, None]  # validation rounds to nothing
    assert split_ranges(75, "949,50,1", MDS)[:2] == split_ranges(75, "949,50,1", MLM)[:2] == [(0, 71), (71, 75)]
    assert split_ranges(500, "949,50,1", MDS)[0] == (0, 475) != split_ranges(500, "949,50,1", MLM)[0]
    with pytest.raises(DataError, match=r"--split 0,1,1: over 3 documents .* boundaries \[0, -1, 1, 3\] \(one below 0"):
        split_ranges(3, "0,1,1", MDS)  # 1.5 and 1.5 both round up to 2


def test_blend_sizes_per_upstream() -> None:
    from megatron.core.datasets.blended_megatron_dataset_builder import _get_size_per_split_per_dataset
    from megatron.core.datasets.utils import normalize

    for weights, n in (([0.7, 0.3], 160), ([1.0, 2.0, 3.0], 1000), ([0.3], 77)):
        per, total = blend_sizes(weights, n, MLM)
        norm = normalize(weights)
        assert per == [s[0] for s in _get_size_per_split_per_dataset(norm, [n], surplus=0.005)]
        assert total == sum(s[0] for s in _get_size_per_split_per_dataset(norm, [n]))
    # Megatron-DeepSpeed: ceil(n * w * 1.005) per corpus, the blend their sum
    assert blend_sizes([0.7, 0.3], 96, MDS) == ([68, 29], 97)
    assert blend_sizes([0.7, 0.3], 96, MLM) == ([69, 30], 97)  # ceil(ceil(n * w) * 1.005), sum(ceil(n * w))


def test_split_log_prints_both_upstreams() -> None:
    text = "\n".join(split_log("data/a", 825, "98,2,0", MDS))
    assert " > Megatron-DeepSpeed's split, used here (--data-upstream megatron-deepspeed):" in text
    assert "    train:\n     document indices in [0, 809) total of 809 documents" in text
    assert "     document indices in [825, 825) total of 0 documents" in text
    assert "megatron-core's split (Megatron-LM) would give other documents (--data-upstream megatron-lm)" in text
    assert "Let split_matrix = [(0, 0.98), (0.98, 1.0), None]" in text
    assert "documents: train [0, 808), validation [808, 825), test none" in text
    same = "\n".join(split_log("data/a", 75, "949,50,1", MLM))
    assert same.index("megatron-core's split (Megatron-LM), used here") < same.index("Megatron-DeepSpeed's split would")
    assert "would give the same documents" in same


def test_a_split_is_an_error_only_if_it_is_read() -> None:
    lengths = [np.full(75, 12, dtype=np.int32)]
    with pytest.raises(
        DataError,
        match=r"--split 949,50,1: corpus a has 75 documents, so its test split gets no documents "
        r"\(megatron-core's rounding\), but evaluation reads 4 test samples; .*--eval-iters 0 to skip it",
    ):
        plan_parts(["a"], lengths, None, "949,50,1", MLM, (40, 4, 4))
    train, valid, test = plan_parts(["a"], lengths, None, "949,50,1", MLM, (40, 0, 0))  # --eval-iters 0
    assert train is not None and train.ranges == ((0, 71),) and valid is None and test is None
    with pytest.raises(DataError, match=r"its validation split gets no documents .* but evaluation reads 4"):
        plan_parts(["a"], [np.full(10, 3, np.int32)], None, "98,2,0", MLM, (40, 4, 4))
    zeros = [np.zeros(75, dtype=np.int32)]
    with pytest.raises(DataError, match=r"its train split gets documents \[0, 74\) but no tokens .*add documents$"):
        plan_parts(["a"], zeros, None, "98,2,0", MLM, (40, 0, 0))
    parts = plan_parts(["a", "b"], lengths * 2, [0.7, 0.3], "98,2,0", MDS, (96, 4, 0))
    assert parts[0].sizes == (68, 29) and parts[0].blend_size == 97 and parts[1].sizes == (3, 2)


def test_an_empty_evaluation_split_is_absent_under_megatron_deepspeed_rules(capsys: pytest.CaptureFixture) -> None:
    """Megatron-DeepSpeed's default --split 969,30,1 gives a corpus under ~500 documents no test documents: it
    builds no test dataset and skips the test evaluation (training and validation run), so here too."""
    lengths = [np.full(75, 12, dtype=np.int32)]
    train, valid, test = plan_parts(["a"], lengths, None, "969,30,1", MDS, (40, 8, 4))
    assert train.ranges == ((0, 73),) and valid.ranges == ((73, 75),) and test is None
    assert absent_splits([75], "969,30,1", MDS, (40, 8, 4)) == [2]
    assert absent_splits([75], "969,30,1", MDS, (40, 8, 0)) == []  # not read: nothing to say
    assert absent_splits([75], "969,30,1", MLM, (40, 8, 4)) == []  # megatron-core would loop forever
    with pytest.raises(DataError, match=r"its test split gets no documents .* but evaluation reads 4 test"):
        plan_parts(["a"], lengths, None, "969,30,1", MLM, (40, 8, 4))
    _, valid, _ = plan_parts(["a"], [np.full(25, 3, np.int32)], None, "98,2,0", MDS, (40, 4, 4))
    assert valid is None
    # a blend: absent only when no corpus has the split (Megatron-DeepSpeed asserts on a blend lacking some)
    both = [np.full(75, 12, dtype=np.int32), np.full(60, 12, dtype=np.int32)]
    assert plan_parts(["a", "b"], both, [0.7, 0.3], "969,30,1", MDS, (40, 8, 4))[2] is None
    big = [np.full(75, 12, dtype=np.int32), np.full(1000, 12, dtype=np.int32)]
    with pytest.raises(DataError, match=r"corpus a has 75 documents, so its test split gets no documents"):
        plan_parts(["a", "b"], big, [0.7, 0.3], "969,30,1", MDS, (40, 8, 4))
    assert absent_notice(["d/a"], [75], "969,30,1", 2) == (
        "NOTICE: --split 969,30,1 gives the test split no documents of the 75 documents of d/a (Megatron-DeepSpeed's "
        "rounding): it is skipped as Megatron-DeepSpeed skips it, no test evaluation at the end; give test a larger "
        "share or add documents to evaluate it"
    )
    assert "no documents of any corpus (a: 75 documents, b: 60 documents)" in absent_notice(
        ["a", "b"], [75, 60], "969,30,1", 2
    )
    capsys.readouterr()


def test_the_build_skips_an_absent_split_with_one_notice(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    prefix = tmp_path / "d75"
    write_indexed_dataset(str(prefix), [[1, 2, 3, 4, 5, 6, 7]] * 75, 10)
    data = DataConfig(data_path=(str(prefix),), data_cache_path=str(tmp_path / "cache"))  # --split 969,30,1
    train, valid, test = build_gpt_datasets(data, 8, 1, (20, 8, 4), NullTokenizer(10), 10)
    assert len(train) >= 20 and len(valid) >= 8 and test is None
    notices = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("NOTICE: ")]
    assert notices == [
        f"NOTICE: --split 969,30,1 gives the test split no documents of the 75 documents of {prefix} "
        "(Megatron-DeepSpeed's rounding): it is skipped as Megatron-DeepSpeed skips it, no test "
        "evaluation at the end; give test a larger share or add documents to evaluate it"
    ]


def test_training_without_a_share_is_refused_before_launch(tmp_path: Path) -> None:
    """--split 0,100,0 with --train-iters > 0 reached DeepSpeed's first step with no data (a TypeError there)."""
    from megatron_ds.training.launch_checks import check_data

    prefix = tmp_path / "corpus"
    write_indexed_dataset(str(prefix), [[1, 2, 3, 4, 5, 6, 7]] * 75, 128)
    line = [*_line("--split", "0,100,0", "--tokenizer-type", "NullTokenizer", "--eval-iters", "0")]
    line[line.index("x")] = str(prefix)
    config, _ = parse_config(line, world_size=1)
    with pytest.raises(
        DataError,
        match=r"^--split 0,100,0 gives training no documents, but the run trains 2 iterations \(--train-iters 2\): "
        r"give train a share, e.g. --split 969,30,1$",
    ):
        check_data(config)
    with pytest.raises(DataError, match=r"^--split 0,100,0 gives training no documents, but training reads 8 samples"):
        plan_parts(["a"], [np.full(75, 12, dtype=np.int32)], None, "0,100,0", MDS, (8, 0, 0))
    assert plan_parts(["a"], [np.full(75, 12, dtype=np.int32)], None, "0,100,0", MDS, (0, 8, 0))[0] is None


def _line(*extra: str) -> list[str]:
    base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --lr 1e-4 --train-iters 2"
    return [*base.split(), "--vocab-size", "128", "--data-path", "x", *extra]


def test_data_upstream_from_the_command_line(capsys: pytest.CaptureFixture) -> None:
    assert parse_config(_line(), world_size=1)[0].data.data_upstream == MDS
    assert capsys.readouterr().err == ""
    assert parse_config(_line("--data-upstream", MLM), world_size=1)[0].data.data_upstream == MLM
    config, _ = parse_config(_line("--use-rotary-position-embeddings", "--rotary-base", "500000"), world_size=1)
    assert config.data.data_upstream == MLM
    assert "NOTICE: --rotary-base is a Megatron-LM flag, so the documents are split and blended by megatron-core's" in (
        capsys.readouterr().err
    )
    line = _line("--rotary-base", "500000", "--data-upstream", MDS)
    assert parse_config(line, world_size=1)[0].data.data_upstream == MDS
    with pytest.raises(Exception, match="--data-upstream"):
        parse_config(_line("--data-upstream", "megatron"), world_size=1)


def test_a_flag_both_upstreams_have_leaves_the_data_rules_to_megatron_deepspeed(capsys: pytest.CaptureFixture) -> None:
    """--profile-ranks is in Megatron-DeepSpeed's _add_profiler_args too: it says nothing about the line's upstream."""
    assert parse_config(_line("--profile-ranks", "0"), world_size=1)[0].data.data_upstream == MDS
    assert capsys.readouterr().err == ""


def test_docs_list_every_flag_that_makes_auto_pick_megatron_lm() -> None:
    import re

    from megatron_ds.flags.data_upstream import MEGATRON_LM_FLAGS

    doc = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `auto` (default) |"))
    assert re.findall(r"`(--[a-z0-9-]+)`", row) == list(MEGATRON_LM_FLAGS)
    assert f"(all {len(MEGATRON_LM_FLAGS)}: " in row


def _build(data: DataConfig) -> list[list[int]]:
    with contextlib.redirect_stdout(io.StringIO()):
        train, _, _ = build_gpt_datasets(data, 16, 5, (40, 0, 0), NullTokenizer(400), 400)
    return [train[i]["tokens"].tolist() for i in range(len(train))]


def test_index_cache_never_reuses_a_stale_index(tmp_path: Path) -> None:
    """megatron-core (and Megatron-DeepSpeed) key the caches on the path: here the content counts."""
    prefix, cache = tmp_path / "corpus_text_document", tmp_path / "cache"
    data = DataConfig(data_path=(str(prefix),), split="98,2,0", data_cache_path=str(cache))
    rng = np.random.default_rng(0)
    write_indexed_dataset(str(prefix), [list(rng.integers(0, 399, rng.integers(5, 30))) for _ in range(60)], 400)
    first = _build(data)
    write_indexed_dataset(str(prefix), [list(rng.integers(0, 399, rng.integers(5, 30))) for _ in range(60)], 400)
    regenerated = _build(data)
    assert regenerated != first and regenerated == _build(DataConfig(data_path=(str(prefix),), split="98,2,0"))
    # The same lengths read another way (Megatron-DeepSpeed's exact and --append-eod pairs of corpus A
    # have identical .idx lengths) are another index too.
    for ext in (".bin", ".idx"):
        shutil.copy(FIXTURE / f"mds_gpt2_a_text_document{ext}", f"{prefix}{ext}")
    exact = _build(data)
    for ext in (".bin", ".idx"):
        shutil.copy(FIXTURE / f"mds_gpt2_a_eod_text_document{ext}", f"{prefix}{ext}")
    with_eod = _build(data)
    assert with_eod != exact and with_eod == _build(DataConfig(data_path=(str(prefix),), split="98,2,0"))
    assert len(list(cache.glob("*GPTDataset-train-description.txt"))) == 4
    description = next(cache.glob("*description.txt")).read_text()
    assert "index " in description and "documents 0:" in description


def test_misaligned_flag_without_append_eod_files_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    prefix = tmp_path / "plain"
    write_indexed_dataset(str(prefix), [[1, 2, 3, 4, 5, 6, 7]] * 60, 400)
    _build(DataConfig(data_path=(str(prefix),), split="98,2,0", misaligned_append_eod=True))
    assert "WARNING: --misaligned-append-eod changes nothing" in capsys.readouterr().err


def test_launch_check_uses_the_same_plan(tmp_path: Path) -> None:
    prefix = tmp_path / "small"
    write_indexed_dataset(str(prefix), [[1, 2, 3]] * 10, 10)
    data = DataConfig(data_path=(str(prefix),), split="98,2,0")
    infos, parts = plan_data(data, (10, 0, 0))
    assert infos[0].num_documents == 10 and parts[0].ranges == ((0, 10),) and parts[1] is None
    assert plan_data(data, (10, 4, 0))[1][1] is None  # Megatron-DeepSpeed's rules: absent
    with pytest.raises(DataError, match="validation split gets no documents"):
        plan_data(dataclasses.replace(data, data_upstream=MLM), (10, 4, 0))
