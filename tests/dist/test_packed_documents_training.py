"""Training on packed documents (`--reset-position-ids`, `--reset-attention-mask`) equals the single-process run.

One four-rank process group runs every scenario in turn: the ids of the packed documents travel beside the
hidden states between stages (P = 2), with T = 2, Megatron's sequence parallelism, full and selective
recomputation, ZB-H1 and interleaved 1F1B; one process runs the references (P = 1 on the pipeline engine, and
ZeRO-2 on the plain engine). fp32 losses and gradient norms (clipping active) agree within 1e-6. A run with only
`--reset-position-ids` and one without the flags differ from the masked one: the flags do reach the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from megatron_ds.testing.scenario_runs import by_name, run_scenarios

TOL = 1e-6
ROPE = {"model__use_rotary_position_embeddings": True, "model__add_position_embedding": False}
BOTH = {"data__reset_position_ids": True, "data__reset_attention_mask": True}


def scenario(p: int = 1, t: int = 1, zero: int = 1, **overrides: Any) -> dict[str, Any]:
    base = {"parallel__pipeline_model_parallel_size": p, "parallel__tensor_model_parallel_size": t,
            "training__zero_stage": zero, **BOTH}  # fmt: skip
    return {"overrides": {**base, **overrides}, "steps": 3}


REFERENCES = {
    "learned": scenario(),
    "rope": scenario(**ROPE),
    "rope plain engine ZeRO-2": scenario(zero=2, **ROPE),
    "rope positions only": scenario(**ROPE, data__reset_attention_mask=False),
    "rope no flags": scenario(**ROPE, data__reset_position_ids=False, data__reset_attention_mask=False),
}
FOUR_RANKS = {  # name -> (its reference, scenario)
    "learned P2 DP2 full recompute": ("learned", scenario(p=2, training__checkpoint_activations=True)),
    "rope P2 T2 sequence parallel selective recompute": (
        "rope",
        scenario(p=2, t=2, parallel__sequence_parallel=True, training__selective_recompute=True, **ROPE),
    ),
    "rope P2 T2 zbh1": ("rope", scenario(p=2, t=2, parallel__pipeline_schedule="zbh1", **ROPE)),
    "rope P2 interleaved": (
        "rope",
        scenario(p=2, parallel__pipeline_schedule="interleaved", parallel__virtual_stages=2, **ROPE),
    ),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("packed_ref") / "run"
    return {
        n: r[0] for n, r in by_name(list(REFERENCES), run_scenarios(out, 1, list(REFERENCES.values()), 300)).items()
    }


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("packed_p2") / "run"
    scenarios = [sc for _, sc in FOUR_RANKS.values()]
    return by_name(list(FOUR_RANKS), run_scenarios(out, 4, scenarios, 420))


def max_differences(got: dict, ref: dict) -> tuple[float, float]:
    losses = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
    norms = max(abs(a - b) / max(1.0, b) for a, b in zip(got["grad_norms"], ref["grad_norms"]))
    return losses, norms


@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_equals_single_process(four_ranks: dict, reference: dict, name: str) -> None:
    ref = reference[FOUR_RANKS[name][0]]
    assert all(g > 0.05 for g in ref["grad_norms"]), "clipping must be active"
    for r in four_ranks[name]:
        assert max(max_differences(r, ref)) <= TOL, (name, r["layout"], r["losses"], ref["losses"])


def test_plain_engine_equals_pipeline_engine(reference: dict) -> None:
    got, ref = reference["rope plain engine ZeRO-2"], reference["rope"]
    assert got["engine"] != ref["engine"]
    assert max(max_differences(got, ref)) <= TOL


def test_each_flag_changes_the_run(reference: dict) -> None:
    """Masking and position resets are both felt by the losses (the scenario samples hold 5-token documents)."""
    rope = reference["rope"]
    for other in ("rope positions only", "rope no flags"):
        assert max_differences(reference[other], rope)[0] > 1e-4, other
    assert max_differences(reference["rope positions only"], reference["rope no flags"])[0] > 1e-4
