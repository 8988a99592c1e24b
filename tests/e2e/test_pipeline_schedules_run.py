"""pretrain_gpt.py with the new schedules, as users launch it (2 CPU ranks, P = 2, gloo).

An interleaved run (--num-virtual-stages-per-pipeline-rank 2) evaluates and saves; ZB-H1
(--enable-zbh1-pipeline) resumes it under the one-chunk layout through the universal form; both
print the losses of one uninterrupted 1F1B run, iteration by iteration, validation included.
"""

from __future__ import annotations

import re
from pathlib import Path

from megatron_ds.testing.launch import run_ranks
from megatron_ds.testing.zygote import RUN_PRELOAD

ROOT = Path(__file__).resolve().parents[2]
COMMON = [
    *("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 128".split()),
    *("--mock-data --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --log-interval 1 --num-workers 0".split()),
    *("--no-log-memory --distributed-timeout-minutes 2 --pipeline-model-parallel-size 2".split()),
    *("--hidden-dropout 0 --attention-dropout 0 --seed 1234 --train-iters 6 --eval-iters 1 --eval-interval 2".split()),
    # Megatron-LM's --num-virtual-stages-per-pipeline-rank would switch auto to its data rules (other mock samples)
    *("--data-upstream megatron-deepspeed".split()),
]
TRAIN = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*lm loss: ([0-9.E+-]+)")
VALID = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")


def launch(*extra: str) -> tuple[dict[str, str], dict[str, str], str]:
    argv = [*COMMON, *extra]  # both ranks forked from one process that imported the training stack once
    results = run_ranks([str(ROOT / "pretrain_gpt.py"), *argv], 2, timeout=300, cwd=str(ROOT), preload=RUN_PRELOAD)
    last = results[1].output  # the last stage prints the iteration lines
    return dict(TRAIN.findall(last)), dict(VALID.findall(last)), results[0].output + last


def test_interleaved_then_zbh1_resume_print_1f1bs_losses(tmp_path: Path) -> None:
    ref_train, ref_valid, _ = launch()
    assert len(ref_train) == 6 and len(ref_valid) == 3
    train, valid, out = launch(
        "--num-virtual-stages-per-pipeline-rank", "2", "--save", str(tmp_path), "--save-interval", "4",
        "--exit-interval", "4",
    )  # fmt: skip
    assert "2 model chunks (virtual stages) per rank: rank 0: stages 0, 2" in out
    assert "interleaved 1F1B (v=2) step from these compute times" in out
    assert train == {k: ref_train[k] for k in "1234"} and valid == {k: ref_valid[k] for k in "24"}
    train, valid, out = launch("--enable-zbh1-pipeline", "--load", str(tmp_path))
    assert "resuming the whole training state through its universal form" in out
    assert "NOTICE: --enable-zbh1-pipeline runs ZB-H1 with exact semantics here" in out
    assert train == {k: ref_train[k] for k in "56"} and valid == {"6": ref_valid["6"]}
