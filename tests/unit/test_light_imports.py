"""Parsing flags and planning load neither torch nor DeepSpeed (nor megatron-core): each is run in
a fresh interpreter and `sys.modules` is read after it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "deepspeed", "megatron")
ROOT = Path(__file__).resolve().parents[2]


def loaded_after(code: str) -> list[str]:
    check = f"\nimport sys, json\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code + check], capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_parsing_flags_loads_no_torch() -> None:
    code = (
        "from megatron_ds.flags.parser import parse_config\n"
        "parse_config('--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 1000 "
        "--train-iters 10 --lr 1e-3 --pipeline-model-parallel-size 4 --pp-dedicated-embedding-stages'.split(), 4)\n"
        "parse_config('--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 1000 "
        "--train-iters 10 --lr 1e-3 --pipeline-model-parallel-size 2 --pp-partition-method memory'.split(), 2)\n"
    )
    assert loaded_after(code) == []


def test_the_planner_loads_no_torch_or_deepspeed(tmp_path: Path) -> None:
    config = tmp_path / "ds.json"
    code = (
        "import contextlib, io\n"
        "from megatron_ds.plan.__main__ import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['--model', '1.3b', '--num-gpus', '8', '--gpu', 'A100-80GB', '--global-batch-size', '512',\n"
        f"          '--write-config', {str(config)!r}, '--write-command'])\n"
    )
    assert loaded_after(code) == []
    assert json.loads(config.read_text())["train_batch_size"] == 512
