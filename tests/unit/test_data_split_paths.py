"""`--train-data-path`, `--valid-data-path`, `--test-data-path`: each split read whole from its own corpora, sized
and blended by the upstream's rules (`splits.plan_own_parts`). Sample equality with Megatron-DeepSpeed's and
megatron-core's own code: the `split_paths*` cases of tests/unit/test_megatron_deepspeed_data.py."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from megatron_ds.config import DataConfig
from megatron_ds.data import DataError
from megatron_ds.data.gpt_data import build_gpt_datasets, plan_data
from megatron_ds.data.splits import OwnData, plan_own_parts
from megatron_ds.data.tokenizer import build_tokenizer
from megatron_ds.errors import ConfigError
from megatron_ds.flags.dry_run import launch_gaps
from megatron_ds.flags.parser import build_parser, parse_config
from megatron_ds.testing.script_runs import run_python
from megatron_ds.training.preflight import _shared

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "megatron_deepspeed"
A, B = str(FIXTURE / "mds_gpt2_a_eod_text_document"), str(FIXTURE / "mds_gpt2_b_eod_text_document")
GPT2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(FIXTURE / "vocab.json")]
GPT2 += ["--merge-file", str(FIXTURE / "merges.txt")]
BASE = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
BASE += ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3", *GPT2]
MDS, MLM = "megatron-deepspeed", "megatron-lm"


def parse(*argv: str) -> DataConfig:
    return parse_config([*BASE, *argv], world_size=1)[0].data


def test_flags_set_the_fields_and_each_takes_at_least_one_value() -> None:
    data = parse("--train-data-path", "a", "--valid-data-path", "0.7", "b", "0.3", "c", "--test-data-path", "d")
    assert data.split_paths == (("a",), ("0.7", "b", "0.3", "c"), ("d",))
    assert data.has_split_paths and data.has_data and not data.data_path
    assert not parse("--data-path", "a").has_split_paths
    with pytest.raises(ConfigError, match=r"^argument --train-data-path: expected at least one argument; see"):
        build_parser().parse_args([*BASE, "--train-data-path"])


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--data-path", "a", "--valid-data-path", "b"],
            "--valid-data-path b beside --data-path a: both upstreams then read every split from --data-path and "
            "ignore --valid-data-path; give either --data-path (with --split) or a path per split",
        ),
        (["--mock-data", "--train-data-path", "a"], "--mock-data and --train-data-path were both given; keep one"),
        (
            ["--train-data-path", "a", "--split", "98,2,0", "--data-upstream", MLM],
            "--split 98,2,0 with --train-data-path a: megatron-core (Megatron-LM) refuses a split beside per-split "
            "paths (each split reads its whole data); drop --split",
        ),
    ],
)
def test_refusals_are_one_line(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(*argv)
    assert str(err.value) == message


def test_split_beside_them_is_ignored_under_megatron_deepspeed_rules() -> None:
    """Megatron-DeepSpeed prints "Split string will be ignored" and reads every document."""
    data = parse("--train-data-path", "a", "--split", "98,2,0")
    assert data.split == "98,2,0" and data.data_upstream == MDS
    assert parse("--train-data-path", "a", "--data-upstream", MLM).split == "969,30,1"  # the default is no --split


def test_they_are_local_paths_and_count_as_data_for_print_layout() -> None:
    shared = _shared(parse_config([*BASE, "--train-data-path", "a"], world_size=1)[0])
    assert not any("data_path" in key for key in shared)
    args = build_parser().parse_args([*BASE, "--train-data-path", "a"])
    assert not any("--data-path" in gap for gap in launch_gaps(args))


def _own(lengths: list[int], weights: tuple[float, ...] | None = None, first: int = 0) -> OwnData:
    return OwnData(
        tuple(f"c{first + i}" for i in range(len(lengths))),
        tuple(np.full(n, 5, np.int32) for n in lengths),
        weights,
        first,
    )


def test_a_single_prefix_reads_every_document_under_both_rules() -> None:
    for upstream in (MDS, MLM):
        train, valid, test = plan_own_parts([_own([75]), _own([39], first=1), None], upstream, (48, 8, 4))
        assert train.ranges == ((0, 75),) and train.sizes == (48,) and train.blend_size is None
        assert train.corpora == (0,) and train.weights is None
        assert valid.ranges == ((0, 39),) and valid.sizes == (8,) and valid.corpora == (1,)
        assert test is None  # no --test-data-path: no test evaluation


def test_one_weighted_prefix_is_blended_alone_only_by_megatron_deepspeed() -> None:
    """`--train-data-path 1.0 b`: Megatron-DeepSpeed's build_dataset blends it alone (ceil(48 * 1.005) = 49
    samples); megatron-core builds the single prefix as it is, the weight unused."""
    (mds, _, _) = plan_own_parts([_own([39], (1.0,)), None, None], MDS, (48, 8, 4))
    assert mds.sizes == (49,) and mds.blend_size == 49 and mds.weights == (1.0,)
    (mlm, _, _) = plan_own_parts([_own([39], (1.0,)), None, None], MLM, (48, 8, 4))
    assert mlm.sizes == (48,) and mlm.blend_size is None and mlm.weights is None


def test_a_weighted_blend_is_sized_by_each_upstreams_rule() -> None:
    """0.7/0.3 of 96 samples: Megatron-DeepSpeed asks ceil(96 * w * 1.005) of each, megatron-core
    ceil(ceil(96 * w) * 1.005); the blend is their sum there, sum(ceil(96 * w)) here."""
    own = [_own([75, 39], (0.7, 0.3)), _own([39], first=2), None]
    mds = plan_own_parts(own, MDS, (96, 4, 0))[0]
    assert mds.sizes == (68, 29) and mds.blend_size == 97 and mds.ranges == ((0, 75), (0, 39))
    assert mds.corpora == (0, 1) and mds.weights == (0.7, 0.3)
    mlm = plan_own_parts(own, MLM, (96, 4, 0))[0]
    assert mlm.sizes == (69, 30) and mlm.blend_size == 97
    by_size = plan_own_parts([_own([75, 39]), None, None], MLM, (96, 0, 0))[0]
    assert by_size.sizes == (None, None) and by_size.blend_size is None  # one epoch of each, weighted by size


def test_what_is_missing_or_empty_is_an_error_only_when_read() -> None:
    with pytest.raises(DataError, match=r"^no --train-data-path, but training reads 8 samples: give"):
        plan_own_parts([None, _own([39]), None], MDS, (8, 4, 0))
    assert plan_own_parts([None, _own([39]), None], MDS, (0, 4, 0))[0] is None  # --train-iters 0: evaluation only
    assert plan_own_parts([_own([39]), _own([39]), None], MDS, (8, 0, 0))[1] is None  # --eval-iters 0
    empty = OwnData(("e",), (np.zeros(3, np.int32),), None, 1)
    with pytest.raises(
        DataError, match=r"^--valid-data-path e: its 3 documents hold no tokens, but evaluation reads 4"
    ):
        plan_own_parts([_own([39]), empty, None], MLM, (8, 4, 0))


def test_missing_files_are_the_same_one_line_error_as_data_paths(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(DataError) as own:
        plan_data(DataConfig(train_data_path=(A,), valid_data_path=(missing,)), (8, 4, 0))
    with pytest.raises(DataError) as shared:
        plan_data(DataConfig(data_path=(missing,)), (8, 4, 0))
    assert str(own.value) == str(shared.value).replace("--data-path", "--valid-data-path")
    assert "--valid-data-path" in str(own.value)
    with pytest.raises(DataError, match=r"^--test-data-path 0.7 a 0.3: weight 0.3 has no prefix after it"):
        plan_data(DataConfig(train_data_path=(A,), test_data_path=("0.7", "a", "0.3")), (8, 4, 4))


def test_the_datasets_and_their_report(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data = DataConfig(
        train_data_path=("0.7", A, "0.3", B),
        valid_data_path=(B,),
        split="98,2,0",
        data_cache_path=str(tmp_path / "cache"),
    )
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=GPT2[3], merge_file=GPT2[5])
    train, valid, test = build_gpt_datasets(data, 32, 1234, (96, 4, 4), tok, 384)
    assert len(train) == 97 and test is None
    assert valid[0]["tokens"].shape == (32,) and len(valid) == 18  # one epoch of B (as upstream's recorded 18)
    out = capsys.readouterr().out
    assert f"> --train-data-path: {A}: all 75 documents [0, 75), {B}: all 39 documents [0, 39)" in out
    assert f"> --valid-data-path: {B}: all 39 documents [0, 39)" in out
    assert "NOTICE: --split 98,2,0 is not used: each split reads all the documents of its own path" in out
    assert "NOTICE: no --test-data-path: no test evaluation at the end, as upstream" in out


def test_pretrain_gpt_trains_and_validates_on_its_own_paths(tmp_path: Path) -> None:
    """One process, no launcher: two iterations on corpus A, validation on corpus B."""
    argv = [*BASE, "--max-position-embeddings", "16", "--global-batch-size", "2", "--eval-interval", "2"]
    argv += ["--eval-iters", "1", "--num-workers", "0", "--log-interval", "1", "--data-cache-path", str(tmp_path)]
    argv += ["--train-data-path", A, "--valid-data-path", B]
    out = run_python([str(ROOT / "pretrain_gpt.py"), *argv], timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert " iteration        2/       2 |" in out.stdout and " validation loss at iteration 2 |" in out.stdout
    assert f"> --valid-data-path: {B}: all 39 documents" in out.stdout


def test_skip_train_evaluates_on_a_validation_path_alone(tmp_path: Path) -> None:
    """--skip-train reads no training sample: --valid-data-path alone evaluates (at iteration 0, no --load), where a
    training run without --train-data-path is refused."""
    argv = [*BASE, "--max-position-embeddings", "16", "--global-batch-size", "2", "--eval-iters", "1"]
    argv += ["--num-workers", "0", "--data-cache-path", str(tmp_path), "--valid-data-path", B]
    run = [str(ROOT / "pretrain_gpt.py"), *argv]
    out = run_python([*run, "--skip-train"], timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "skipping training (--skip-train is on) ..." in out.stdout
    assert " validation loss at iteration 0 |" in out.stdout and not re.search(r"iteration\s+\d+/\s*\d+ \|", out.stdout)
    refused = run_python(run, timeout=120, cwd=ROOT)
    assert refused.returncode == 2 and "no --train-data-path, but training reads" in refused.stdout + refused.stderr


def test_a_refusal_stops_pretrain_gpt_with_one_line(tmp_path: Path) -> None:
    argv = [*BASE, "--data-path", A, "--train-data-path", A]
    out = run_python([str(ROOT / "pretrain_gpt.py"), *argv], timeout=120, cwd=ROOT)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "--train-data-path" in out.stderr.strip().splitlines()[-1]
