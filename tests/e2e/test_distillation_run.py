"""pretrain_gpt.py --kd end to end on one CPU process: a tiny teacher trains and saves, then a student of the same
architecture, initialised from the teacher's weights (--load TEACHER --finetune), distils from it
(--load-teacher TEACHER): its log lines give total, lm and kd loss, and the first kd loss is 0 (the KL divergence
of two equal distributions), the later ones not (the student has moved). Evaluation prints the lm loss alone (the
teacher runs in training steps only). A teacher checkpoint that does not fit is one line before any process group.
"""

from __future__ import annotations

import re

import pytest

from megatron_ds.testing.pretrain_runs import run_pretrain_gpt

MODEL = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16"
RUN = "--vocab-size 128 --mock-data --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --log-interval 1"
RUN += " --num-workers 0 --no-log-memory --distributed-timeout-minutes 2 --hidden-dropout 0 --attention-dropout 0"
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.* total loss: (\S+) \| lm loss: (\S+) \| kd loss: (\S+) \|")


def pretrain(*argv: str) -> str:
    result = run_pretrain_gpt(1, [*MODEL.split(), *RUN.split(), *argv], timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def teacher(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("kd") / "teacher")
    pretrain("--train-iters", "3", "--eval-iters", "0", "--save", path)
    return path


def test_student_from_the_teachers_weights_starts_at_kd_loss_zero(teacher: str) -> None:
    out = pretrain(
        *("--train-iters", "3", "--eval-iters", "1", "--eval-interval", "3"),
        *("--load", teacher, "--finetune", "--kd", "--load-teacher", teacher, "--num-layers-teacher", "2"),
    )
    steps = [(int(i), float(total), float(lm), float(kd)) for i, total, lm, kd in LINE.findall(out)]
    assert [s[0] for s in steps] == [1, 2, 3], out[-3000:]
    assert abs(steps[0][3]) < 1e-6  # KL(p || p)
    assert all(kd > 1e-6 for *_, kd in steps[1:])  # the student has left the teacher
    assert all(total == pytest.approx(lm + kd, rel=1e-5) for _, total, lm, kd in steps)
    assert re.search(r"validation loss at iteration 3 \| lm loss value: \S+ \| lm loss PPL: \S+ \|\n", out)


def test_teacher_that_does_not_fit_is_one_line(teacher: str) -> None:
    result = run_pretrain_gpt(
        1,
        [
            *MODEL.split(),
            *RUN.split(),
            "--train-iters",
            "1",
            "--kd",
            "--load-teacher",
            teacher,
            "--hidden-size-teacher",
            "64",
        ],
        timeout=60,
    )
    assert result.returncode != 0 and "Traceback" not in result.stdout
    assert f"--hidden-size-teacher 64 disagrees with --load-teacher {teacher} (global_step3)" in result.stdout
