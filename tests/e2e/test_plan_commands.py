"""Every kind of configuration the planner recommends is one pretrain_gpt.py runs (issue 22): its printed
command is accepted (`--print-layout`) and, shrunk to a tiny width on CPU, trains; so do Megatron-DeepSpeed's
ZeRO-3 Azure launch lines (tests/data/launch_lines.json).

Shrinking keeps the plan's degrees, ZeRO stage, offload flags, recomputation and layout (so the layer
count), and replaces the widths (hidden 32, 4 heads, vocabulary 128, sequence 16), the batch (micro-batch
1, two micro-batches per rank), the length (2 iterations, no evaluation) and fp16 (bf16: no fp16 on CPU);
data parallelism runs on at most 2 ranks. NVMe offload cannot run here without DeepSpeed's async_io op
(libaio): its command is accepted and refused before launch in one line, or trains where the op builds.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from megatron_ds.plan.cli import main as plan_main
from megatron_ds.testing.pretrain_runs import run_pretrain_gpt

ROOT = Path(__file__).resolve().parents[2]
V100_6_7B = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length", "4096"]
V100_6_7B += ["--vocab-size", "50257", "--num-gpus", "2", "--gpu", "V100-32GB", "--global-batch-size", "1024"]
ONE_A100_13B = ["--model", "13b", "--num-gpus", "1", "--gpu", "A100-40GB"]
A100_1_3B = ["--model", "1.3b", "--num-gpus", "8", "--gpu", "A100-80GB"]
KINDS = {
    # name: (planner flags, expected (ZeRO stage, optimizer offload, parameter offload, pipeline size))
    # (the pipeline engine's ZeRO 0/1 plans without offload are trained by tests/e2e/test_pretrain_gpt.py)
    "ZeRO-1 + CPU Adam, T=2 (6.7B on 2 x V100-32GB)": ([*V100_6_7B, "--zero-stage", "1"], (1, "cpu", "none", 1)),
    "ZeRO-2": ([*A100_1_3B, "--zero-stage", "2"], (2, "none", "none", 1)),
    "ZeRO-3": ([*A100_1_3B, "--zero-stage", "3"], (3, "none", "none", 1)),
    "ZeRO-2 + CPU Adam": ([*ONE_A100_13B, "--zero-stage", "2"], (2, "cpu", "none", 1)),
    "ZeRO-3, all on the host (13B on one A100-40GB)": (ONE_A100_13B, (3, "cpu", "cpu", 1)),
    "ZeRO-3 to NVMe": ([*ONE_A100_13B, "--storage", "nvme", "--cpu-memory-gb", "64"], (3, "nvme", "nvme", 1)),
}
TINY = {
    "--hidden-size": "32",
    "--num-attention-heads": "4",
    "--ffn-hidden-size": "64",
    "--seq-length": "16",
    "--max-position-embeddings": "16",
    "--vocab-size": "128",
    "--micro-batch-size": "1",
    "--train-iters": "2",
}
RUN = ["--eval-iters", "0", "--log-interval", "1", "--num-workers", "0", "--distributed-timeout-minutes", "3"]
ITERATION = re.compile(r"iteration\s+2/\s*2 \|.*lm loss: ([0-9.E+-]+)")


def planned(flags: list[str], capsys) -> tuple[dict, list[str]]:
    """The `pipeline` section's data and its command's pretrain_gpt.py arguments."""
    assert plan_main(["pipeline", *flags, "--format", "json"]) in (0, 1)
    section = next(s for s in json.loads(capsys.readouterr().out)["sections"] if s["name"] == "pipeline")
    command = section["snippets"]["command"].split("pretrain_gpt.py", 1)[1].replace("\\\n", " ")
    return section["data"], shlex.split(command)


def shrink(argv: list[str], ranks: int, tmp: Path) -> list[str]:
    """`argv` at a tiny width and batch on `ranks` ranks (see the module docstring)."""
    out, i = [], 0
    while i < len(argv):
        flag = argv[i]
        value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        if flag == "--fp16":
            out.append("--bf16")
        elif flag == "--offload-nvme-path":
            out += [flag, str(tmp)]
        elif flag in TINY:
            out += [flag, TINY[flag]]
        elif flag != "--global-batch-size":
            out += [flag] if value is None else [flag, value]
        i += 1 if value is None else 2
    return [*out, "--global-batch-size", str(2 * ranks), *RUN]


def train(argv: list[str], ranks: int) -> str:
    done = run_pretrain_gpt(ranks, argv, timeout=240, cwd=str(ROOT))
    assert done.returncode == 0, done.stdout[-3000:]
    assert ITERATION.search(done.stdout), done.stdout[-3000:]
    return done.stdout


def nvme_runs_here() -> bool:
    from deepspeed.accelerator import get_accelerator

    op = get_accelerator().create_op_builder("AsyncIOBuilder")
    return op is not None and op.is_compatible(verbose=False)


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_of_plan_is_accepted_and_trains(kind: str, capsys, tmp_path: Path) -> None:
    import pretrain_gpt

    flags, expected = KINDS[kind]
    data, argv = planned(flags, capsys)
    assert (data["zero_stage"], data["offload_optimizer"], data["offload_param"], data["pipeline_parallel"]) == expected
    world = data["tensor_parallel"] * data["pipeline_parallel"] * data["data_parallel"]
    on_cpu = [a for a in argv if a != "--fp16"]  # no fp16 on CPU; the layout does not depend on it
    assert pretrain_gpt.main([*on_cpu, "--print-layout", "--world-size", str(world)]) == 0
    capsys.readouterr()
    ranks = data["tensor_parallel"] * data["pipeline_parallel"] * min(data["data_parallel"], 2)
    tiny = shrink(argv, ranks, tmp_path)
    if expected[1] == "nvme" and not nvme_runs_here():
        assert pretrain_gpt.main(tiny) == 2  # refused before any process starts, in one line
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "async_io" in err, err
        return
    train(tiny, ranks)


AZURE = ("examples_deepspeed/azure/run-175b.sh", "examples_deepspeed/azure/run-1t.sh")


@pytest.mark.parametrize("script", AZURE)
def test_megatron_deepspeed_zero3_azure_lines_are_accepted_and_train(script: str, tmp_path: Path, capsys) -> None:
    import pretrain_gpt

    lines = json.loads((ROOT / "tests" / "data" / "launch_lines.json").read_text())["lines"]
    line = next(x for x in lines if x["script"] == script)
    # on CPU: mock data (GPT-2's vocabulary size, not its files), no TensorBoard, bf16 for fp16, the captured
    # JSON at the tiny batch
    dropped = {"--data-path", "--vocab-file", "--merge-file", "--tensorboard-dir", "--split", "--loss-scale"}
    kept, i, argv = [], 0, [a for a in line["argv"] if not a.startswith("--deepspeed_config")]
    while i < len(argv):
        takes = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        if argv[i] not in dropped:
            kept += argv[i : i + (2 if takes else 1)]
        i += 2 if takes else 1
    kept += ["--mock-data", "--vocab-size", "50257"]
    on_cpu = [a for a in kept if a != "--fp16"]  # no fp16 on CPU; the layout does not depend on it
    assert pretrain_gpt.main([*on_cpu, "--print-layout", "--world-size", "8"]) == 0
    capsys.readouterr()
    ds = dict(line["ds_config"])
    ds.pop("fp16", None)
    ds.update(train_batch_size=4, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=2)  # as `shrink`
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(ds))
    tiny = shrink([*kept, "--deepspeed_config", str(config)], 2, tmp_path)
    tiny[tiny.index("--num-layers") + 1] = "4"  # P = 1 and no layout string: the depth is free to shrink too
    train(tiny, 2)
