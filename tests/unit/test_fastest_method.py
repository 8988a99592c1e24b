"""`--pp-partition-method fastest` / `profile` from the command line and the planner: the memory
limit, the one-line refusal naming what would fit, the printed time and memory per stage, and the
planner's ZeRO-1 + optimizer offload for a model that fits no other way."""

from __future__ import annotations

import json
import re

import pytest

import pretrain_gpt
from megatron_ds.config import ParallelConfig
from megatron_ds.config.parallel import parse_memory_size
from megatron_ds.errors import ConfigError
from megatron_ds.estimate.fit_advice import least_memory
from megatron_ds.estimate.layout_costs import flop_stage_time
from megatron_ds.estimate.machine import CPU
from megatron_ds.estimate.memory_model import stage_memory_for
from megatron_ds.estimate.run_layout import build_run_layout, memory_inputs
from megatron_ds.estimate.step_simulator import step_estimator
from megatron_ds.flags.parser import parse_config
from megatron_ds.pipeline.fastest import fastest_split
from megatron_ds.plan.__main__ import main as plan_main

BENCH = [  # the 48-layer model of benchmarks/stage_memory.py
    "--num-layers",
    "48",
    "--hidden-size",
    "384",
    "--num-attention-heads",
    "8",
    "--seq-length",
    "128",
    "--vocab-size",
    "32000",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "4",
    "--pipeline-model-parallel-size",
    "5",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
]


def print_layout(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    rc = pretrain_gpt.main([*BENCH, *argv, "--print-layout"])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize(
    "text,size",
    [("80GiB", 80 * 2**30), ("500MB", 5e8), ("1e9", 1e9), ("1073741824", 2**30), (" 1.5 gib", 1.5 * 2**30)],
)
def test_memory_sizes(text: str, size: float) -> None:
    assert parse_memory_size(text) == size


@pytest.mark.parametrize("text", ["80XB", "-1GiB", "0", "GiB", "nan"])
def test_bad_memory_size_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="is not a memory size; give bytes or a number with a unit"):
        ParallelConfig(pp_memory_limit=text)


def test_fastest_is_the_exact_search_under_the_limit(capsys: pytest.CaptureFixture) -> None:
    config, _ = parse_config(
        [*BENCH, "--pp-partition-method", "fastest", "--pp-memory-limit", "600MiB", "--print-layout"], world_size=5
    )
    layout = build_run_layout(config, CPU)
    mem = memory_inputs(config, CPU)
    expected = fastest_split(
        48,
        5,
        flop_stage_time(mem, 5),
        lambda s, k: stage_memory_for(mem, s, 5, k).total,
        600 * 2**20,
        step_time=step_estimator(4),
    )
    assert layout.layers_per_stage == expected.counts and layout.method == "fastest"
    assert expected.peak_memory <= 600 * 2**20
    rc, out, _ = print_layout(capsys, "--pp-partition-method", "fastest", "--pp-memory-limit", "600MiB")
    assert rc == 0
    assert "predicted time per stage (GFLOP; compute model" in out
    step = re.search(r"simulated 1F1B step \(M=4, one device per stage\): ([\d.,]+) GFLOP = ([\d.]+) x the ideal", out)
    assert step and float(step.group(1).replace(",", "")) == pytest.approx(expected.step_time, rel=1e-3)
    rows = re.findall(r"^\s+(\d) +(\d+) +[\d.,]+ +[\d.,]+ +0 +[\d.,]+ +[\d.]+ MiB$", out, re.MULTILINE)
    assert [int(k) for _, k in rows] == list(expected.counts)  # one row per stage with its time and memory


def test_nothing_fits_names_the_smallest_pipeline_size_that_would(capsys: pytest.CaptureFixture) -> None:
    rc, out, err = print_layout(capsys, "--pp-partition-method", "fastest", "--pp-memory-limit", "400MiB")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "no split of --num-layers 48 over --pipeline-model-parallel-size 5 fits 400 MiB per device" in err
    mem = memory_inputs(parse_config([*BENCH, "--print-layout"], world_size=5)[0], CPU)
    smallest = next(p for p in range(6, 51) if least_memory(mem, p) <= 400 * 2**20)
    assert f"it would fit with --pipeline-model-parallel-size {smallest} (" in err
    assert least_memory(mem, smallest - 1) > 400 * 2**20  # and not with one stage fewer


def test_recomputation_is_named_when_it_fits(capsys: pytest.CaptureFixture) -> None:
    argv = ["--micro-batch-size", "8", "--global-batch-size", "32", "--pp-partition-method", "fastest"]
    mem = memory_inputs(parse_config([*BENCH, *argv[:4], "--print-layout"], world_size=5)[0], CPU)
    limit = least_memory(mem, 5) * 0.95  # just short of fitting without recomputation
    rc, _, err = print_layout(capsys, *argv, "--pp-memory-limit", str(int(limit)))
    assert rc == 2 and err.count("\n") == 1 and "--checkpoint-activations (" in err, err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--pp-partition-method", "fastest"], "needs --pp-memory-limit on CPU (there is no device memory"),
        (["--pp-partition-method", "memory", "--pp-memory-limit", "1GiB"], "--pp-memory-limit 1GiB applies to"),
        (["--pp-memory-limit", "1GiB"], "drop it or choose one of those methods"),
        (["--pp-partition-method", "fastest", "--pp-memory-limit", "lots"], "'lots' is not a memory size"),
    ],
)
def test_limit_errors_are_one_line(capsys: pytest.CaptureFixture, argv: list[str], message: str) -> None:
    rc, out, err = print_layout(capsys, *argv)
    assert rc == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_profile_prints_measured_milliseconds(capsys: pytest.CaptureFixture) -> None:
    small = ["--num-layers", "6", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]
    rc = pretrain_gpt.main(
        [*small, "--vocab-size", "1000", "--pipeline-model-parallel-size", "3", "--pp-partition-method", "profile"]
        + ["--pp-memory-limit", "1GiB", "--print-layout"]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "method profile" in out and "(ms; measured once in this process, `profile`)" in out


GPT_6_7B_ON_2_V100 = [
    "--num-layers",
    "32",
    "--hidden-size",
    "4096",
    "--num-attention-heads",
    "32",
    "--seq-length",
    "4096",
    "--vocab-size",
    "50257",
    "--num-gpus",
    "2",
    "--gpu",
    "V100-32GB",
    "--global-batch-size",
    "1024",
]


@pytest.mark.parametrize("fixed", [[], ["--pipeline-model-parallel-size", "2"]])
def test_planner_offloads_the_optimizer_when_nothing_else_fits(tmp_path, capsys, fixed: list[str]) -> None:
    path = tmp_path / "ds.json"
    rc = plan_main(["pipeline", *GPT_6_7B_ON_2_V100, *fixed, "--write-config", str(path), "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0, report
    data = next(s for s in report["sections"] if s["name"] == "pipeline")["data"]
    assert data["offload_optimizer"] == "cpu" and (data["zero_stage"] == 1 or not fixed)
    written = json.loads(path.read_text())
    assert written["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "zero_force_ds_cpu_optimizer" not in written  # the command's --cpu-optimizer: DeepSpeed's CPU Adam
    command = next(s for s in report["sections"] if s["name"] == "pipeline")["snippets"]["command"]
    assert "--cpu-optimizer" in command and f"--zero-stage {data['zero_stage']}" in command
    assert max(s["total"] for s in data["stages"]) <= 0.9 * 32 * 2**30
    if fixed:  # the layout: the fastest by predicted seconds of those tried (`plan/ranking.refine_methods`)
        assert data["pipeline_parallel"] == 2


def test_planner_still_refuses_what_cannot_fit_and_says_what_it_tried(capsys) -> None:
    rc = plan_main(["pipeline", *GPT_6_7B_ON_2_V100, "--gpu-memory-gb", "4", "--cpu-memory-gb", "64"])
    err = capsys.readouterr().err
    tried = "recomputation, ZeRO-2/3 at pipeline size 1 and optimizer/parameter offload were tried too"
    assert rc == 2 and tried in err, err
