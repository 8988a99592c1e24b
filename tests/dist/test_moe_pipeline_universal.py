"""A mixture-of-experts checkpoint saved at pipeline size 2 (DeepSpeed's pipeline engine, each stage's own files)
converts to the universal form and resumes under another topology through it (`universal/moe_pipeline_source.py`).

Four ranks, P = 2 x DP = 2 at `--moe-expert-parallel-size 2`, PR-MoE (2 and 4 experts, one MoE layer per stage, the
experts in optimizer groups of their own), fp32, routing deterministic as in tests/dist/test_moe_pipeline.py, whose
scenarios this reuses; saved after 3 steps under ZeRO-1 and under ZeRO 0 (the expert-parallel ranks' optimizer files).
Resumed for 3 more steps, steps 4-6 of the 6-step run saved from within 2e-6 (losses, clipped gradient norms, and
every final weight by its global name: a stage sums its input's gradient in another order than one process,
tests/dist/test_moe_pipeline.py's WEIGHT_TOL): ZeRO-1 -> ZeRO 0 at P = 1 (the plain engine, E = 1, DP = 2), ZeRO 0 ->
ZeRO-1 at P = 1 (E = 2), and ZeRO 0 -> ZeRO-1 at P = 2 on two ranks (E = 1, DP = 1). `tools/convert_checkpoint.py --to
universal`'s conversion of each (bf16 too: ZeRO-1's and, at ZeRO 0, BF16_Optimizer's fp32 masters) holds every saved
weight (in bf16, the masters rounded to bf16 are the saved weights bit for bit) and the counters. bf16 at ZeRO 0, which
DeepSpeed cannot load back itself, resumes under its saved topology through the universal form bit for bit; its
weights alone (`--no-load-optim`) load at P = 1 bit for bit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from tests.dist.test_moe_pipeline import WEIGHT_TOL, sc

from megatron_ds.testing.scenario_runs import assert_weights_match, by_name, run_scenarios

EP2 = {"parallel__expert_parallel_size": 2}
SOURCES = {  # name: the source's overrides (PR-MoE at P = 2, E = 2 on four ranks)
    "z1": {**EP2, "training__zero_stage": 1},
    "z0": {**EP2, "training__zero_stage": 0},
    "bf16": {**EP2, "training__zero_stage": 1, "training__precision": "bf16"},
    "bf16_z0": {**EP2, "training__zero_stage": 0, "training__precision": "bf16"},
}
RESUMES = {  # name: (source, pipeline size, world size, overrides)
    "z1_to_p1": ("z1", 1, 2, {"training__zero_stage": 0}),
    "z0_to_p1_ep2": ("z0", 1, 2, {**EP2, "training__zero_stage": 1}),
    "z0_to_p2_world2": ("z0", 2, 2, {"training__zero_stage": 1}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("moe_pipe_universal")
    ck = {name: str(tmp / f"ck_{name}") for name in SOURCES}
    first = {f"{n}_saved": sc("residual_zero1", p=2, world=4, overrides=o, save=ck[n]) for n, o in SOURCES.items()}
    for name in ("z1", "z0", "bf16_z0"):
        first[f"{name}_straight"] = sc("residual_zero1", p=2, world=4, steps=6, overrides=SOURCES[name])
    # as saved: DeepSpeed's BF16_Optimizer does not read its own state back (`rules.deepspeed_cannot_restore`)
    first["bf16_z0_as_saved"] = sc("residual_zero1", p=2, world=4, overrides=SOURCES["bf16_z0"], load=ck["bf16_z0"])
    results: dict[str, Any] = by_name(list(first), run_scenarios(tmp / "w4", 4, list(first.values()), timeout=150))

    from megatron_ds.training.checkpoint.universal.convert import convert_checkpoint

    results["converted"] = {n: convert_checkpoint(ck[n], str(tmp / f"u_{n}"), show_progress=False) for n in SOURCES}
    for p in (1, 2):  # a launch per pipeline size (DeepSpeed's expert groups are per process)
        scenarios = {
            name: sc("residual_zero1", p=p, world=world, overrides=overrides, load=ck[source])
            for name, (source, pp, world, overrides) in RESUMES.items()
            if pp == p
        }
        if p == 1:  # --no-load-optim: its weights alone, through the universal form too
            weights = {"checkpoint__no_load_optim": True, "training__zero_stage": 0}
            scenarios["weights_to_p1"] = sc("residual_zero1", p=1, world=2, steps=0, overrides=weights, load=ck["z0"])
        per_rank = run_scenarios(tmp / f"w2_p{p}", 2, list(scenarios.values()), timeout=150)
        results.update(by_name(list(scenarios), per_rank))
    results["dirs"] = {"ck": ck, "tmp": str(tmp)}
    return results


def assert_continues(resumed: list[dict], straight: list[dict], what: str) -> None:
    """`resumed` (every rank) goes on as steps 4-6 of `straight` (every rank's): losses within WEIGHT_TOL, norms within
    WEIGHT_TOL relative, every final weight by its global name within WEIGHT_TOL, all of them seen."""
    ref = {**straight[0], "weights": {n: v for r in straight for n, v in r["weights"].items()}}
    assert min(ref["grad_norms"]) > 0.05, "clipping must be active (clip_grad 0.05)"
    for r in resumed:
        assert "error" not in r, (what, r.get("error"))
        losses = zip(r["losses"], ref["losses"][3:], strict=True)
        assert max(abs(a - b) for a, b in losses) <= WEIGHT_TOL, (what, r["losses"], ref["losses"][3:])
        norms = zip(r["grad_norms"], ref["grad_norms"][3:], strict=True)
        assert max(abs(a - b) / b for a, b in norms) <= WEIGHT_TOL, (what, r["grad_norms"], ref["grad_norms"][3:])
    assert_weights_match(resumed, ref["weights"], WEIGHT_TOL, what)


@pytest.mark.parametrize("name", list(RESUMES))
def test_saved_at_two_stages_resumes_under_another_topology_as_the_straight_run(runs: dict, name: str) -> None:
    source, p, _, _ = RESUMES[name]
    for saved, straight in zip(runs[f"{source}_saved"], runs[f"{source}_straight"], strict=True):
        assert max(abs(a - b) for a, b in zip(saved["losses"], straight["losses"][:3], strict=True)) <= 1e-6
    engine = "PlainEngine" if p == 1 else "PipelineEngine"
    assert all(r["engine"] == engine for r in runs[name])
    assert_continues(runs[name], runs[f"{source}_straight"], name)
    assert os.path.isdir(os.path.join(runs["dirs"]["ck"][source], "global_step3.universal"))  # converted once


@pytest.mark.parametrize("name", list(SOURCES))
def test_the_conversion_holds_every_saved_weight_and_the_counters(runs: dict, name: str) -> None:
    """Every tensor of the universal form's fp32 masters, in the training precision, is the saved weight (each stage's
    files read by `moe_weights`, experts by their global index) bit for bit; Adam's moments and step are there."""
    import torch

    from megatron_ds.training.checkpoint import reader
    from megatron_ds.training.checkpoint.moe_weights import iter_weights
    from megatron_ds.training.checkpoint.universal.deepspeed_source import FP32
    from megatron_ds.training.checkpoint.universal.store import Universal

    summary = runs["converted"][name]
    found = Universal(os.path.join(summary.output, "global_step3"))
    assert found.states == ["exp_avg", "exp_avg_sq"] and found.group_step("decay") == 3
    assert found.meta["engine"]["global_steps"] == 3
    saved = list(iter_weights(reader.open_checkpoint(runs["dirs"]["ck"][name], moe=True)))
    assert summary.tensors == len(saved) and any(".deepspeed_experts.3." in t.name for t, _ in saved)
    for tensor, weight in saved:
        assert torch.equal(found.read(tensor.name, FP32).to(weight.dtype), weight), tensor.name
    assert all(found.read(t.name, "exp_avg_sq").min() >= 0 for t, _ in saved)


def test_bf16_without_zero_resumes_as_saved_through_its_universal_form(runs: dict) -> None:
    """bf16 at ZeRO 0 (DeepSpeed's BF16_Optimizer, whose own load fails: `rules.deepspeed_cannot_restore`) resumed under
    the topology it was saved with, through its universal form: the 6-step run's steps 4-6 and weights bit for bit."""
    for resumed, straight in zip(runs["bf16_z0_as_saved"], runs["bf16_z0_straight"], strict=True):
        assert "error" not in resumed, resumed.get("error")
        assert resumed["losses"] == straight["losses"][3:] and resumed["grad_norms"] == straight["grad_norms"][3:]
        assert resumed["weights"] == straight["weights"]
    assert os.path.isdir(os.path.join(runs["dirs"]["ck"]["bf16_z0"], "global_step3.universal"))


def test_its_weights_alone_load_at_one_stage(runs: dict) -> None:
    """`--no-load-optim` at P = 1: every weight the saved run's, bit for bit (experts by their global index)."""
    saved = {n: v for r in runs["z0_saved"] for n, v in r["weights"].items()}
    for r in runs["weights_to_p1"]:
        assert "error" not in r, r.get("error")
        assert r["weights"] and all(v == saved[n] for n, v in r["weights"].items() if not n.startswith("optimizer_"))
