"""Flag parsing and validation: good flags map onto the config tree, bad ones are one-line errors."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from megatron_ds.flags.parser import ConfigError, parse_config
from megatron_ds.pipeline.layout import LayoutError
from megatron_ds.testing.script_runs import run_python

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]
TRAIN = [
    "--vocab-size",
    "1000",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    "10",
    "--lr",
    "1e-3",
]


def parse(*extra: str, world_size: int | None = None):
    return parse_config([*MODEL, *TRAIN, *extra], world_size=world_size)[0]


def test_flags_map_onto_config() -> None:
    cfg = parse(
        "--pipeline-model-parallel-size",
        "5",
        "--pp-dedicated-embedding-stages",
        "--bf16",
        "--zero-stage",
        "1",
        "--clip-grad",
        "0.5",
        "--lr-warmup-fraction",
        "0.2",
        world_size=10,
    )
    assert cfg.model.ffn_hidden_size == 256 and cfg.model.max_position_embeddings == 32
    assert cfg.model.vocab_size == 1024  # padded to a multiple of 128
    assert cfg.parallel.pp_dedicated_embedding_stages == "both"  # the bare flag means both
    assert cfg.parallel.data_parallel_size == 2 and cfg.grad_accumulation_steps == 2
    assert cfg.training.precision == "bf16" and cfg.training.zero_stage == 1
    assert cfg.optimizer.clip_grad == 0.5 and cfg.optimizer.lr_warmup_fraction == 0.2


def test_dedicated_choices_and_padding_with_tensor_parallel() -> None:
    cfg = parse(
        "--pipeline-model-parallel-size",
        "2",
        "--pp-dedicated-embedding-stages",
        "pre",
        "--tensor-model-parallel-size",
        "2",
        world_size=4,
    )
    assert cfg.parallel.pp_dedicated_embedding_stages == "pre"
    assert cfg.model.vocab_size == 1024 and cfg.model.vocab_size % 256 == 0


def test_train_samples_become_iterations() -> None:
    cfg = parse_config(
        [*MODEL, "--vocab-size", "100", "--global-batch-size", "8", "--train-samples", "20", "--lr", "1e-3"],
        world_size=1,
    )[0]
    assert cfg.training.train_iters == 2 and cfg.training.train_samples == 20  # whole batches, as Megatron


def test_config_round_trips_through_dict() -> None:
    from megatron_ds.config import Config

    cfg = parse("--data-path", "0.3", "a", "0.7", "b")
    assert Config.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--pipeline-model-parallel-size", "2", "--pp-dedicated-embedding-stages"], ">= 3 (got 2)"),
        (["--pp-dedicated-embedding-stages", "pre"], ">= 2 (got 1)"),
        (["--pipeline-model-parallel-size", "6", "--pp-dedicated-embedding-stages", "both"], "leaves 4 stages"),
        (["--pipeline-model-parallel-size", "3", "--pp-layout", "E|tt|L"], "has 2 't' but --num-layers is 3"),
        (
            ["--pipeline-model-parallel-size", "3", "--pp-layout", "E|ttt|L", "--pp-partition-method", "uniform"],
            "were both given",
        ),
        (["--pipeline-model-parallel-size", "3", "--pp-partition-method", "type:x:0"], "must be > 0"),
    ],
)
def test_layout_errors_surface_at_parse_time(extra: list[str], message: str) -> None:
    with pytest.raises(LayoutError, match=message.replace("(", r"\(").replace(")", r"\)")):
        p = (
            int(extra[extra.index("--pipeline-model-parallel-size") + 1])
            if "--pipeline-model-parallel-size" in extra
            else 1
        )
        parse(*extra, world_size=p)


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            [*MODEL[:-2], "--seq-length", "32", "--num-attention-heads", "5", *TRAIN],
            "not divisible by --num-attention-heads",
        ),
        ([*MODEL, *TRAIN[:4], "--global-batch-size", "7", *TRAIN[6:]], "--global-batch-size 7 is not divisible"),
        ([*MODEL, *TRAIN, "--max-position-embeddings", "16"], "--seq-length 32 exceeds --max-position-embeddings 16"),
        (
            [*MODEL, *TRAIN, "--pipeline-model-parallel-size", "2", "--zero-stage", "2"],
            "pipeline engine runs ZeRO 0 and 1 only",
        ),
        ([*MODEL, *TRAIN, "--train-samples", "10"], "both given"),
        ([*MODEL, "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1"], "no vocabulary size"),
        ([*MODEL, "--vocab-size", "10", "--train-iters", "1"], "missing --lr"),
        ([*MODEL, "--vocab-size", "10", "--lr", "1"], "missing --train-iters"),
        (["--hidden-size", "8"], "missing required flag(s) --num-layers"),
        ([*MODEL, *TRAIN, "--pp-dedicated-embedding-stages", "middle"], "invalid choice: 'middle'"),
        ([*MODEL, *TRAIN, "--clip-grad", "-1"], "--clip-grad -1.0 must be >= 0"),
        ([*MODEL, *TRAIN, "--mock-data", "--data-path", "x"], "--mock-data and --data-path"),
    ],
)
def test_bad_flags(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(argv, world_size=2 if "--pipeline-model-parallel-size" in argv else 1)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            ["--standalone-embedding-stage"],
            "--standalone-embedding-stage needs --pipeline-model-parallel-size >= 2 (got 1)",
        ),
        (
            ["--standalone-embedding-stage", "--pp-dedicated-embedding-stages", "post"],
            "--standalone-embedding-stage with --pp-dedicated-embedding-stages post needs "
            "--pipeline-model-parallel-size >= 3 (got 1)",
        ),
        (
            ["--standalone-embedding-stage", "--pipeline-model-parallel-size", "5"],
            "--standalone-embedding-stage with --pipeline-model-parallel-size 5 leaves 4 stages for --num-layers 3",
        ),
        (
            ["--swiglu", "--hidden-size", "16", "--num-attention-heads", "4"],
            "--swiglu's default ffn width for --hidden-size 16 is 0 (int(8 x 16 / 3 / 64) x 64, as upstream); "
            "give --ffn-hidden-size",
        ),
        (["--ffn-hidden-size", "0"], "--ffn-hidden-size 0 must be >= 1"),  # given: named as given, not defaulted
    ],
)
def test_errors_name_the_flags_the_line_gave(extra: list[str], message: str) -> None:
    """--standalone-embedding-stage is folded into --pp-dedicated-embedding-stages and --swiglu picks the ffn width,
    but an error about either names what the user wrote."""
    with pytest.raises(ConfigError) as err:
        parse(*extra, world_size=5 if "5" in extra else None)
    assert str(err.value).startswith(message) and "--pp-dedicated-embedding-stages pre" not in str(err.value)


def test_world_size_must_divide() -> None:
    with pytest.raises(ConfigError, match="world size 5 is not divisible"):
        parse("--pipeline-model-parallel-size", "2", world_size=5)


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return run_python([str(ROOT / "pretrain_gpt.py"), *argv], timeout=120, cwd=ROOT)


def test_print_layout_seed_example_without_process_group() -> None:
    out = run_cli(*MODEL, "--pipeline-model-parallel-size", "5", "--pp-dedicated-embedding-stages", "--print-layout")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "stage=0 layers=3" and lines[4] == "stage=1 layers=1" and lines[5] == "     3: TransformerLayer"
    assert "stage=4 layers=3" in lines and "     6: FinalNorm" in lines
    assert lines[-1].startswith("transformer layers per stage: 0 1 1 1 0")
    assert "<lambda>" not in out.stdout


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--pipeline-model-parallel-size", "2", "--pp-dedicated-embedding-stages"], "--pp-dedicated-embedding-stages"),
        (["--pipeline-model-parallel-size", "3", "--pp-layout", "E|t(t|L"], "--pp-layout"),
        (["--pipeline-model-parallel-size", "1", "--pp-dedicated-embedding-stages", "both"], ">= 3 (got 1)"),
    ],
)
def test_cli_errors_are_one_line_without_traceback(argv: list[str], message: str) -> None:
    out = run_cli(*MODEL, *argv, "--print-layout")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: ") and message in out.stderr
