"""benchmarks/gpu_throughput.py's predicted column: the planner's step for the very run it measures.

The prediction is pure (no GPU); here it is checked against `python -m megatron_ds.plan pipeline` given the
same model, degrees, micro-batch, layout method, schedule (pretrain_gpt.py's default 1F1B) and device, so a GPU session's measured / predicted ratio
compares the model with the run it names."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from megatron_ds.plan.__main__ import main

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_throughput.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def planner_step(argv: list[str], capsys) -> dict:
    assert main(["pipeline", *argv, "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    return next(s["data"] for s in report["sections"] if s["name"] == "pipeline")


@pytest.mark.parametrize(
    ("model", "gpus", "pp", "mb", "layout"),
    [("h100-1.7b", 1, 1, 1, "stock"), ("1b", 8, 4, 2, "memory"), ("1b", 8, 4, 2, "both")],
)
def test_prediction_is_the_planners_for_the_same_run(bench, capsys, model, gpus, pp, mb, layout) -> None:
    args = bench.parse_args(["--cpu", "--model", model, "--gpus", str(gpus), "--pipeline-model-parallel-size", str(pp)])
    args.precision, args.micro_batch_size = "bf16", mb
    args.global_batch_size = 16 * mb * gpus // pp
    got = bench.predict(args, layout, "H100-80GB")
    sizes, flags = bench.model_inputs(model)
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in sizes.items()] + flags
    argv += ["--num-gpus", str(gpus), "--gpus-per-node", str(gpus), "--gpu", "H100-80GB", "--precision", "bf16"]
    argv += ["--global-batch-size", str(args.global_batch_size), "--micro-batch-size", str(mb), "--zero-stage", "1"]
    argv += ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", str(pp)]
    argv += ["--layout", bench.METHODS[layout], "--no-checkpoint-activations", "--pp-schedule", "1f1b"]
    want = planner_step(argv, capsys)
    assert got["step_ms"] == pytest.approx(want["step_seconds"] * 1e3, rel=1e-12)
    assert got["tflops"] == pytest.approx(want["tflops_per_gpu"], rel=1e-12)
    assert got["string"] == want["layout"]


def test_model_inputs_split_sizes_from_architecture_flags(bench) -> None:
    sizes, flags = bench.model_inputs("h100-1.7b")
    assert sizes == {
        "num_layers": 24,
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "seq_length": 4096,
        "vocab_size": 131072,
    }
    assert flags == ["--untie-embeddings-and-output-weights"]


def test_no_device_no_prediction_and_the_table_says_so(bench) -> None:
    args = bench.parse_args(["--cpu", "--model", "tiny", "--gpus", "2"])
    assert bench.device_name(args) is None and bench.predict(args, "stock", None) is None
    row = {"layout": "stock", "tokens_per_s": 1.0, "tflops": 1.0, "mfu": None, "step_ms": 1.0, "string": "Et*2|t*2L"}
    table = bench.format_table([{**row, "predicted": None, "gpu": None}], args)
    assert " n/a " in table.splitlines()[2] and "predicted: n/a" in table
    priced = {**row, "predicted": {"tflops": 2.0, "step_ms": 0.5, "string": "Et*3|t*1L"}, "gpu": "H100-80GB"}
    table = bench.format_table([priced], args)
    assert "2.0*" in table and "0.500" in table and "predicted for the planner's layout Et*3|t*1L" in table
