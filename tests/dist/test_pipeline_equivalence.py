"""Pipelined training equals a single-process run; the fixed defects are shown, the hang is caught.

Each test starts one process group and runs several configurations in it (start-up is paid once),
under a hard timeout that turns a hang into a failure naming the stalled rank and its stack.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from megatron_ds.testing.defects import FIXES
from megatron_ds.testing.scenario_runs import by_name, run_scenarios

LAYERS = 6
LOSS_TOL = 1e-6
BF16_LOSS_TOL = 5e-2


def scenario(p: int, dedicated: str = "none", zero: int = 0, precision: str = "fp32", layers: int = LAYERS,
             steps: int = 3, **extra: Any) -> dict[str, Any]:
    sc = {"overrides": {"parallel__pipeline_model_parallel_size": p, "model__num_layers": layers,
                        "training__zero_stage": zero, "training__precision": precision},
          "layout": {"dedicated": dedicated} if dedicated != "none" else {}, "steps": steps}
    for key, value in extra.items():
        sc[key] = value
    return sc


def run(tmp_path: Path, name: str, world: int, scenarios: list[dict], timeout: float = 420, check: bool = True):
    return run_scenarios(tmp_path / name, world, scenarios, timeout, check)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """Single-process (P=1, one rank) runs of the same models: fp32, keyed by layer count."""
    tmp = tmp_path_factory.mktemp("reference")
    ranks = run(tmp, "ref", 1, [scenario(1), scenario(1, layers=1)], timeout=300)
    return {LAYERS: ranks[0][0], 1: ranks[0][1]}


def assert_matches(got: dict, ref: dict, tol: float = LOSS_TOL, what: str = "") -> None:
    losses = [abs(a - b) for a, b in zip(got["losses"], ref["losses"])]
    assert max(losses) <= tol, f"{what} {got['layout']}: losses {got['losses']} vs reference {ref['losses']}"
    norms = [abs(a - b) / max(1.0, b) for a, b in zip(got["grad_norms"], ref["grad_norms"])]
    assert max(norms) <= max(tol, 1e-6), f"{what} {got['layout']}: norms {got['grad_norms']} vs {ref['grad_norms']}"


def assert_tied_in_sync(ranks: list[list[dict]], index: int) -> None:
    """The word embedding is bit-identical on the first and last stage, and was trained."""
    holders = [r[index] for r in ranks if "embedding_checksum" in r[index]]
    stages = sorted({h["stage"] for h in holders})
    assert len(stages) == (1 if len(ranks) == 1 else 2), stages
    assert len({h["embedding_checksum"] for h in holders}) == 1, holders
    assert all(h["embedding_changed"] for h in holders)


def check_all(ranks: list[list[dict]], scenarios: list[dict], reference: dict[int, dict]) -> None:
    for i, sc in enumerate(scenarios):
        ref = reference[sc["overrides"]["model__num_layers"]]
        assert all(ref["grad_norms"][s] > 0.05 for s in range(len(ref["grad_norms"]))), "clipping must be active"
        tol = BF16_LOSS_TOL if sc["overrides"]["training__precision"] == "bf16" else LOSS_TOL
        for rank in ranks:
            assert_matches(rank[i], ref, tol, what=f"scenario {sc}")
        assert_tied_in_sync(ranks, i)


def valid_dedicated(p: int) -> list[str]:
    return ["none"] + (["pre", "post"] if p >= 2 else []) + (["both"] if p >= 3 else [])


@pytest.mark.parametrize("p", [3, 4, 5])
def test_fp32_equivalence_every_dedicated_mode_and_zero(tmp_path: Path, reference: dict, p: int) -> None:
    scenarios = [scenario(p, d, z) for d in valid_dedicated(p) for z in (0, 1)]
    stock = []
    if p == 3:
        # bf16 with and without ZeRO-1 trains without hanging and stays near the fp32 reference.
        scenarios += [scenario(3, "both", 0, "bf16"), scenario(3, "both", 1, "bf16")]
        # The seed's scenario: one transformer layer alone between dedicated pre and post stages.
        scenarios += [scenario(3, "both", 1, layers=1)]
        # Without our parameter marking, DeepSpeed's no-ZeRO fp32 clip sees stage 0's gradients only.
        stock = [scenario(3, "both", 0, unfixed=[*FIXES, "preflight"])]
    ranks = run(tmp_path, f"p{p}", p, scenarios + stock)
    check_all(ranks, scenarios, reference)
    if stock:
        got, ref = ranks[0][len(scenarios)], reference[LAYERS]
        assert got["grad_norms"][0] < 0.9 * ref["grad_norms"][0], (got, ref)
        assert abs(got["losses"][1] - ref["losses"][1]) > 1e-6


def test_data_parallel_two_replicas_dedicated_both(tmp_path: Path, reference: dict) -> None:
    scenarios = [scenario(3, "both", 0), scenario(3, "both", 1)]
    ranks = run(tmp_path, "dp2", 6, scenarios, timeout=600)
    check_all(ranks, scenarios, reference)


def test_preflight_catches_mismatched_groups_in_seconds(tmp_path: Path) -> None:
    start = time.monotonic()
    results = run(tmp_path, "preflight", 3, [scenario(3, "both", 1, unfixed=FIXES)], timeout=180, check=False)
    elapsed = time.monotonic() - start
    assert all(r.returncode not in (0, None) for r in results), [r.returncode for r in results]
    text = results[0].output
    assert "PreflightError" in text and "rank 0 (stage 0)" in text and "empty optimizer group(s) ['no_decay']" in text
    assert elapsed < 120


def test_unfixed_zero1_hang_becomes_watchdog_error(tmp_path: Path) -> None:
    """The seed's hang, reproduced with the fixes off: the watchdog names rank, stage and stack."""
    sc = scenario(3, "both", 1, unfixed=[*FIXES, "preflight"])
    sc["overrides"]["parallel__distributed_timeout_minutes"] = 0.2
    results = run(tmp_path, "hang", 3, [sc], timeout=240, check=False)
    assert all(r.returncode not in (0, None) for r in results), [r.returncode for r in results]
    stalled = [r for r in results if "[watchdog] rank" in r.output]
    assert stalled, "\n".join(r.output[-2000:] for r in results)
    assert any("stalled for more than 12s in train_batch of step 0" in r.output for r in stalled)
    assert any("File " in r.output for r in stalled)  # the stack was printed
