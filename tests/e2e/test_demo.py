"""The CPU demo script (what `make demo` runs) trains on 5 processes, its loss falls, and the model speaks."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_demo_trains_with_dedicated_stages(tmp_path: Path) -> None:
    env = dict(
        os.environ,
        DATA_DIR=str(tmp_path / "data"),
        SAVE_DIR=str(tmp_path / "ckpt"),
        TRAIN_ITERS="12",
        TIMEOUT="600",
        MASTER_PORT="29611",
        PYTHON=str(Path(os.sys.executable)),
    )
    out = subprocess.run(
        [
            "bash",
            str(ROOT / "examples" / "pretrain_gpt_cpu_demo.sh"),
            "--eval-interval",
            "6",
            "--log-interval",
            "3",
            "--global-batch-size",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=ROOT,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-5000:]
    assert "transformer layers per stage: 0 2 2 2 0 (layout E|t*2|t*2|t*2|L" in text
    losses = [float(m) for m in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", text)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.3, losses
    assert len(re.findall(r"\[Rank \d \| stage \d\] \(after 3 iterations\) memory", text)) == 5
    assert "validation loss at iteration 6" in text and "test loss at iteration 12" in text
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step12"
    # ... and the model it trained speaks: tools/generate.py continues the prompt in one process.
    assert '--- the trained model continues "Return the"' in text
    assert re.search(r"^Return the", text, re.MULTILINE) and re.search(r"\[\d+ tokens in [0-9.]+ s from ", text)


def test_own_training_loop_example() -> None:
    from megatron_ds.testing.launch import run_torchrun

    out = run_torchrun(3, [str(ROOT / "examples" / "own_training_loop.py")], timeout=300, cwd=str(ROOT))
    assert out.returncode == 0, out.stdout[-4000:]
    losses = [float(x) for x in re.findall(r"step \d loss ([0-9.]+)", out.stdout)]
    assert len(losses) == 5 and losses[-1] < losses[0]
    assert re.search(r"eval loss [0-9.]+", out.stdout), out.stdout[-4000:]
