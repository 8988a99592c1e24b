"""Bad layout-method input is one clear line before anything starts: an unknown partition method,
and the memory-balanced method with a stage count it cannot fill or without a vocabulary size."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]


def print_layout(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    import pretrain_gpt

    rc = pretrain_gpt.main([*MODEL, *argv, "--print-layout"])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--pipeline-model-parallel-size", "3", "--pp-partition-method", "balanced", "--vocab-size", "1000"],
            "--pp-partition-method balanced is not a known method; use uniform, parameters, memory, fastest, profile, type:REGEX",
        ),
        (
            ["--pipeline-model-parallel-size", "6", "--pp-partition-method", "memory", "--vocab-size", "1000"],
            "--pp-partition-method memory cannot place --num-layers 3 on --pipeline-model-parallel-size 6: at most 5 "
            "stages",
        ),
        (
            ["--pipeline-model-parallel-size", "3", "--pp-partition-method", "memory"],
            "--pp-partition-method memory needs the vocabulary size",
        ),
        (
            [
                "--pipeline-model-parallel-size",
                "3",
                "--pp-partition-method",
                "memory",
                "--pp-dedicated-embedding-stages",
                "--vocab-size",
                "1000",
            ],
            "were both given; choose one way to place the stage boundaries",
        ),
    ],
)
def test_bad_partition_method_is_one_line(capsys: pytest.CaptureFixture, argv: list[str], message: str) -> None:
    rc, out, err = print_layout(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_memory_method_at_the_limit_prints_the_layout_and_prediction(capsys: pytest.CaptureFixture) -> None:
    """P = layers + 2 is the most the memory method accepts: one stage per layer plus E and L."""
    rc, out, err = print_layout(
        capsys, "--pipeline-model-parallel-size", "5", "--pp-partition-method", "memory", "--vocab-size", "1000"
    )
    assert rc == 0, err
    assert "transformer layers per stage: 0 1 1 1 0 (layout E|t|t|t|L, method memory)" in out
    assert "predicted memory per GPU" in out


def test_cli_exit_status_and_no_traceback() -> None:
    """The real command line: status 2, the one line on stderr, no traceback, nothing on stdout."""
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "pretrain_gpt.py"),
            *MODEL,
            "--vocab-size",
            "1000",
            "--pipeline-model-parallel-size",
            "8",
            "--pp-partition-method",
            "memory",
            "--print-layout",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 2 and out.stdout == ""
    assert "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: --pp-partition-method memory cannot place")
    assert "at most 5 stages (embedding, one layer each, head); use fewer stages or more layers" in out.stderr
