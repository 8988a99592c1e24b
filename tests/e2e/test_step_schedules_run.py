"""pretrain_gpt.py with a batch-size ramp-up and the legacy sequence-length curriculum together, on
CPU: a single-process run is the reference; P=2 and then DP=2 (resumed through the universal form),
and a same-layout resume mid-ramp, give its losses, batch sizes, lengths and learning rates. The
resume flags (`--no-load-lr-state`, `--reset-iteration`, `--no-save-optim`, `--no-load-optim`) resume
what Megatron's meaning says, each checked against the reference run or the schedule's formula.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from megatron_ds.flags.parser import parse_config
from megatron_ds.testing.pretrain_runs import run_pretrain_gpt
from megatron_ds.testing.script_runs import run_python
from megatron_ds.training.lr_schedule import build_schedule, learning_rate

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(
    r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|.*learning rate: ([0-9.E+-]+) \| "
    r"global batch size:\s+(\d+) \| lm loss: ([0-9.E+-]+) \|.*curriculum seqlen:\s+(\d+) \|"
)
CURRICULUM = {
    "curriculum_learning": {
        "enabled": True,
        "curriculum_type": "seqlen",
        "min_difficulty": 4,
        "max_difficulty": 16,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 6, "difficulty_step": 4},
    }
}


def flags(ds_json: Path) -> list[str]:
    return [
        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "128", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--micro-batch-size", "1", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "12",
        "--train-iters", "8", "--lr", "1e-3", "--lr-warmup-tokens", "64", "--lr-decay-tokens", "700",
        "--lr-decay-style", "cosine", "--mock-data", "--log-interval", "1", "--eval-interval", "4",
        "--eval-iters", "1", "--num-workers", "0", "--no-log-memory", "--deepspeed_config", str(ds_json),
        "--distributed-timeout-minutes", "2",
    ]  # fmt: skip


def parse_lines(text: str) -> dict[int, dict]:
    out = {}
    for m in LINE.finditer(text):
        out[int(m.group(1))] = {
            "consumed": int(m.group(2)),
            "lr": float(m.group(3)),
            "batch": int(m.group(4)),
            "loss": float(m.group(5)),
            "seqlen": int(m.group(6)),
        }
    return out


def launch(nproc: int, *argv: str) -> str:
    out = run_pretrain_gpt(nproc, argv, timeout=300, cwd=str(ROOT))
    assert out.returncode == 0, out.stdout[-4000:]
    return out.stdout


def single(*argv: str) -> str:
    out = run_python([str(ROOT / "pretrain_gpt.py"), *argv], timeout=240, cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return out.stdout + out.stderr


def close(a: dict[int, dict], b: dict[int, dict], steps: range) -> None:
    for i in steps:
        x, y = a[i], b[i]
        assert (x["consumed"], x["batch"], x["seqlen"]) == (y["consumed"], y["batch"], y["seqlen"]), i
        assert abs(x["loss"] - y["loss"]) <= 1e-6 * abs(y["loss"]) + 1e-6, (i, x, y)
        assert abs(x["lr"] - y["lr"]) <= 1e-9 + 1e-6 * y["lr"], (i, x, y)


def at_step(root: Path, src: Path, tag: str) -> Path:
    """A copy of checkpoint directory `src` whose `latest` names `tag`."""
    shutil.copytree(src, root)
    (root / "latest").write_text(tag)
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("steps")
    ds = tmp / "ds.json"
    ds.write_text(json.dumps(CURRICULUM))
    base = flags(ds)
    ref = single(*base, "--save", str(tmp / "ref"), "--save-interval", "4")
    p2 = launch(2, *base, "--pipeline-model-parallel-size", "2", "--exit-interval", "4", "--save", str(tmp / "p2"))
    dp2 = launch(2, *base, "--load", str(tmp / "p2"))  # DP=2: resumed through the universal form
    half = at_step(tmp / "ref4", tmp / "ref", "global_step4")
    resumed = single(*base, "--load", str(half))
    return {"tmp": tmp, "base": base, "ref": ref, "p2": p2, "dp2": dp2, "resumed": resumed, "half": half}


def test_reference_follows_the_ramp_and_the_curriculum(runs: dict) -> None:
    ref = parse_lines(runs["ref"])
    # Megatron's ramp (2 + 2 per 4 samples up to 8) and DeepSpeed's fixed_linear (tests/unit/test_step_schedules.py)
    assert [ref[i]["batch"] for i in range(1, 9)] == [2, 2, 4, 6, 8, 8, 8, 8]
    assert [ref[i]["consumed"] for i in range(1, 9)] == [2, 4, 8, 14, 22, 30, 38, 46]
    assert [ref[i]["seqlen"] for i in range(1, 9)] == [4, 8, 8, 12, 12, 16, 16, 16]
    assert "validation loss at iteration 4" in runs["ref"]  # evaluation at full length between shorter steps
    config = parse_config(runs["base"], world_size=1)[0]
    schedule = build_schedule(config.optimizer, 8, 8, 16)
    tokens = 0
    for i in range(1, 9):  # the lr counts the tokens each step kept, as Megatron-DeepSpeed's
        tokens += ref[i]["batch"] * ref[i]["seqlen"]
        assert ref[i]["lr"] == pytest.approx(learning_rate(schedule, tokens), rel=1e-6), i


def test_pipeline_and_data_parallel_runs_equal_the_single_process(runs: dict) -> None:
    ref = parse_lines(runs["ref"])
    close(parse_lines(runs["p2"]), ref, range(1, 5))
    assert "through its universal form" in runs["dp2"]
    close(parse_lines(runs["dp2"]), ref, range(5, 9))
    assert "resumed from" in runs["resumed"] and "at iteration 4 (14 samples consumed)" in runs["resumed"]
    close(parse_lines(runs["resumed"]), ref, range(5, 9))


def test_no_load_lr_state_restarts_the_schedule(runs: dict) -> None:
    out = single(*runs["base"], "--load", str(runs["half"]), "--no-load-lr-state", "--exit-interval", "5")
    assert "NOTICE: --no-load-lr-state: the learning-rate schedule starts again from step 0" in out
    line = parse_lines(out)[5]
    assert (line["consumed"], line["batch"], line["seqlen"]) == (22, 8, 12)  # the data and ramp resume
    schedule = build_schedule(parse_config(runs["base"], world_size=1)[0].optimizer, 8, 8, 16)
    assert line["lr"] == pytest.approx(learning_rate(schedule, 8 * 12), rel=1e-6)  # one step's tokens, from 0


def test_reset_iteration_counts_from_zero_and_keeps_the_rest(runs: dict) -> None:
    out = single(*runs["base"], "--load", str(runs["half"]), "--reset-iteration", "--exit-interval", "2")
    lines, ref = parse_lines(out), parse_lines(runs["ref"])
    assert sorted(lines) == [1, 2] and [lines[i]["consumed"] for i in (1, 2)] == [2, 4]  # ramp and data restart
    assert [lines[i]["seqlen"] for i in (1, 2)] == [4, 8]  # so does the curriculum
    schedule = build_schedule(parse_config(runs["base"], world_size=1)[0].optimizer, 8, 8, 16)
    done = sum(ref[i]["batch"] * ref[i]["seqlen"] for i in range(1, 5))  # the schedule resumes
    assert lines[1]["lr"] == pytest.approx(learning_rate(schedule, done + 2 * 4), rel=1e-6)
    assert lines[1]["loss"] != ref[1]["loss"]  # trained weights, the first samples again


def test_no_save_optim_checkpoints_resume_as_no_load_optim(runs: dict) -> None:
    tmp, base = runs["tmp"], runs["base"]
    single(*base, "--exit-interval", "4", "--save", str(tmp / "noopt"), "--no-save-optim")
    saved = sorted(p.name for p in (tmp / "noopt" / "global_step4").iterdir())
    assert saved and not [n for n in saved if "optim" in n or n.startswith("mp_rank")], saved
    assert json.loads((tmp / "noopt" / "global_step4" / "megatron_ds.json").read_text())["optimizer_state"] is False
    a = single(*base, "--load", str(tmp / "noopt"), "--exit-interval", "6")
    assert "was saved with --no-save-optim: optimizer and learning-rate schedule start fresh" in a
    b = single(*base, "--load", str(runs["half"]), "--no-load-optim", "--exit-interval", "6")
    assert "NOTICE: --no-load-optim:" in b and "Megatron-DeepSpeed's DeepSpeed path would load them anyway" in b
    la, lb = parse_lines(a), parse_lines(b)
    close(la, lb, range(5, 7))  # the same weights, a fresh optimizer and schedule, the same data position
    ref = parse_lines(runs["ref"])
    assert la[5]["consumed"] == 22 and la[5]["loss"] == ref[5]["loss"]  # the saved weights, before any update
    assert la[6]["loss"] != ref[6]["loss"]  # then a fresh optimizer's first step
