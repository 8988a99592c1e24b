"""benchmarks/gpu_throughput.py at tiny size on CPU: it runs each layout and prints its table."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a benchmark script's smoke run (~18 s): `pytest -m slow` runs it before a device session
def test_tiny_run_prints_one_row_per_layout() -> None:
    argv = [sys.executable, str(ROOT / "benchmarks" / "gpu_throughput.py"), "--cpu", "--model", "tiny", "--gpus", "2"]
    argv += ["--layouts", "stock,both,fastest", "--iters", "3", "--log-interval", "1", "--timeout", "240"]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "model tiny: --num-layers 4" in out.stdout and "2 rank(s), P=2" in out.stdout
    row = r"^(\w+) +([\d.]+) +([\d.e+-]+) +(n/a|[\d.]+%) +([\d.]+) +n/a +n/a  (\S+)$"  # no prediction on CPU
    rows = re.findall(row, out.stdout, re.MULTILINE)
    assert [r[0] for r in rows] == ["stock", "fastest"], out.stdout  # `both` needs P >= 3: left out
    for _, tokens, tflops, mfu, step_ms, layout in rows:
        assert float(tokens) > 0 and float(tflops) > 0 and float(step_ms) > 0
        assert mfu == "n/a"  # no peak for a CPU
        assert layout.startswith("E") and layout.endswith("L") and layout.count("|") == 1
    assert "predicted: n/a (no device of estimate/devices.py to price" in out.stdout
    # tokens/s is the global batch's tokens over the step: 16 x 1 x 32 tokens per iteration
    for _, tokens, _, _, step_ms, _ in rows:
        assert abs(float(tokens) - 16 * 32 / (float(step_ms) / 1e3)) / float(tokens) < 0.2
