"""pretrain_gpt.py with checkpoints Megatron-DeepSpeed wrote (tests/fixtures/megatron_deepspeed_checkpoints/):
given directly, one line says what it is and which command converts it; converted, the run
continues from it under another layout (T=2 P=2 ZeRO-1 -> one process), with its optimizer state."""

from __future__ import annotations

import subprocess
from pathlib import Path

from megatron_ds.interop.megatron_deepspeed import import_megatron_deepspeed
from megatron_ds.testing.script_runs import run_python
from megatron_ds.training.checkpoint.universal.convert import convert_checkpoint
from megatron_ds.training.checkpoint.universal.store import Universal

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests" / "fixtures" / "megatron_deepspeed_checkpoints" / "tp2_pp2_tied"
# The fixture's model and schedule (make_fixture.py); --make-vocab-size-divisible-by 32 keeps the
# 128 rows it was padded to at T=2 now that T=1.
FLAGS = (
    "--num-layers 3 --hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 16 "
    "--max-position-embeddings 16 --vocab-size 100 --make-vocab-size-divisible-by 32 --hidden-dropout 0.0 "
    "--attention-dropout 0.0 --micro-batch-size 2 --global-batch-size 4 --train-iters 3 --lr-decay-iters 2 "
    "--lr 0.001 --lr-decay-style constant --mock-data --num-workers 0 --log-interval 1 --eval-iters 0"
).split()


def _pretrain(*extra: str) -> subprocess.CompletedProcess[str]:
    return run_python([str(ROOT / "pretrain_gpt.py"), *FLAGS, *extra], timeout=300, cwd=ROOT)


def test_load_of_a_megatron_deepspeed_checkpoint_says_how_to_convert_it() -> None:
    run = _pretrain("--load", str(SOURCE))
    assert run.returncode == 2, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: --load {SOURCE}: a Megatron-DeepSpeed checkpoint (global_step2")
    assert f"python tools/convert_checkpoint.py --from megatron-deepspeed {SOURCE} OUT" in line


def test_a_converted_run_continues_with_its_optimizer_state(tmp_path: Path) -> None:
    converted, saved = tmp_path / "converted", tmp_path / "saved"
    import_megatron_deepspeed(str(SOURCE), str(converted), show_progress=False)
    run = _pretrain("--load", str(converted), "--save", str(saved), "--save-interval", "100")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "was saved with Megatron-DeepSpeed (converted" in run.stdout
    assert "using its universal form" in run.stdout
    assert "iteration        3/       3" in run.stdout
    # Adam's step counter went on from the run's 2: its moments were restored, not started afresh.
    convert_checkpoint(str(saved), str(tmp_path / "universal"), show_progress=False)
    assert Universal(str(tmp_path / "universal" / "global_step3")).group_step("decay") == 3
