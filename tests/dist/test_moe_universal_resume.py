"""A mixture-of-experts checkpoint resumes its whole training state under another expert-parallel size, world size
and ZeRO stage, through its universal form.

Two ranks, DP = 2, fp32, routing deterministic (no token dropping, top-2's second expert by argmax) as in
tests/dist/test_moe_expert_parallel.py, whose scenarios and helpers this reuses. Saved at E = 2 after 3 steps and
resumed at E = 1 for 3 more (`--load` converts it once next to the source, then each rank takes its experts by their
global index, its fp32 masters and Adam's moments), the 3 resumed steps equal steps 4-6 of the 6-step E = 2 run within
1e-6 (losses, clipped gradient norms), and so does every final weight by its global name: top-1 at ZeRO 0 -> ZeRO 0,
PR-MoE (experts in optimizer groups of their own) at ZeRO-2 -> ZeRO 0 (against the 6-step ZeRO-2 run: its first 3
steps' sums, rounded in ZeRO-2's order, put the ZeRO-0 run's sixth norm 1.2e-6 away) and ZeRO 0 -> ZeRO-2, and top-1
at ZeRO 0 into one process (E = 1, DP = 1: 4 micro-batches there, 2 per rank here), Megatron-LM's router with a
gated shared expert at ZeRO 0 -> ZeRO 0; PR-MoE into two pipeline stages
(ZeRO-2 -> ZeRO 0 and ZeRO 0 -> ZeRO-1 at P = 2, within 2e-6). The load-balancing loss stays in (coefficient
0.01, the default): a micro-batch's gate loss sees that micro-batch alone, so runs of another DP train the same sum.
bf16 without ZeRO (DeepSpeed's FP16_UnfusedOptimizer, whose fp32 copies are the masters) resumes at E = 1 near the
E = 2 run (bf16's 2e-2: the ranks sum expert gradients in bf16 over other groups). `tools/convert_checkpoint.py --to
universal` converts the ZeRO 0 checkpoint, and the converted directory resumes as `--load` did; a MoE checkpoint saved
before `experts.json` existed (and before its experts had their fc2 bias) is refused in one line, as saved too.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from tests.dist.test_moe_expert_parallel import TOL, sc, with_training

from megatron_ds.testing.scenario_runs import by_name, max_diff, run_scenarios

PAIRS = {  # name: (variant, source training fields, target training fields)
    "top1_z0": ("top1", {}, {}),
    "residual_z2_to_z0": ("residual", {"zero_stage": 2}, {}),
    "residual_z0_to_z2": ("residual", {}, {"zero_stage": 2}),
    "residual_bf16_z0": ("residual", {"precision": "bf16"}, {"precision": "bf16"}),
    "shared_z0": ("shared", {}, {}),  # Megatron-LM's router with a gated shared expert (not expert-parallel)
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("moe_universal")
    ck = {name: str(tmp / f"ck_{name}") for name in PAIRS}
    first: dict[str, dict] = {}
    for name, (variant, source, _) in PAIRS.items():
        first[f"{name}_saved"] = with_training(sc(variant, ep=2, world=2, save=ck[name]), **source)
    first["top1_straight"] = sc("top1", ep=2, world=2, steps=6)
    first["residual_straight"] = sc("residual", ep=2, world=2, steps=6)
    first["shared_straight"] = sc("shared", ep=2, world=2, steps=6)
    first["residual_z2_straight"] = with_training(sc("residual", ep=2, world=2, steps=6), zero_stage=2)
    first["residual_bf16_straight"] = with_training(sc("residual", ep=2, world=2, steps=6), precision="bf16")
    results = by_name(list(first), run_scenarios(tmp / "w2a", 2, list(first.values()), timeout=150))

    from megatron_ds.training.checkpoint.universal.convert import convert_checkpoint

    converted = str(tmp / "converted")
    results["converted"] = convert_checkpoint(ck["top1_z0"], converted, show_progress=False)
    old = str(tmp / "old")  # as saved before experts.json existed
    shutil.copytree(ck["top1_z0"], old)
    tag = open(os.path.join(old, "latest")).read().strip()
    os.remove(os.path.join(old, tag, "experts.json"))
    second: dict[str, dict] = {}
    for name, (variant, _, target) in PAIRS.items():
        second[f"{name}_resumed"] = with_training(sc(variant, ep=1, world=2, load=ck[name]), **target)
    # the same E = 2 under ZeRO 0: the universal path into ranks that hold half the experts each (by global index)
    second["residual_z2_to_z0_ep2_resumed"] = sc("residual", ep=2, world=2, load=ck["residual_z2_to_z0"])
    second["top1_from_converted"] = sc("top1", ep=1, world=2, load=converted)
    second["top1_old"] = sc("top1", ep=1, world=2, load=old, expect_error=True)
    second["top1_old_as_saved"] = sc("top1", ep=2, world=2, load=old, expect_error=True)  # DeepSpeed's own files
    results.update(by_name(list(second), run_scenarios(tmp / "w2b", 2, list(second.values()), timeout=150)))
    staged: dict[str, dict] = {}  # into two stages: a launch of its own (DeepSpeed's expert groups are per process)
    for name, fields in (("residual_z2_to_z0", {}), ("residual_z0_to_z2", {"zero_stage": 1})):
        staged[f"{name}_p2_resumed"] = with_training(sc("residual", ep=1, world=2, load=ck[name]), **fields)
        staged[f"{name}_p2_resumed"]["overrides"]["parallel__pipeline_model_parallel_size"] = 2
    results.update(by_name(list(staged), run_scenarios(tmp / "w2c", 2, list(staged.values()), timeout=150)))
    third = {"top1_one_process": sc("top1", load=ck["top1_z0"])}
    results.update(by_name(list(third), run_scenarios(tmp / "w1", 1, list(third.values()), timeout=120)))
    results["dirs"] = {"ck": ck, "old": old}
    return results


def assert_continues(
    saved: list[dict], resumed: list[dict], ranks: list[dict], what: str, tol: float = TOL, engine: str = "PlainEngine"
) -> None:
    """`resumed` (every rank) goes on as steps 4-6 of the straight run (`ranks`, every rank's): losses within `tol`,
    norms within `tol` relative, every final weight by its global name within `tol` (the straight run's experts
    gathered from its ranks), all of them seen; `saved` was its steps 1-3."""
    straight = {**ranks[0], "weights": {n: v for r in ranks for n, v in r["weights"].items()}}
    for s in saved:
        assert max(abs(a - b) for a, b in zip(s["losses"], straight["losses"][:3], strict=True)) <= tol, what
    seen: set[str] = set()
    for r in resumed:
        assert "error" not in r, (what, r.get("error"))
        assert r["engine"] == engine, r["engine"]
        losses = zip(r["losses"], straight["losses"][3:], strict=True)
        assert max(abs(a - b) for a, b in losses) <= tol, (what, r["losses"], straight["losses"][3:])
        norms = zip(r["grad_norms"], straight["grad_norms"][3:], strict=True)
        assert max(abs(a - b) / b for a, b in norms) <= tol, (what, r["grad_norms"], straight["grad_norms"][3:])
        for name, value in r["weights"].items():
            assert max_diff(value, straight["weights"][name]) <= tol, (what, name)
            seen.add(name)
    assert seen == set(straight["weights"]), (what, set(straight["weights"]) ^ seen)


@pytest.mark.parametrize("name", ["top1_z0", "residual_z2_to_z0", "residual_z0_to_z2", "shared_z0"])
def test_saved_at_ep2_resumes_at_ep1_as_the_straight_run(runs: dict, name: str) -> None:
    variant, source, _ = PAIRS[name]
    straight = runs[f"{variant}{'_z2' if source else ''}_straight"]  # the source's own run: its first 3 steps' sums
    assert min(straight[0]["grad_norms"]) > 0.05, "clipping must be active (clip_grad 0.05)"
    assert all(len([n for n in r["weights"] if ".deepspeed_experts." in n]) > 0 for r in runs[f"{name}_resumed"])
    assert_continues(runs[f"{name}_saved"], runs[f"{name}_resumed"], straight, name)
    if name == "residual_z2_to_z0":  # at E = 2 too, each rank taking its own two experts of four
        resumed = runs["residual_z2_to_z0_ep2_resumed"]
        assert [len([n for n in r["weights"] if ".deepspeed_experts.3." in n]) > 0 for r in resumed] == [False, True]
        assert_continues(runs[f"{name}_saved"], resumed, straight, f"{name} at E = 2")
    assert os.path.isdir(runs["dirs"]["ck"][name] + "/" + "global_step3.universal")  # converted once, next to it


@pytest.mark.parametrize("name", ["residual_z2_to_z0", "residual_z0_to_z2"])
def test_saved_at_one_stage_resumes_at_two_as_the_straight_run(runs: dict, name: str) -> None:
    """Into DeepSpeed's pipeline engine at P = 2 (E = 1, DP = 1: each stage one MoE layer of the two, all its
    experts), ZeRO 0 from ZeRO-2 and ZeRO-1 from ZeRO 0: every stage takes its layers' weights, fp32 masters and
    Adam's moments from the universal form; steps 4-6 as the straight run's within 2e-6 (a stage sums its input's
    gradient in another order than one process: tests/dist/test_moe_pipeline.py's WEIGHT_TOL)."""
    variant, source, _ = PAIRS[name]
    straight = runs[f"{variant}{'_z2' if source else ''}_straight"]
    resumed = runs[f"{name}_p2_resumed"]
    assert [sorted({n.split(".")[0] for n in r["weights"] if ".deepspeed_experts." in n}) for r in resumed] == [
        ["4"], ["6"]
    ]  # layer 2 (spec 4) on stage 0, layer 4 (spec 6) on stage 1
    assert_continues(runs[f"{name}_saved"], resumed, straight, f"{name} at P = 2", tol=2e-6, engine="PipelineEngine")


def test_it_resumes_in_one_process(runs: dict) -> None:
    """World size 1 (E = 1, 4 micro-batches a step): every expert on the one rank, as the 6-step E = 2 run."""
    assert_continues(runs["top1_z0_saved"], runs["top1_one_process"], runs["top1_straight"], "one process")


def test_bf16_without_zero_resumes_near_the_straight_run(runs: dict) -> None:
    """bf16, ZeRO 0 (FP16_UnfusedOptimizer's fp32 copies and torch's Adam state over them) at E = 2 -> E = 1: within
    bf16's rounding of the 6-step E = 2 bf16 run."""
    straight = runs["residual_bf16_straight"]
    assert_continues(runs["residual_bf16_z0_saved"], runs["residual_bf16_z0_resumed"], straight, "bf16", tol=2e-2)


def test_the_converted_directory_resumes_as_load_does(runs: dict) -> None:
    """`tools/convert_checkpoint.py --to universal`'s output, given to --load at E = 1: the same steps and weights as
    the resume that converted by itself (bit for bit: the same universal tensors)."""
    assert runs["converted"].tensors > 0
    for a, b in zip(runs["top1_from_converted"], runs["top1_z0_resumed"], strict=True):
        assert a["losses"] == b["losses"] and a["grad_norms"] == b["grad_norms"] and a["weights"] == b["weights"]


def test_a_moe_checkpoint_without_its_expert_record_is_one_line(runs: dict) -> None:
    """Saved before experts.json (and the experts' fc2 bias): refused in one line through the universal form (another E)
    and as saved (DeepSpeed's own files would not fit the model's experts)."""
    for r in runs["top1_old"] + runs["top1_old_as_saved"]:
        assert "without experts.json" in r["error"] and "\n" not in r["error"], r["error"]
        assert "its experts do not fit this model" in r["error"]
