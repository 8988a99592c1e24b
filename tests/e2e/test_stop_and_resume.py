"""Stopping a run and starting it again, as Megatron users do, on 2 CPU ranks (P=2, gloo).

Ctrl-C (SIGINT to every rank, as a terminal sends it to its process group) and SIGTERM without
`--exit-signal-handler` end every rank within seconds with one line each and no traceback;
with `--exit-signal-handler` SIGTERM finishes the step, saves and exits 0, and `--load` resumes
from that checkpoint to the losses of a run that was never stopped. The first launch of a
`--save DIR --load DIR` line starts from scratch with one NOTICE, and `--use-checkpoint-args`
continues it with no model flag given.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

from megatron_ds.data.mock_data import MDS_RULES_NOTICE
from megatron_ds.testing.launch import Ranks
from megatron_ds.testing.pretrain_runs import start_pretrain_gpt
from megatron_ds.testing.script_runs import run_python

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
MODEL += ["--vocab-size", "128"]
RUN = [
    "--mock-data",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--lr",
    "1e-3",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
    "--num-workers",
    "0",
    "--no-log-memory",
    "--distributed-timeout-minutes",
    "2",
    "--pipeline-model-parallel-size",
    "2",
]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*lm loss: ([0-9.E+-]+)")
LOGGING_RANK = 1  # the last stage prints the iteration lines


def start(*argv: str) -> Ranks:
    return start_pretrain_gpt(2, [*MODEL, *RUN, *argv])


def wait_for(ranks: Ranks, text: str, rank: int = LOGGING_RANK, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in ranks.output(rank):
        assert time.monotonic() < deadline, ranks.output(rank)[-3000:]
        assert all(p.poll() is None for p in ranks.procs), [ranks.output(r)[-2000:] for r in (0, 1)]
        time.sleep(0.05)


def losses(text: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in LOSS.finditer(text)}


def stop_with(sig: int, *argv: str) -> list:
    """Start a long run, send `sig` to every rank once iteration 2 is logged; the results, and seconds."""
    ranks = start("--train-iters", "100000", *argv)
    wait_for(ranks, "iteration        2/")
    wait_for(ranks, "1F1B step from these compute times", rank=0)  # the last report the loop prints
    before = [len(ranks.output(r)) for r in (0, 1)]
    sent = time.monotonic()
    ranks.signal(sig)
    results = ranks.finish(timeout=60, check=False)
    return [(r, r.output[before[r.rank] :]) for r in results], time.monotonic() - sent


def test_ctrl_c_and_sigterm_end_every_rank_in_seconds_with_one_line() -> None:
    for sig, name in ((signal.SIGINT, "SIGINT"), (signal.SIGTERM, "SIGTERM")):
        results, seconds = stop_with(sig)
        assert seconds < 10, seconds
        for result, after in results:
            assert result.returncode == 128 + sig, (result.returncode, after[-2000:])
            lines = [ln for ln in after.splitlines() if ln.strip() and not LOSS.search(ln)]
            assert len(lines) == 1, after[-3000:]  # nothing but the one line (and iteration lines in flight)
            assert lines[0].startswith(f"[rank {result.rank}] {name}: stopped in iteration "), lines
            assert "without saving" in lines[0] and "Traceback" not in after


def test_sigterm_with_exit_signal_handler_saves_and_resumes_exactly(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ranks = start("--train-iters", "8", "--save", str(ckpt), "--exit-signal-handler")
    wait_for(ranks, "iteration        2/")
    ranks.signal(signal.SIGTERM)
    first = ranks.finish(timeout=120)  # every rank exits 0
    text = first[LOGGING_RANK].output
    stopped = int(re.search(r"exiting at iteration (\d+) after SIGTERM \(--exit-signal-handler\)", first[0].output)[1])
    assert 2 <= stopped < 8 and (ckpt / "latest").read_text() == f"global_step{stopped}"
    assert "SIGTERM: finishing this step, then saving and exiting" in first[0].output
    assert "Traceback" not in text + first[0].output
    resumed = start("--train-iters", "8", "--save", str(ckpt), "--load", str(ckpt)).finish(timeout=180)
    assert f"resumed from {ckpt} at iteration {stopped}" in resumed[0].output
    straight = start("--train-iters", "8").finish(timeout=180)
    expected = losses(straight[LOGGING_RANK].output)
    assert sorted(expected) == list(range(1, 9))
    assert {**losses(text), **losses(resumed[LOGGING_RANK].output)} == expected


def single(*argv: str) -> subprocess.CompletedProcess:
    run = RUN[: RUN.index("--pipeline-model-parallel-size")]  # one process, P=1
    return run_python([str(ROOT / "pretrain_gpt.py"), *argv, *run], timeout=180, cwd=ROOT)


def test_first_launch_starts_then_use_checkpoint_args_continues(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    schedule = ["--lr-decay-iters", "10"]  # the same schedule in both runs, whatever their length
    first = single(*MODEL, *schedule, "--train-iters", "2", "--save", ckpt, "--load", ckpt)
    assert first.returncode == 0, first.stderr[-3000:]
    notices = [ln for ln in first.stdout.splitlines() if ln.startswith("NOTICE")]
    assert notices == [
        f"NOTICE: --load {ckpt} holds no checkpoint yet: starting from scratch, as Megatron-DeepSpeed does "
        "(--exit-on-missing-checkpoint makes this an error)",
        MDS_RULES_NOTICE,
    ]
    again = single("--use-checkpoint-args", *schedule, "--train-iters", "3", "--save", ckpt, "--load", ckpt)
    assert again.returncode == 0, again.stderr[-3000:]  # no model flag given
    assert f"resumed from {ckpt} at iteration 2" in again.stdout
    assert "NOTICE: --use-checkpoint-args: from --load" in again.stdout and "--num-layers 2" in again.stdout
    assert sorted(losses(again.stdout)) == [3]
