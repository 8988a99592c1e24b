"""Ranks forked from one zygote (`start_ranks(..., preload=...)`) behave as ranks started one by one: their
own RANK, output and exit status; a stalled rank is named with its stack; a zygote that cannot import fails
fast with its error."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from megatron_ds.testing.launch import RanksFailed, run_ranks, start_ranks

PROGRAM = """
import faulthandler, gc, os, signal, sys, time
faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
rank = int(os.environ["RANK"])
print(f"rank {rank} of {os.environ['WORLD_SIZE']} args {sys.argv[1:]} main {__name__}")
print(f"frozen objects {gc.get_freeze_count()}")

def wait_for_ever():
    while True:
        time.sleep(0.1)

mode = sys.argv[1]
if mode == "fail" and rank == 1:
    sys.exit(3)
if (mode == "stall" and rank == 1) or mode == "stall_all":
    wait_for_ever()
if mode == "raise" and rank == 0:
    raise RuntimeError("boom on rank 0")
"""


@pytest.fixture
def program(tmp_path: Path) -> str:
    (tmp_path / "rank_program.py").write_text(PROGRAM)
    return str(tmp_path)


def test_each_rank_has_its_own_rank_output_and_status(program: str) -> None:
    results = run_ranks(["-m", "rank_program", "ok"], 3, timeout=60, cwd=program, preload=("json",))
    assert [r.returncode for r in results] == [0, 0, 0]
    for r in results:
        assert f"rank {r.rank} of 3 args ['ok'] main __main__" in r.output
        # what the zygote imported is out of the garbage collector's walk (DeepSpeed's explicit collections)
        assert int(re.search(r"frozen objects (\d+)", r.output).group(1)) > 1000, r.output


def test_a_failing_rank_is_named_with_its_status(program: str) -> None:
    with pytest.raises(RanksFailed, match=r"rank 1 exited 3"):
        run_ranks(["-m", "rank_program", "fail"], 2, timeout=60, cwd=program, preload=("json",))
    results = run_ranks(["-m", "rank_program", "raise"], 2, timeout=60, cwd=program, preload=("json",), check=False)
    assert [r.returncode for r in results] == [1, 0]
    assert "RuntimeError: boom on rank 0" in results[0].output


def test_a_stalled_rank_is_named_with_its_stack_and_killed(program: str) -> None:
    start = time.monotonic()
    with pytest.raises(RanksFailed) as err:
        run_ranks(["-m", "rank_program", "stall"], 2, timeout=6, cwd=program, preload=("json",))
    assert time.monotonic() - start < 30
    text = str(err.value)
    assert "rank 1 stalled (no exit within 6s)" in text
    assert "wait_for_ever" in text  # the stack dumped on SIGUSR1
    assert "rank 0" not in text  # rank 0 finished


def test_signals_reach_every_rank_once(program: str) -> None:
    ranks = start_ranks(["-m", "rank_program", "stall_all"], 2, cwd=program, preload=("json",))
    deadline = time.monotonic() + 30
    while not all(f"rank {r} of 2" in ranks.output(r) for r in range(2)) and time.monotonic() < deadline:
        time.sleep(0.1)
    ranks.signal(2)  # SIGINT, as Ctrl-C: each stalled rank stops with one KeyboardInterrupt
    results = ranks.finish(timeout=30, check=False)
    for r in results:
        assert r.returncode == 1 and r.output.count("KeyboardInterrupt") == 1, r.output


def test_a_zygote_that_cannot_import_fails_fast_with_its_error(program: str) -> None:
    start = time.monotonic()
    with pytest.raises(RanksFailed, match=r"ModuleNotFoundError: No module named 'no_such_module'"):
        run_ranks(["-m", "rank_program", "ok"], 2, timeout=60, cwd=program, preload=("no_such_module",))
    assert time.monotonic() - start < 30


def test_py_cpuinfo_is_asked_once_for_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    import cpuinfo

    from megatron_ds.testing.zygote import answer_cpu_info_once

    asked = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: asked.append(1) or {"vendor_id_raw": "GenuineIntel"})
    answer_cpu_info_once()
    assert cpuinfo.get_cpu_info() == cpuinfo.get_cpu_info() == {"vendor_id_raw": "GenuineIntel"}
    assert len(asked) == 1


def test_every_launcher_forks_from_the_one_preload() -> None:
    """Scenarios, pretrain_gpt.py lines, scripts and Megatron-LM's own training all ask for the same imports, so
    the servers of one environment serve them all (per-launcher lists made the servers take turns)."""
    from megatron_ds.testing import megatron_lm_checkpoints, pretrain_runs, scenario_runs, script_runs
    from megatron_ds.testing.zygote import RUN_PRELOAD

    for launcher in (scenario_runs, pretrain_runs, script_runs, megatron_lm_checkpoints):
        assert launcher.RUN_PRELOAD is RUN_PRELOAD, launcher.__name__
        assert "PRELOAD" not in vars(launcher) and "preload_for" not in vars(launcher), launcher.__name__
    assert "deepspeed.runtime.zero.muon.muon_optimizer" in RUN_PRELOAD  # each ZeRO or bf16 rank's first engine


HEAVY = ("deepspeed.runtime.zero.muon", "torch._inductor", "megatron.core")


def test_a_zero_rank_imports_nothing_heavy_after_the_fork(tmp_path: Path) -> None:
    """A ZeRO-1 scenario's ranks find DeepSpeed's Muon (2-3 s: its `torch.compile` imports torch's inductor), torch's
    inductor and megatron-core already imported; what they still import is small (DeepSpeed's expert-parallel
    presets, distutils: 0.03 s)."""
    from megatron_ds.testing.scenario_runs import run_scenarios

    sc = {"overrides": {"model__num_layers": 1, "training__zero_stage": 1}, "steps": 1, "report_new_modules": True}
    ranks = run_scenarios(tmp_path, 2, [sc], timeout=120)
    for (result,) in ranks:
        assert not [m for m in result["new_modules"] if m.startswith(HEAVY)], result


PROBE = """
import os
IMPORTED_IN, PROBE_AT_IMPORT = os.getpid(), os.environ.get("FORK_SERVER_PROBE")
"""
REPORT = """
import os, probe
print("server", probe.IMPORTED_IN, "probe", probe.PROBE_AT_IMPORT, "rank", os.environ["RANK"], "pid", os.getpid())
"""


def test_runs_share_a_server_per_imports_and_environment(tmp_path: Path) -> None:
    """Launches that differ only in what each run sets for itself (the port) fork from one server, which imported
    `preload` once; a variable read at import gives its own server, so the run sees it as a fresh interpreter would."""
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "report.py").write_text(REPORT)
    env = {"PYTHONPATH": str(tmp_path)}

    def run(probe: str) -> list[list[str]]:
        results = run_ranks(
            ["-m", "report"], 2, 60, cwd=str(tmp_path), env={**env, "FORK_SERVER_PROBE": probe}, preload=("probe",)
        )
        return [r.output.split() for r in results]

    first, second, other = run("a"), run("a"), run("b")
    assert first[0][1] == first[1][1] == second[0][1] != other[0][1]  # the importing process
    assert {first[0][3], other[0][3]} == {"a", "b"}
    assert len({line[7] for line in first + second}) == 4  # each rank its own process


def test_a_run_outlives_its_servers_eviction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The least recently used server leaves when another starts, after its last run: that run still reports."""
    from megatron_ds.testing import fork_server

    (tmp_path / "slow.py").write_text("import time, sys; time.sleep(3); sys.exit(4)")
    monkeypatch.setattr(fork_server, "MAX_SERVERS", 1)
    slow = start_ranks(["-m", "slow"], 2, cwd=str(tmp_path), preload=("json",))
    quick = run_ranks(["-m", "slow"], 1, 60, cwd=str(tmp_path), preload=("csv",), check=False)
    assert [r.returncode for r in quick] == [4]
    assert [r.returncode for r in slow.finish(timeout=60, check=False)] == [4, 4]
