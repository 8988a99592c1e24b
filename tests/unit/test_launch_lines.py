"""Upstream's own launch lines (tests/data/launch_lines.json) replayed through our launch checks:
docs/compatibility.md's per-script table is what the replay prints, no line crashes us, and the
capture tool's stubs record what a script launches."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ds.testing import launch_lines

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "compatibility.md"


@pytest.fixture(scope="module")
def outcomes() -> list[launch_lines.Outcome]:
    return launch_lines.replay_all()


def test_the_docs_table_is_the_replay(outcomes: list[launch_lines.Outcome]) -> None:
    block = re.search(r"<!-- launch-lines:begin -->\n(.*?)<!-- launch-lines:end -->", DOC.read_text(), re.S)
    assert block is not None, "docs/compatibility.md lost its launch-lines markers"
    assert block.group(1) == launch_lines.markdown_table(outcomes), (
        "docs/compatibility.md's per-script table is stale: paste `python -m megatron_ds.testing.launch_lines` "
        "between the launch-lines markers"
    )


def test_no_captured_line_crashes_and_every_refusal_is_one_line(outcomes: list[launch_lines.Outcome]) -> None:
    assert not [o for o in outcomes if o.status == "crash"]
    assert all("\n" not in o.message for o in outcomes)
    assert len(outcomes) == len(json.loads(launch_lines.CAPTURED.read_text())["lines"])


def test_world_size_from_the_launcher() -> None:
    assert launch_lines.world_size_of({"launcher": "deepspeed", "launcher_args": ["--num_gpus", "4"]}) == 4
    assert launch_lines.world_size_of({"launcher": "deepspeed", "launcher_args": []}) is None
    assert launch_lines.world_size_of({"launcher": "deepspeed", "launcher_args": ["--num_nodes=2"]}) == 16
    args = ["--nproc_per_node", "8", "--nnodes", "2"]
    assert launch_lines.world_size_of({"launcher": "torchrun", "launcher_args": args}) == 16
    assert launch_lines.world_size_of({"launcher": "python", "launcher_args": ["-u"]}) is None


def test_the_sentencepiece_stand_in_has_llamas_vocabulary(tmp_path: Path) -> None:
    from megatron_ds.data.tokenizer import build_tokenizer

    path = tmp_path / "tokenizer.model"
    path.write_bytes(launch_lines.sentencepiece_model())
    assert build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=str(path)).vocab_size == 32000


def test_the_capture_stubs_record_a_launch(tmp_path: Path) -> None:
    repo = tmp_path / "upstream"
    (repo / "examples_deepspeed").mkdir(parents=True)
    (repo / "examples_deepspeed" / "run.sh").write_text(
        "#!/bin/bash\n"
        "CKPT=<Specify path>\n"
        "mkdir -p out/ckpt\n"
        "echo '{\"train_batch_size\": 8}' > ds.json\n"
        "n=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)\n"
        "deepspeed --num_gpus $n pretrain_gpt.py --num-layers 2 --load out/ckpt --deepspeed_config ds.json\n"
    )
    out = tmp_path / "lines.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "capture_launch_lines.py"),
            "--megatron-deepspeed",
            str(repo),
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    (line,) = json.loads(out.read_text())["lines"]
    assert line["launcher"] == "deepspeed" and line["launcher_args"] == ["--num_gpus", "8"]
    assert line["argv"] == ["--num-layers", "2", "--load", "out/ckpt", "--deepspeed_config", "ds.json"]
    assert line["ds_config"] == {"train_batch_size": 8} and line["existing_dirs"] == ["out/ckpt"]
    assert line["placeholders_filled"] and line["script"] == "examples_deepspeed/run.sh"
