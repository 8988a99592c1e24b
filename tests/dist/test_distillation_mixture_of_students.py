"""--mos (Megatron-DeepSpeed's mixture of students): a mixture-of-experts student distils from a dense teacher, its step
lm loss + moe loss + mos loss, and expert parallelism equals the one-process run.

Launch 1 (one rank): a dense 4-layer teacher trains 2 steps and saves; a 2-layer student with 4 experts in its second
layer (top-1, no token dropping: deterministic routing) distils from it under --mos (temperature 2, beta 0.5, clipping
active) for 3 steps, and the same student trains without the teacher. Launch 2 (two ranks, DP = 2, the experts
shared out, --moe-expert-parallel-size 2): the same --mos student. lm loss, mos loss, gradient norm and every final
weight (experts by their global index) within 1e-6 in fp32; the mos loss changes the student's training.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_ds.testing.scenario_runs import by_name, run_scenarios

TOL = 1e-6
STUDENT = {
    "model__num_layers": 2,
    "model__num_experts": [4],
    "model__moe_token_dropping": False,
}


def student(teacher: str | None, ep: int = 1) -> dict:
    distil = {
        "distillation__mos": True,
        "distillation__load_teacher": teacher,
        "distillation__kd_temp": 2.0,
        "distillation__kd_beta_ce": 0.5,
    }
    overrides = {**STUDENT, "parallel__expert_parallel_size": ep, "parallel__world_size": ep}
    overrides.update(distil if teacher else {})
    return {"overrides": overrides, "steps": 3, "weights": True}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    root = tmp_path_factory.mktemp("mos")
    teacher = str(root / "teacher")
    saving = {"overrides": {}, "steps": 2, "save": teacher}
    one = run_scenarios(root / "w1", 1, [saving, student(teacher), student(None)], timeout=120)
    two = run_scenarios(root / "w2", 2, [student(teacher, ep=2)], timeout=120)
    return by_name(["teacher", "mos", "plain"], one), by_name(["mos"], two)


def test_expert_parallel_mos_equals_one_process(runs: tuple[dict, dict]) -> None:
    one, two = runs
    (ref,) = one["mos"]
    assert ref["engine"] == "PlainEngine"
    assert [sorted(o) for o in ref["other_losses"]] == [["moe loss", "mos loss"]] * 3  # upstream's loss dict keys
    mos_ref = [o["mos loss"] for o in ref["other_losses"]]
    assert all(m > 0 for m in mos_ref)
    assert min(ref["grad_norms"]) > 0.05, "clipping must be active (clip_grad 0.05)"
    seen = set()
    for r in two["mos"]:
        assert [o["mos loss"] for o in r["other_losses"]] == pytest.approx(mos_ref, abs=TOL)
        assert r["losses"] == pytest.approx(ref["losses"], abs=TOL)
        assert r["grad_norms"] == pytest.approx(ref["grad_norms"], abs=TOL)
        for name, value in r["weights"].items():  # each rank holds its experts: 2 of the 4
            diff = (torch.tensor(value) - torch.tensor(ref["weights"][name])).abs().max().item()
            assert diff <= TOL, (name, diff)
            seen.add(name)
    assert seen == set(ref["weights"])


def test_mos_changes_the_student_beside_its_moe_loss(runs: tuple[dict, dict]) -> None:
    one, _ = runs
    (mos,), (plain,) = one["mos"], one["plain"]
    assert [sorted(o) for o in plain["other_losses"]] == [["moe loss"]] * 3
    assert mos["losses"][0] == pytest.approx(plain["losses"][0], abs=TOL)  # the same student, the same batch
    assert mos["other_losses"][0]["moe loss"] == pytest.approx(plain["other_losses"][0]["moe loss"], abs=TOL)
    assert mos["grad_norms"][0] != pytest.approx(plain["grad_norms"][0], abs=1e-4)  # the mos loss has a gradient
    assert mos["losses"][1] != pytest.approx(plain["losses"][1], abs=1e-5)
