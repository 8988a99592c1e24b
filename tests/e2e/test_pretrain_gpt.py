"""pretrain_gpt.py end to end on CPU: training, exact resume, layout-changing resume, and every bad input as a
one-line error that leaves existing checkpoints untouched.

The reference run and the runs that check what torchrun reports (its per-rank exit statuses) go through the real
`torchrun`; the other multi-rank runs fork their ranks from one process that
imported the training stack once (`megatron_ds.testing.pretrain_runs`), and the one-process runs are forked from a
server that did (`megatron_ds.testing.script_runs`): the same script, without each process's seconds of imports."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from megatron_ds.data.mock_data import MDS_RULES_NOTICE
from megatron_ds.testing.launch import run_torchrun
from megatron_ds.testing.pretrain_runs import run_pretrain_gpt
from megatron_ds.testing.script_runs import run_python
from megatron_ds.training.logger import tensorboard_available

ROOT = Path(__file__).resolve().parents[2]
MODEL = [
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--vocab-size",
    "128",
    "--hidden-dropout",
    "0.1",
    "--attention-dropout",
    "0.1",
]
TRAIN = [
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    "6",
    "--lr",
    "1e-3",
    "--lr-warmup-iters",
    "2",
    "--mock-data",
    "--log-interval",
    "1",
    "--eval-interval",
    "100",
    "--eval-iters",
    "2",
    "--num-workers",
    "0",
    "--distributed-timeout-minutes",
    "2",
]
STRAIGHT = [*MODEL, *TRAIN, "--pipeline-model-parallel-size", "3", "--pp-dedicated-embedding-stages"]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*lm loss: ([0-9.E+-]+)")
TEST_LOSS = re.compile(r"test loss at iteration \d+ \| lm loss value: ([0-9.E+-]+)")


def pretrain(nproc: int, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Under the real torchrun."""
    out = run_torchrun(nproc, [str(ROOT / "pretrain_gpt.py"), *argv], timeout=timeout, cwd=str(ROOT))
    assert "killed after" not in out.stdout, out.stdout[-4000:]
    return out


def forked(nproc: int, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The same ranks forked from one process that imported the training stack once (no torchrun)."""
    out = run_pretrain_gpt(nproc, argv, timeout=timeout, cwd=str(ROOT))
    assert "killed after" not in out.stdout, out.stdout[-4000:]
    return out


def assert_every_rank_left_with_2(out: subprocess.CompletedProcess) -> None:
    """torchrun's summary of a stop on every rank: the first rank to leave exited exactly 2 (not -6 or -11, a rank
    aborted while its interpreter finalised), and every other one 2 too or -15 (torchrun's SIGTERM to the ranks
    left once one has failed)."""
    first = re.search(r"Root Cause \(first observed failure\):.*?exitcode\s*:\s*(-?\d+)", out.stdout, re.S)
    statuses = re.findall(r"exitcode\s*:\s*(-?\d+)", out.stdout)
    assert first and first.group(1) == "2" and set(statuses) <= {"2", "-15"}, out.stdout[-4000:]


def losses(text: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in LOSS.finditer(text)}


def tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """6 iterations in one go on P=3 with dedicated pre/post stages, saved at the end."""
    save = tmp_path_factory.mktemp("straight") / "ckpt"
    out = pretrain(3, *STRAIGHT, "--save", str(save))
    assert out.returncode == 0, out.stdout[-4000:]
    return {"save": save, "out": out.stdout, "losses": losses(out.stdout)}


def test_straight_run_prints_megatron_lines_and_memory(straight: dict) -> None:
    text = straight["out"]
    assert sorted(straight["losses"]) == [1, 2, 3, 4, 5, 6]
    line = next(ln for ln in text.splitlines() if "iteration        6/       6" in ln)
    for field in (
        "consumed samples:           48",
        "elapsed time per iteration (ms):",
        "learning rate:",
        "global batch size:     8",
        "lm loss:",
        "grad norm:",
        "tokens per second:",
        "ETA:",
    ):
        assert field in line, line
    for stage in range(3):
        assert f"| stage {stage}] (after 1 iterations) memory (MB) | params:" in text
    assert "transformer layers per stage: 0 4 0" in text
    assert TEST_LOSS.search(text) and "saved checkpoint" in text


@pytest.fixture(scope="module")
def half(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The straight run's first 3 iterations (same flags, --exit-interval 3), saved."""
    save = tmp_path_factory.mktemp("half") / "ckpt"
    out = forked(3, *STRAIGHT, "--save", str(save), "--exit-interval", "3")
    assert out.returncode == 0, out.stdout[-4000:]
    # Megatron exits right after saving: no final validation and test evaluation (there was one)
    assert "exiting at iteration 3 (--exit-interval)" in out.stdout and not TEST_LOSS.search(out.stdout)
    return {"save": save, "losses": losses(out.stdout)}


def test_a_missing_or_cut_rank_file_is_one_line_on_every_rank(half: dict, tmp_path: Path) -> None:
    """A resume as saved checks every rank's files first: a missing RNG state was skipped without a word (Megatron
    names --no-load-rng), a cut engine state was a zip-reader traceback on one rank and 'Connection closed by peer'
    on the others."""
    import shutil

    ours = [f'File "{ROOT / "megatron_ds"}', 'pretrain_gpt.py", line']
    for damage, needle in (("rng", "rng_rank1.pt: missing; give --no-load-rng"), ("cut", "cut short or damaged")):
        copy = tmp_path / damage
        shutil.copytree(half["save"], copy)
        step = copy / "global_step3"
        if damage == "rng":
            (step / "rng_rank1.pt").unlink()
        else:
            (step / "mp_rank_01_model_states.pt").write_bytes((step / "mp_rank_01_model_states.pt").read_bytes()[:500])
        out = forked(3, *STRAIGHT, "--load", str(copy))  # no launcher stops a rank: each one must say it
        assert out.returncode not in (0, -9), out.stdout[-4000:]
        assert not any(frame in out.stdout for frame in ours), out.stdout[-4000:]
        # every rank checks every rank's files and names the damage (never a traceback, never a hang)
        named = set(re.findall(r"\[rank (\d)\] error: .*" + re.escape(needle), out.stdout))
        assert named == {"0", "1", "2"}, out.stdout[-4000:]


def test_a_damaged_layer_file_of_one_stage_stops_every_stage_at_once(half: dict, tmp_path: Path) -> None:
    """A weights-only resume (--finetune) reads each stage's own layer files: one of stage 1's cut short fails rank 1
    alone; every rank prints its one line naming the file and rank 1, no traceback, and exits 2 within seconds of the
    others (before, ranks 0 and 2 went on to tie their embeddings and train, and stopped only when a collective
    with rank 1 failed or the launcher killed them)."""
    import shutil

    from megatron_ds.testing.pretrain_runs import start_pretrain_gpt

    copy = tmp_path / "ckpt"
    shutil.copytree(half["save"], copy)
    cut = copy / "global_step3" / "layer_04-model_00-model_states.pt"  # a transformer layer: stage 1's
    cut.write_bytes(cut.read_bytes()[:300])
    ranks = start_pretrain_gpt(3, [*STRAIGHT, "--load", str(copy), "--finetune"])
    exited = ranks.exit_times(200)
    results = ranks.finish(5, check=False)  # kills what is left
    outputs = [r.output for r in results]
    assert [r.returncode for r in results] == [2, 2, 2], outputs
    assert max(exited.values()) - min(exited.values()) < 5.0, (exited, outputs)
    for rank, out in enumerate(outputs):
        assert f"[rank {rank}] error: {cut}: unreadable (" in out, out[-3000:]
        assert out.rstrip().endswith("(on rank 1; every rank stops)") and "Traceback" not in out, out[-3000:]


def test_resume_is_exact(straight: dict, half: dict, tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    second = forked(3, *STRAIGHT, "--load", str(half["save"]), "--save", str(save))
    assert second.returncode == 0, second.stdout[-4000:]
    assert "resumed from" in second.stdout and "at iteration 3" in second.stdout
    resumed = {**half["losses"], **losses(second.stdout)}
    assert resumed == straight["losses"]
    a = straight["save"] / "global_step6"
    b = save / "global_step6"
    for f in sorted(a.glob("layer_*-model_states.pt")):
        wa, wb = torch.load(f, weights_only=True), torch.load(b / f.name, weights_only=True)
        assert all(torch.equal(wa[k], wb[k]) for k in wa), f.name


def test_load_tag_resumes_from_a_checkpoint_older_than_latest(straight: dict, half: dict, tmp_path: Path) -> None:
    """Megatron-DeepSpeed's --load-tag: a directory holding iterations 3 and 6 (latest 6) resumes from 3 and
    continues exactly as the straight run; a tag it does not hold is one line naming what it holds."""
    import shutil

    both = tmp_path / "both"
    shutil.copytree(straight["save"], both)
    shutil.copytree(half["save"] / "global_step3", both / "global_step3")
    assert (both / "latest").read_text().strip() == "global_step6"
    before = tree_digest(both)
    resumed = forked(3, *STRAIGHT, "--load", str(both), "--load-tag", "global_step3")
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout and "at iteration 3" in resumed.stdout
    assert {**half["losses"], **losses(resumed.stdout)} == straight["losses"]
    assert tree_digest(both) == before  # no --save: the source is untouched
    out = single(*BASE, "--mock-data", "--vocab-size", "128", "--load", str(both), "--load-tag", "global_step4")
    assert_one_line_error(out, "--load-tag global_step4:", "(its last: global_step3, global_step6)")


def test_whole_state_resumes_into_another_layout(straight: dict, half: dict) -> None:
    """Saved at P=3 with dedicated stages, resumed at P=4 with the stock split: optimizer, schedule,
    data position and dropout continue, so iterations 4-6 print the straight run's losses (to the
    printed digits, within the 1e-6 of another layout's summation order)."""
    moved = forked(4, *MODEL, *TRAIN, "--pipeline-model-parallel-size", "4", "--load", str(half["save"]))
    assert moved.returncode == 0, moved.stdout[-4000:]
    assert "resuming the whole training state through its universal form" in moved.stdout
    assert "transformer layers per stage: 1 1 1 1" in moved.stdout
    got = losses(moved.stdout)
    assert sorted(got) == [4, 5, 6], moved.stdout[-3000:]
    assert all(abs(float(got[i]) - float(straight["losses"][i])) <= 2e-6 for i in got), (got, straight["losses"])
    test_loss = float(TEST_LOSS.search(moved.stdout).group(1))
    assert abs(test_loss - float(TEST_LOSS.search(straight["out"]).group(1))) <= 2e-6


VALID_LOSS = re.compile(r"validation loss at iteration \d+ \| lm loss value: [0-9.E+-]+")


def test_skip_train_evaluates_the_loaded_checkpoint_and_writes_nothing(straight: dict, tmp_path: Path) -> None:
    """--skip-train --load (both upstreams' evaluation-only run): no training step and no save, then exactly the
    straight run's final validation and test losses at its iteration 6 (its checkpoint was saved before them, so
    the same validation batches are drawn); the checkpoint is untouched, and --save gets nothing."""
    before, save = tree_digest(straight["save"]), tmp_path / "save"
    out = forked(3, *STRAIGHT, "--load", str(straight["save"]), "--skip-train", "--save", str(save))
    assert out.returncode == 0, out.stdout[-4000:]
    assert "skipping training (--skip-train is on) ..." in out.stdout
    assert not losses(out.stdout), out.stdout[-3000:]  # no training log line
    for pattern in (VALID_LOSS, TEST_LOSS):
        mine, theirs = pattern.search(out.stdout), pattern.search(straight["out"])
        assert mine is not None and theirs is not None, out.stdout[-3000:]
        assert mine.group(0) == theirs.group(0)
    assert tree_digest(straight["save"]) == before and not (save.exists() and any(save.iterdir()))


def test_resume_with_another_dropout_prints_a_notice(straight: dict) -> None:
    """Dropout and init std are not architecture: another value resumes, rank 0 says what changed."""
    model = [a if a != "0.1" else "0.0" for a in MODEL]  # --hidden-dropout and --attention-dropout 0.0
    train = [*TRAIN[: TRAIN.index("--train-iters") + 1], "7", *TRAIN[TRAIN.index("--train-iters") + 2 :]]
    out = single(*model, *train, "--init-method-std", "0.01", "--load", str(straight["save"]), "--no-load-optim")
    assert out.returncode == 0, out.stderr[-3000:]
    notices = [ln for ln in out.stdout.splitlines() if ln.startswith("NOTICE: ")]
    assert notices == [
        f"NOTICE: --load {straight['save']} (global_step6): regularization differs from the checkpoint's: "
        "hidden_dropout 0.1 -> 0.0; attention_dropout 0.1 -> 0.0; init_method_std 0.02 -> 0.01",
        f"NOTICE: --no-load-optim: --load {straight['save']} (global_step6)'s weights, iteration and consumed "
        "samples are loaded, its optimizer and learning-rate schedule are not (Megatron-DeepSpeed's DeepSpeed path "
        "would load them anyway)",
        MDS_RULES_NOTICE,
    ]
    assert "iteration        7/       7" in out.stdout


def single(*argv: str) -> subprocess.CompletedProcess:
    """`python pretrain_gpt.py argv...`, forked from the script server (`megatron_ds.testing.script_runs`)."""
    return run_python([str(ROOT / "pretrain_gpt.py"), *argv], timeout=180, cwd=ROOT)


def assert_one_line_error(out: subprocess.CompletedProcess, *needles: str) -> None:
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, out.stderr[-3000:]
    for n in needles:
        assert n in errors[0], errors[0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from megatron_ds.data.demo_corpus import prepare_demo_data

    demo = prepare_demo_data(str(tmp_path_factory.mktemp("demo")), vocab_size=300, max_bytes=200_000, quiet=True)
    return {"model": demo.tokenizer_model, "prefix": demo.data_prefix}


def data_args(corpus: dict, prefix: str | None = None, model: str | None = None) -> list[str]:
    return [
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        model or corpus["model"],
        "--data-path",
        prefix or corpus["prefix"],
        "--split",
        "90,9,1",
    ]


BASE = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--train-iters",
    "2",
    "--lr",
    "1e-3",
]


def test_missing_data_prefix(corpus: dict, tmp_path: Path) -> None:
    assert_one_line_error(
        single(*BASE, *data_args(corpus, prefix=str(tmp_path / "nothing"))), "--data-path", str(tmp_path / "nothing")
    )


def test_truncated_bin_and_corrupt_idx(corpus: dict, tmp_path: Path) -> None:
    src = Path(corpus["prefix"])
    for kind in ("bin", "idx"):
        bad = tmp_path / f"bad_{kind}"
        for ext in ("bin", "idx"):
            data = Path(f"{src}.{ext}").read_bytes()
            if ext == kind:
                data = data[: len(data) // 2] if kind == "bin" else b"garbage!" + data[8:]
            Path(f"{bad}.{ext}").write_bytes(data)
        assert_one_line_error(single(*BASE, *data_args(corpus, prefix=str(bad))), f"{bad}.{kind}")


def test_missing_tokenizer_and_vocab_too_small(corpus: dict, tmp_path: Path) -> None:
    assert_one_line_error(
        single(*BASE, *data_args(corpus, model=str(tmp_path / "none.model"))), "--tokenizer-model", "none.model"
    )
    assert_one_line_error(single(*BASE, "--vocab-size", "100", *data_args(corpus)), "300 tokens", "--vocab-size is 100")


def test_a_corpus_of_another_tokenizer_stops_at_its_first_sample(corpus: dict) -> None:
    """The demo corpus (a 300-piece SentencePiece model) trained with a 120-piece one: its ids past 119 reached the
    embedding, an IndexError traceback at the first forward."""
    other = str(ROOT / "tests" / "fixtures" / "megatron_deepspeed" / "sp.model")
    out = single(*BASE, "--eval-iters", "0", *data_args(corpus, model=other))
    assert_one_line_error(
        out, f"{corpus['prefix']}: train sample ", "outside the vocabulary's 120 ids", "another tokenizer"
    )


def test_one_ranks_bad_sample_stops_both_data_parallel_ranks_with_one_line_each(tmp_path: Path) -> None:
    """Only rank 1 reads the sample holding id 500 (--vocab-size 100): both ranks stop after that step with its
    line and status 2, none is stranded in the gradient all-reduce (a 'Connection closed by peer' traceback)."""
    import numpy as np

    from megatron_ds.data.indexed import write_indexed_dataset

    rng = np.random.default_rng(0)
    docs = [list(rng.integers(0, 99, rng.integers(5, 30))) + [99] for _ in range(60)]
    docs[30][2] = 500
    write_indexed_dataset(str(tmp_path / "onebad"), docs, 1000)
    line = [*BASE, "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "60", "--eval-iters", "0"]
    line += ["--log-interval", "100", "--split", "100,0,0", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    out = pretrain(2, *line, "--data-path", str(tmp_path / "onebad"), "--data-cache-path", str(tmp_path / "cache"))
    stopped = re.findall(r"\[rank (\d)\] error: (.*)", out.stdout)
    assert sorted(r for r, _ in stopped) == ["0", "1"], out.stdout[-4000:]
    assert len({m for _, m in stopped}) == 1 and "holds token id 500, outside the vocabulary's 100 ids" in stopped[0][1]
    ours = [f'File "{ROOT / "megatron_ds"}', 'pretrain_gpt.py", line', "Connection closed"]  # torchrun has its own
    assert not any(frame in out.stdout for frame in ours) and out.returncode not in (0, -9), out.stdout[-4000:]
    assert_every_rank_left_with_2(out)


def test_bad_checkpoint_dirs_leave_checkpoints_intact(straight: dict, tmp_path: Path) -> None:
    before = tree_digest(straight["save"])
    assert_one_line_error(
        single(*BASE, "--mock-data", "--vocab-size", "128", "--save", "/etc/passwd/sub"),
        "--save /etc/passwd/sub",
        "/etc/passwd is a file, not a directory",
    )
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert_one_line_error(
        single(*BASE, "--mock-data", "--vocab-size", "128", "--load", str(tmp_path)),
        f"--load {tmp_path}: no checkpoint (no 'latest' file) but it holds notes.txt",
    )
    other_arch = [
        "--num-layers",
        "4",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--vocab-size",
        "128",
        "--train-iters",
        "8",
        "--lr",
        "1e-3",
        "--mock-data",
    ]
    out = single(*other_arch, "--load", str(straight["save"]), "--save", str(straight["save"]))
    assert_one_line_error(out, "another architecture", "hidden_size 32 (checkpoint) vs 64 (now)")
    assert tree_digest(straight["save"]) == before


def test_load_optional_is_accepted_and_the_first_launch_starts_with_a_notice(tmp_path: Path) -> None:
    """--load-optional (0.1.0's flag) is now what every first launch does; it is still accepted."""
    out = single(
        *BASE,
        "--mock-data",
        "--vocab-size",
        "128",
        "--load",
        str(tmp_path / "new"),
        "--load-optional",
        "--save",
        str(tmp_path / "new"),
        "--eval-iters",
        "0",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"NOTICE: --load {tmp_path / 'new'} holds no checkpoint yet: starting from scratch" in out.stdout
    assert (tmp_path / "new" / "latest").read_text() == "global_step2"


def test_contradicting_deepspeed_config_fails_before_any_process_group(tmp_path: Path) -> None:
    clash = tmp_path / "ds.json"
    clash.write_text('{"train_micro_batch_size_per_gpu": 4}')
    out = single(*BASE, "--mock-data", "--vocab-size", "128", "--deepspeed_config", str(clash))
    assert_one_line_error(out, f"--deepspeed_config {clash}", "train_micro_batch_size_per_gpu=4")
    assert "stage=0" not in out.stdout  # the layout table is printed once the process group exists


COMPUTE = re.compile(
    r"\[Rank (\d) \| stage (\d)\] compute per step \(CPU time, ms, median of (\d+) step\(s\)\) \| forward: ([\d.]+) \| "
    r"backward: ([\d.]+) \| optimizer: ([\d.]+) \| total: ([\d.]+) \| not computing \(wall, ms\): (-?[\d.]+), of "
    r"which send/recv/reduce: ([\d.]+) \| step \(wall, ms\): ([\d.]+)"
)
SIMULATED = re.compile(
    r"1F1B step from these compute times with one device per stage \(schedule simulator\): ([\d.]+) ms = "
    r"([\d.]+) x the ideal ([\d.]+) ms .*; slowest stage computes ([\d.]+) ms"
)


def test_straight_run_reports_stage_compute_apart_from_waiting(straight: dict) -> None:
    """training/measure/stage_timers.py on a 3-rank run: each stage's compute (CPU time) per step, the time it
    spends not computing, and the simulated 1F1B step from those times; the log line's TFLOP/s."""
    from megatron_ds.estimate.compute import model_flops_per_iteration
    from megatron_ds.estimate.step_simulator import simulate
    from megatron_ds.flags.parser import parse_config

    text = straight["out"]
    rows = {int(m.group(2)): [float(x) for x in m.groups()[3:]] for m in COMPUTE.finditer(text)}
    assert sorted(rows) == [0, 1, 2], text[-3000:]
    for fwd, bwd, opt, total, waiting, comm, step in rows.values():
        assert fwd > 0 and bwd > 0 and opt > 0 and total == pytest.approx(fwd + bwd + opt, abs=0.15)
        assert 0 <= comm <= waiting + 0.1 and waiting < step  # waiting is the step's wall time outside compute
    sim = SIMULATED.search(text)
    assert sim, text[-3000:]
    step, _, _, slowest = (float(x) for x in sim.groups())
    assert slowest == pytest.approx(max(r[3] for r in rows.values()), abs=0.15)
    assert step >= slowest - 0.1  # no stage can finish before its own compute
    m = 4  # global batch 8 / micro-batch 2
    again = simulate(
        m, [rows[s][0] / m for s in range(3)], [rows[s][1] / m for s in range(3)], [rows[s][2] for s in range(3)]
    )
    assert again.step_time == pytest.approx(step, rel=0.02, abs=0.3)  # from the printed (rounded) times
    # Megatron-LM's throughput: the model's FLOPs per iteration over the iteration time and the 3 ranks.
    line = next(ln for ln in text.splitlines() if "iteration        6/       6" in ln)
    ms = float(re.search(r"elapsed time per iteration \(ms\): ([\d.]+)", line).group(1))
    tflops = float(re.search(r"throughput per GPU \(TFLOP/s/GPU\): ([\d.e+-]+)", line).group(1))
    model = parse_config([*MODEL, "--print-layout"])[0].model
    flops = model_flops_per_iteration(model, 8)
    assert tflops == pytest.approx(flops / (ms / 1e3 * 3) / 1e12, rel=0.01)
    assert "MFU" not in line  # no peak known on CPU


def test_a_nan_step_stops_every_stage_before_saving(tmp_path: Path) -> None:
    """--lr 1e30 leaves step 1's weights so large that step 2's loss is NaN: both pipeline stages stop at iteration 2
    with one line each and no traceback, the checkpoint of iteration 1 stays the latest (Megatron-LM's
    --check-for-nan-in-loss-and-grad, on by default)."""
    save, tb = tmp_path / "ckpt", tmp_path / "tb"
    flags = [*MODEL, *TRAIN, "--pipeline-model-parallel-size", "2", "--lr", "1e30", "--lr-warmup-iters", "0"]
    if tensorboard_available():
        flags += ["--tensorboard-dir", str(tb)]
    out = pretrain(2, *flags, "--eval-iters", "0", "--save", str(save), "--save-interval", "1")
    assert out.returncode not in (0, -9), out.stdout[-4000:]
    ours = [f'File "{ROOT / "megatron_ds"}', 'pretrain_gpt.py", line']  # torchrun prints its own traceback
    assert not any(frame in out.stdout for frame in ours), out.stdout[-4000:]
    stopped = re.findall(
        r"\[rank (\d)\] error: iteration 2: lm loss nan and grad norm nan; the run stops here", out.stdout
    )
    assert sorted(stopped) == ["0", "1"], out.stdout[-4000:]
    assert "--no-check-for-nan-in-loss-and-grad to train on" in out.stdout
    assert_every_rank_left_with_2(out)  # a stage aborted while finalising in a few launches in 100 (SIGABRT)
    assert (save / "latest").read_text().strip() == "global_step1" and not (save / "global_step2").exists()
    if tensorboard_available():  # the scalars up to the stop are on disk
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tb))
        events.Reload()
        assert [e.step for e in events.Scalars("lm-loss-training/lm loss")] == [1]


def test_the_kill_switch_file_saves_and_stops_every_stage(tmp_path: Path) -> None:
    """Megatron-DeepSpeed's --kill-switch-file: created while 2 stages train (once the first --save-interval
    checkpoint exists), both stop at the same iteration, save it and exit 0; present at the next launch, it exits
    before the first step without writing anything."""
    import threading
    import time

    save, switch = tmp_path / "ckpt", tmp_path / "STOP"
    flags = [*MODEL, *TRAIN, "--pipeline-model-parallel-size", "2", "--train-iters", "100000", "--eval-iters", "0"]
    flags += ["--log-interval", "1000", "--save", str(save), "--save-interval", "5", "--kill-switch-file", str(switch)]

    def touch_after_first_save() -> None:
        deadline = time.monotonic() + 200
        while not (save / "latest").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        switch.touch()

    watcher = threading.Thread(target=touch_after_first_save, daemon=True)
    watcher.start()
    out = forked(2, *flags)
    watcher.join()
    assert out.returncode == 0, out.stdout[-4000:]
    stops = re.findall(r"exiting at iteration (\d+): found --kill-switch-file", out.stdout)
    assert len(stops) == 1 and int(stops[0]) >= 5, out.stdout[-4000:]  # rank 0 speaks for both
    assert (save / "latest").read_text().strip() == f"global_step{stops[0]}"
    before = tree_digest(save)
    again = forked(2, *flags, "--load", str(save))
    assert again.returncode == 0 and f"exiting at iteration {stops[0]}: found --kill-switch-file" in again.stdout
    assert tree_digest(save) == before  # nothing trained, nothing written


def test_deterministic_mode_trains_and_refuses_a_non_deterministic_nccl_algorithm(tmp_path: Path) -> None:
    """Megatron-LM's --deterministic-mode: every operation of a rotary/SwiGLU/RMSNorm step with recomputation has a
    deterministic kernel on CPU (torch raises otherwise); NCCL_ALGO=Tree is refused before launch."""
    flags = [*BASE, "--mock-data", "--vocab-size", "128", "--deterministic-mode", "--eval-iters", "0"]
    flags += ["--use-rotary-position-embeddings", "--swiglu", "--normalization", "rmsnorm", "--checkpoint-activations"]
    out = single(*flags)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    tree = run_python(  # NCCL_ALGO is read at launch, not at import: the server's imports are the same
        [str(ROOT / "pretrain_gpt.py"), *flags], timeout=180, cwd=ROOT, env={**os.environ, "NCCL_ALGO": "Tree"}
    )
    assert_one_line_error(tree, "--deterministic-mode with NCCL_ALGO='Tree'")


def test_save_retain_interval_keeps_the_multiples_and_the_last(tmp_path: Path) -> None:
    """Megatron-LM's --save-retain-interval 4 with --save-interval 2 over 7 iterations: saves at 2, 4, 6 and 7 leave
    4 (a multiple) and 7 (the last), as Megatron-LM's deletion of the previous checkpoint after each save does."""
    save = tmp_path / "ckpt"
    flags = [*BASE, "--mock-data", "--vocab-size", "128", "--train-iters", "7", "--eval-iters", "0"]
    out = single(*flags, "--save", str(save), "--save-interval", "2", "--save-retain-interval", "4")
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.name for p in save.iterdir()) == ["global_step4", "global_step7", "latest"]
    assert out.stdout.count("deleted checkpoint") == 2


def test_log_progress_appends_megatron_lms_lines_across_a_resume(tmp_path: Path) -> None:
    """Megatron-LM's --log-progress: a job stopped at 4 (--exit-interval) and resumed to 6 leave two job starts and
    saves at 2, 4 and 6 whose FLOPs are those iterations' model FLOPs (the count survives the resume)."""
    from megatron_ds.estimate.compute import model_flops_per_iteration
    from megatron_ds.flags.parser import parse_config

    save = tmp_path / "ckpt"
    flags = [*BASE, "--mock-data", "--vocab-size", "128", "--train-iters", "6", "--eval-iters", "0"]
    flags += ["--save", str(save), "--save-interval", "2", "--log-progress", "--global-batch-size", "2"]
    first = single(*flags, "--exit-interval", "4")
    second = single(*flags, "--load", str(save))
    assert first.returncode == 0 and second.returncode == 0, (first.stderr + second.stderr)[-3000:]
    lines = [ln.split("\t") for ln in (save / "progress.txt").read_text().splitlines()]
    assert [f[3] for f in lines] == [
        "Starting job",
        "Saved checkpoint",
        "Saved checkpoint",
        "Starting job",
        "Saved checkpoint",
    ]
    assert all(f[2] == "# GPUs: 1" for f in lines)
    per_step = model_flops_per_iteration(parse_config(flags)[0].model, 2)
    saves = [f for f in lines if f[3] == "Saved checkpoint"]
    assert [f[4] for f in saves] == ["Iteration: 2", "Iteration: 4", "Iteration: 6"]
    assert [float(f[7].split(": ")[1]) for f in saves] == pytest.approx(
        [2 * per_step, 4 * per_step, 6 * per_step], rel=1e-2
    )
    assert all(f[5].startswith("Job throughput: ") and f[6].startswith("Cumulative throughput: ") for f in saves)


STUB_TENSORBOARD = """
import json, runpy, sys, types
import megatron_ds.training.logger
out = open(sys.argv[1], "w")
class SummaryWriter:  # tensorboard is an optional extra: a stub records the writes
    def __init__(self, log_dir=None, max_queue=None): pass
    def add_scalar(self, tag, value, step): out.write(json.dumps([tag, step, float(value)]) + "\\n")
    def flush(self): out.flush()
    def close(self): out.close()
module = types.ModuleType("torch.utils.tensorboard")
module.SummaryWriter = SummaryWriter
sys.modules["torch.utils.tensorboard"] = module
megatron_ds.training.logger.tensorboard_available = lambda: True
sys.argv = ["pretrain_gpt.py", *sys.argv[2:]]
runpy.run_path("pretrain_gpt.py", run_name="__main__")
"""


def test_tensorboard_gets_each_iterations_values_every_tensorboard_log_interval(tmp_path: Path) -> None:
    """As Megatron's training_log: the iteration's own loss, lr, grad norm and params norm every
    --tensorboard-log-interval iterations (default 1), the window's throughput with the log line (--log-interval)."""
    writes = tmp_path / "scalars.jsonl"
    flags = [*BASE, "--mock-data", "--vocab-size", "128", "--train-iters", "6", "--eval-iters", "0", "--no-log-memory"]
    flags += ["--tensorboard-dir", str(tmp_path / "tb"), "--log-interval", "3", "--log-params-norm"]
    out = run_python(
        ["-c", STUB_TENSORBOARD, str(writes), *flags, "--tensorboard-log-interval", "2"], timeout=180, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    steps: dict[str, list[int]] = {}
    for tag, step, _ in map(json.loads, writes.read_text().splitlines()):
        steps.setdefault(tag, []).append(step)
    for tag in ("lm-loss-training/lm loss", "learning-rate/learning-rate", "grad-norm/grad-norm"):
        assert steps[tag] == [2, 4, 6], tag
    assert steps["params-norm/params-norm"] == [2, 4, 6]
    assert steps["throughput/tokens-per-second"] == [3, 6]
