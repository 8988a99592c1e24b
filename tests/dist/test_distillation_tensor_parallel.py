"""--kd at tensor-parallel size 2 equals the one-process run: the kd loss is the full vocabulary's KL divergence from
vocabulary-parallel logits (not Megatron-DeepSpeed's per-shard softmax), and its gradient reaches every shard.

Launch 1 (one rank): a 4-layer teacher trains 2 steps and saves at T = 1; a 2-layer student distils from it
(temperature 2, beta 0.5, hidden dropout on in the student, clipping active) for 3 steps, its final weights recorded.
Launch 2 (two ranks, T = 2): the same student distils from the same checkpoint, its teacher tensor-parallel (the
T = 1 checkpoint resharded on load); once more under --sequence-parallel. Launch 3 (four ranks, T = 2 x DP = 2):
the same student. lm loss, kd loss, gradient norm and the
final (gathered) weights within 1e-6 in fp32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_ds.testing.scenario_runs import by_name, run_scenarios
from tests.dist.test_distillation_data_parallel import kd as distil

TOL = 1e-6
STUDENT = {
    "model__num_layers": 2,
    "regularization__hidden_dropout": 0.1,  # attention dropout's masks are per tensor rank at T > 1, as Megatron's
}


def kd(teacher: str, **parallel: object) -> dict:
    return distil(teacher, STUDENT, weights=True, **parallel)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    root = tmp_path_factory.mktemp("kdtp")
    teacher = str(root / "teacher")
    one = run_scenarios(root / "w1", 1, [{"overrides": {}, "steps": 2, "save": teacher}, kd(teacher)], timeout=120)
    two = run_scenarios(
        root / "w2",
        2,
        [
            kd(teacher, tensor_model_parallel_size=2),
            kd(teacher, tensor_model_parallel_size=2, sequence_parallel=True),
        ],
        timeout=120,
    )
    four = run_scenarios(root / "w4", 4, [kd(teacher, tensor_model_parallel_size=2)], timeout=120)
    return by_name(["teacher", "kd"], one), {**by_name(["tp", "sp"], two), **by_name(["tp_dp"], four)}


def assert_equal_runs(ranks: list[dict], ref: dict) -> None:
    kd_ref = [o["kd loss"] for o in ref["other_losses"]]
    assert all(k > 0 for k in kd_ref)
    for r in ranks:
        assert r["engine"] == "PlainEngine"
        assert [o["kd loss"] for o in r["other_losses"]] == pytest.approx(kd_ref, abs=TOL)
        assert r["losses"] == pytest.approx(ref["losses"], abs=TOL)
        assert r["grad_norms"] == pytest.approx(ref["grad_norms"], abs=TOL)
        assert r["weights"].keys() == ref["weights"].keys()
        for name, value in ref["weights"].items():
            diff = (torch.tensor(r["weights"][name]) - torch.tensor(value)).abs().max().item()
            assert diff <= TOL, (name, diff)


def test_tensor_parallel_kd_equals_one_process(runs: tuple[dict, dict]) -> None:
    one, two = runs
    (ref,) = one["kd"]
    assert [r["tp_rank"] for r in two["tp"]] == [0, 1]
    assert_equal_runs(two["tp"], ref)


def test_tensor_and_data_parallel_kd_equals_one_process(runs: tuple[dict, dict]) -> None:
    one, two = runs
    assert [r["tp_rank"] for r in two["tp_dp"]] == [0, 1, 0, 1]
    assert_equal_runs(two["tp_dp"], one["kd"][0])


def test_sequence_parallel_kd_equals_one_process(runs: tuple[dict, dict]) -> None:
    one, two = runs
    assert_equal_runs(two["sp"], one["kd"][0])
