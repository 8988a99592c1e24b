"""A dense bf16 run without ZeRO on DeepSpeed's plain engine (here DeepSpeed-Ulysses; `--kd` runs there too) resumes
under another topology through the universal form, both ways.

DeepSpeed wraps torch's AdamW there in FP16_UnfusedOptimizer, which keeps its fp32 masters in `fp32_groups` inside the
model-states file, not in the `bf16_zero_pp_rank_*` partition files the pipeline engine's BF16_Optimizer writes (the
conversion looked for those and stopped: "missing; the checkpoint is incomplete"). Two ranks, bf16, dropout 0: saved
after 3 steps at Ulysses 2 (plain engine) and resumed at data-parallel 2 (the pipeline engine at P = 1, BF16_Optimizer),
and the reverse (into FP16_UnfusedOptimizer's fp32 copies), the 3 resumed steps and every final weight are those of the
source's own 6-step run within bf16's rounding (2e-2, as the MoE bf16 resume: the ranks sum in bf16 in another order).
"""

from __future__ import annotations

from typing import Any

import pytest

from megatron_ds.testing.scenario_runs import by_name, max_diff, run_scenarios

BF16_TOL = 2e-2


def sc(ulysses: int, **extra: Any) -> dict:
    overrides = {
        "parallel__ds_sequence_parallel_size": ulysses,
        "parallel__world_size": 2,
        "training__precision": "bf16",
        "regularization__hidden_dropout": 0.0,
        "regularization__attention_dropout": 0.0,
    }
    return {"overrides": overrides, "steps": 3, "weights": True, **extra}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("plain_bf16")
    ck = {"ulysses": str(tmp / "ck_ulysses"), "dp": str(tmp / "ck_dp")}
    first = {
        "ulysses_saved": sc(2, save=ck["ulysses"]),
        "ulysses_straight": sc(2, steps=6),
        "dp_saved": sc(1, save=ck["dp"]),
        "dp_straight": sc(1, steps=6),
    }
    second = {"to_dp": sc(1, load=ck["ulysses"]), "to_ulysses": sc(2, load=ck["dp"])}
    results = by_name(list(first), run_scenarios(tmp / "a", 2, list(first.values()), timeout=150))
    results.update(by_name(list(second), run_scenarios(tmp / "b", 2, list(second.values()), timeout=150)))
    return results


@pytest.mark.parametrize(
    ("resumed", "source", "engines"),
    [("to_dp", "ulysses", ("PlainEngine", "PipelineEngine")), ("to_ulysses", "dp", ("PipelineEngine", "PlainEngine"))],
)
def test_resumes_into_the_other_engine_as_the_straight_run(
    runs: dict, resumed: str, source: str, engines: tuple[str, str]
) -> None:
    saved, straight = runs[f"{source}_saved"], runs[f"{source}_straight"][0]
    assert (saved[0]["engine"], runs[resumed][0]["engine"]) == engines
    for r in runs[resumed]:
        losses = zip(r["losses"], straight["losses"][3:], strict=True)
        assert max(abs(a - b) for a, b in losses) <= BF16_TOL, (resumed, r["losses"], straight["losses"][3:])
        assert set(r["weights"]) == set(straight["weights"])
        for name, value in r["weights"].items():
            assert max_diff(value, straight["weights"][name]) <= BF16_TOL, (resumed, name)


