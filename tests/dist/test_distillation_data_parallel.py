"""--kd on 2 data-parallel ranks equals the single-process run (lm loss, kd loss and gradient norm within 1e-6,
fp32, dropout on in the student, clipping active), and distilling changes the student's training.

Launch 1 (one rank): a 4-layer teacher trains 2 steps and saves; a 2-layer student distils from it (T = 2,
beta = 0.5) for 3 steps, and the same student trains without --kd. Launch 2 (two ranks, DP = 2): the student
distils from the same teacher.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ds.testing.scenario_runs import by_name, run_scenarios

TOL = 1e-6
STUDENT = {
    "model__num_layers": 2,
    "regularization__hidden_dropout": 0.1,
    "regularization__attention_dropout": 0.1,
}


def kd(teacher: str, student: dict | None = None, weights: bool = False, **parallel: object) -> dict:
    """A student (`STUDENT` unless given) distilling 3 steps from `teacher` (temperature 2, beta 0.5) under the
    `parallel__` fields given; `weights`: its final weights recorded."""
    return {
        "overrides": {
            **(STUDENT if student is None else student),
            **{f"parallel__{k}": v for k, v in parallel.items()},
            "distillation__kd": True,
            "distillation__load_teacher": teacher,
            "distillation__kd_temp": 2.0,
            "distillation__kd_beta_ce": 0.5,
        },
        "steps": 3,
        "weights": weights,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    root = tmp_path_factory.mktemp("kd")
    teacher = str(root / "teacher")
    one = run_scenarios(
        root / "w1",
        1,
        [{"overrides": {}, "steps": 2, "save": teacher}, kd(teacher), {"overrides": STUDENT, "steps": 3}],
        timeout=120,
    )
    two = run_scenarios(root / "w2", 2, [kd(teacher)], timeout=120)
    return by_name(["teacher", "kd", "plain"], one), by_name(["kd"], two)


def test_two_data_parallel_ranks_equal_one_process(runs: tuple[dict, dict]) -> None:
    one, two = runs
    (ref,) = one["kd"]
    assert ref["engine"] == "PlainEngine"
    kd_ref = [o["kd loss"] for o in ref["other_losses"]]
    assert all(k > 0 for k in kd_ref)
    for r in two["kd"]:
        assert r["engine"] == "PlainEngine"
        assert r["losses"] == pytest.approx(ref["losses"], abs=TOL)
        assert r["grad_norms"] == pytest.approx(ref["grad_norms"], abs=TOL)
        assert [o["kd loss"] for o in r["other_losses"]] == pytest.approx(kd_ref, abs=TOL)


def test_distilling_changes_the_student_and_plain_runs_log_no_kd_loss(runs: tuple[dict, dict]) -> None:
    one, _ = runs
    (kd_run,), (plain,) = one["kd"], one["plain"]
    assert "other_losses" not in plain
    assert kd_run["losses"][0] == pytest.approx(plain["losses"][0], abs=TOL)  # the same student, the same batch
    assert kd_run["grad_norms"][0] != pytest.approx(plain["grad_norms"][0], abs=1e-4)  # the kd loss has a gradient
    assert kd_run["losses"][1] != pytest.approx(plain["losses"][1], abs=1e-5)
