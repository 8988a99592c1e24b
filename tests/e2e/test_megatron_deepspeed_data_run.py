"""pretrain_gpt.py trains on Megatron-DeepSpeed's own `--append-eod` files as they are (one process, CPU)."""

from __future__ import annotations

from pathlib import Path

from megatron_ds.testing.script_runs import run_python

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "megatron_deepspeed"


def test_trains_on_upstream_append_eod_files(tmp_path: Path) -> None:
    line = [
        *("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2").split(),
        *("--global-batch-size 4 --train-iters 3 --lr 1e-3 --log-interval 1 --eval-interval 2 --eval-iters 1").split(),
        *("--num-workers 1 --split 98,2,0 --tokenizer-type GPT2BPETokenizer").split(),
        *("--vocab-file", str(FIXTURE / "vocab.json"), "--merge-file", str(FIXTURE / "merges.txt")),
        *("--data-path", str(FIXTURE / "mds_gpt2_a_eod_text_document"), "--data-cache-path", str(tmp_path / "cache")),
    ]
    out = run_python([str(ROOT / "pretrain_gpt.py"), *line], timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    notices = [ln for ln in out.stdout.splitlines() if ln.startswith("NOTICE: ")]
    assert len(notices) == 1 and "Megatron-DeepSpeed's --append-eod layout" in notices[0], out.stdout[-3000:]
    assert "     document indices in [0, 73) total of 73 documents" in out.stdout
    assert "iteration        3/       3" in out.stdout and "validation loss at iteration 2" in out.stdout
    assert "Traceback" not in out.stderr
