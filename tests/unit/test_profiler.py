"""`--profile`'s two profilers: Megatron-LM's bare flag and Megatron-DeepSpeed's `--profile pt|pt-full` over
`--profile_steps S,E` (steps of this process, the trace in --tensorboard-dir under torch's handler's name)."""

from __future__ import annotations

import gzip
import json
import os
import re
import socket
from pathlib import Path

import pytest
import torch

from megatron_ds.errors import ConfigError
from megatron_ds.flags.parser import parse_config
from megatron_ds.testing.scenario import tiny_config
from megatron_ds.training.housekeeping import Profiler, PtProfiler, build_profiler

BASE = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--vocab-size", "128", "--train-iters", "10", "--lr", "1e-3",
]  # fmt: skip


def parse(*argv: str):
    return parse_config([*BASE, *argv], world_size=1)[0]


def error(*argv: str) -> str:
    with pytest.raises(ConfigError) as err:
        parse(*argv)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_profile_takes_megatron_deepspeeds_values_and_keeps_megatron_lms_bare_switch(
    capsys: pytest.CaptureFixture,
) -> None:
    lg = parse("--profile", "pt", "--tensorboard-dir", "tb").logging
    assert (lg.profile, lg.profile_pt, lg.profile_steps) == (False, "pt", (2, 3))  # upstream's default 2,3
    lg = parse("--profile", "pt-full", "--profile_steps", "4,6", "--tensorboard-dir", "tb").logging
    assert (lg.profile, lg.profile_pt, lg.profile_steps) == (False, "pt-full", (4, 6))
    lg = parse("--profile").logging
    assert (lg.profile, lg.profile_pt) == (True, None)
    assert parse().logging.profile_pt is None and not parse().logging.profile
    assert parse("--profile", "pt", "--tensorboard-dir", "tb").data.data_upstream == "megatron-deepspeed"
    assert capsys.readouterr().err == ""


PT = ["--profile", "pt", "--tensorboard-dir", "tb"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--profile", "pt"], "--profile pt writes its trace into --tensorboard-dir, as Megatron-DeepSpeed does; add"),
        ([*PT, "--profile_steps", "3"], "--profile_steps '3' is not two step numbers; give the first and last step as"),
        (["--profile_steps", "2,x"], "--profile_steps '2,x' is not two step numbers"),  # malformed without pt too
        ([*PT, "--profile_steps", "0,2"], "--profile_steps 0,2: a process's steps count from 1, so step 0 never comes"),
        ([*PT, "--profile_steps", "3,2"], "--profile_steps 3,2: the last step 2 comes before the first 3; give S,E"),
        (["--profile", "full"], "argument --profile: invalid choice: 'full' (choose from 'pt', 'pt-full')"),
    ],
    ids=["no-tensorboard-dir", "one-number", "not-a-number", "step-0", "end-before-start", "unknown-mode"],
)
def test_profiler_flag_errors_are_one_line(argv: list[str], message: str) -> None:
    assert error(*argv).startswith(message)


def test_without_tensorboard_installed_the_launch_error_does_not_offer_dropping_the_dir(monkeypatch) -> None:
    from megatron_ds.training import launch_checks, logger

    monkeypatch.setattr(logger, "tensorboard_available", lambda: False)
    with pytest.raises(ConfigError, match=r"\(--profile pt-full writes its trace there too\)$"):
        launch_checks.check_logging(parse("--profile", "pt-full", "--tensorboard-dir", "tb"))
    with pytest.raises(ConfigError, match="or drop the flag$"):
        launch_checks.check_logging(parse("--tensorboard-dir", "tb"))


def test_range_flags_of_the_other_profiler_are_ignored_with_a_warning(capsys: pytest.CaptureFixture) -> None:
    assert parse("--profile_steps", "4,5").logging.profile_steps == (4, 5)
    assert "WARNING: --profile_steps 4,5 applies to --profile pt or pt-full; ignored without them" in (
        capsys.readouterr().err
    )
    parse("--profile", "pt", "--tensorboard-dir", "tb", "--profile-step-start", "1", "--use-pytorch-profiler")
    assert (
        "WARNING: --profile-step-start, --use-pytorch-profiler apply to Megatron-LM's bare --profile; --profile pt "
        "traces --profile_steps 2,3; ignored"
    ) in capsys.readouterr().err


def _run(tmp_path: Path, mode: str, num_steps: int, rank: int = 0, **logging: object) -> tuple[list, PtProfiler]:
    """Drives the profiler over `num_steps` steps of a resumed run (100 iterations done) with a matmul in each;
    returns, per step, (the path after_step returned, the files in the TensorBoard dir then)."""
    fields = {"profile_pt": mode, "tensorboard_dir": str(tmp_path), **logging}
    config = tiny_config(**{f"logging__{k}": v for k, v in fields.items()})
    prof = build_profiler(config, rank)
    assert isinstance(prof, PtProfiler)
    seen = []
    for step in range(num_steps):
        prof.before_step(100 + step)
        torch.ones(8, 8) @ torch.ones(8, 8)
        seen.append((prof.after_step(101 + step), sorted(p.name for p in tmp_path.iterdir())))
    return seen, prof


def _events(path: str) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


@pytest.mark.parametrize("mode", ["pt", "pt-full"])
def test_pt_writes_one_trace_at_the_end_of_step_e_of_this_process(tmp_path: Path, mode: str) -> None:
    seen, _ = _run(tmp_path, mode, 4, profile_steps=(2, 3))
    assert [s[0] for s in seen[:2]] == [None, None] and seen[0][1] == seen[1][1] == []
    path, files = seen[2]
    assert files == [Path(path).name] and Path(path).parent == tmp_path and seen[3] == (None, files)
    # torch's tensorboard_trace_handler(dir, use_gzip=True) names it so
    assert re.fullmatch(rf"{re.escape(socket.gethostname())}_{os.getpid()}\.\d+\.pt\.trace\.json\.gz", files[0])
    events = _events(path)
    assert sum(e.get("name") == "aten::mm" for e in events) == 2  # the matmuls of steps 2 and 3
    # pt-full: with_stack adds the Python frames, this test's among them
    python = [e["name"] for e in events if e.get("cat") == "python_function"]
    assert any(Path(__file__).name in name for name in python) == (mode == "pt-full")
    assert bool(python) == (mode == "pt-full")


def test_pt_on_other_ranks_or_stopped_inside_the_range_writes_nothing(tmp_path: Path) -> None:
    seen, prof = _run(tmp_path, "pt", 3, rank=1, profile_steps=(1, 2), profile_ranks=(0,))
    assert not prof.on and all(s == (None, []) for s in seen)
    seen, prof = _run(tmp_path, "pt", 2, profile_steps=(2, 3))
    assert prof._prof is not None  # inside the range when training ends
    prof.close()
    assert prof._prof is None and list(tmp_path.iterdir()) == []


def test_the_bare_flag_keeps_megatron_lms_profiler() -> None:
    config = tiny_config(logging__profile=True)
    assert type(build_profiler(config, 0)) is Profiler and type(build_profiler(tiny_config(), 0)) is Profiler
