"""Mixture-of-experts models on DeepSpeed's pipeline engine (P > 1) equal the one-process run.

As Megatron-DeepSpeed's GPTModelPipe (PR #373): each transformer layer passes the aggregated load-balancing loss on
with the activation, the final norm takes it off and the loss adds `--moe-loss-coeff` x it to each micro-batch's lm
loss (`model/moe_loss.py`). fp32, dropout 0, no token dropping (`--disable-moe-token-dropping`: DeepSpeed otherwise
picks the tokens kept over capacity at random, from torch's default generator, which the stages draw from in another
order than one process) and top-2's second expert by argmax; 4 micro-batches per step (gradient accumulation 4, or 2
per data-parallel rank), clip 0.05 active. Against the one-process run of the same global batch (DeepSpeed's plain
engine, as Megatron-DeepSpeed's --no-pipeline-parallel), within 1e-6: the lm losses, the `moe loss` of each step
(its weighted load-balancing loss, averaged over the micro-batches) and the clipped gradient norms; every final weight
within 2e-6 (`WEIGHT_TOL`; experts by their global index, the gates included: without the aggregated loss in the loss
they train otherwise):

  * P = 2: top-1, top-2, PR-MoE (`--mlp-type residual`, 2 and 4 experts, one dense layer between), Megatron-LM's
    top-k router at k = 3 and at k = 2 with pre-softmax weights and a gated shared expert under ZeRO 0, PR-MoE under ZeRO-1 with `--create-moe-param-group` (every stage gets the same expert optimizer groups);
  * P = 3 with dedicated embedding stages (`E|t*4|L`: the first stage holds no expert, the last none either), PR-MoE;
  * P = 2 x D = 2 at `--moe-expert-parallel-size 2` (DeepSpeed's expert groups made on every rank from our topology),
    top-1 under ZeRO 0 and PR-MoE under ZeRO-1; its `moe loss` (the mean over the data-parallel ranks) is the plain
    engine's at P = 1 x D = 2 too;
  * bf16 at P = 2 near the one-process bf16 run (the first step's norm, which counts the experts, within 3e-4).

Checkpoints: saved at P = 2 under ZeRO-1 (each stage's experts in DeepSpeed's files under its model-parallel rank) and
resumed, the run goes on bit for bit as the uninterrupted one; saved at P = 3 without ZeRO (the embedding stage's
weights in the per-spec files) and resumed, as the one-process run goes on; either loaded at P = 1 goes through its
universal form and on as the uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from megatron_ds.testing.scenario_runs import assert_weights_match, by_name, max_diff, model_weights, run_scenarios
from tests.dist.test_moe_expert_parallel import MOE
from tests.dist.test_moe_expert_parallel import VARIANTS as EP_VARIANTS

TOL = 1e-6
WEIGHT_TOL = 2e-6
"""The weights after 3 steps: a stage sums its input's gradient in another order than one process does, and three
Adam updates (eps 1e-6) carry that last-bit difference into the weights: 1.4e-6 on PR-MoE's position embedding at P = 2
(of weights up to 0.08), below 1e-6 everywhere else, while the losses stay within 1e-6."""
VARIANTS = {  # the plain engine's (top-1, top-2, PR-MoE, Megatron-LM's router, its shared expert), PR-MoE under ZeRO-1
    **EP_VARIANTS,
    "residual_zero1": {
        "model__mlp_type": "residual",
        "optimizer__create_moe_param_group": True,
        "model__num_experts": [2, 4],
        "training__zero_stage": 1,
    },
}


def sc(variant: str, p: int = 1, world: int = 1, steps: int = 3, **extra: Any) -> dict:
    """`variant` at pipeline size `p` on `world` ranks; `extra`: scenario keys (save, load, layout, overrides)."""
    overrides = {
        **MOE,
        **VARIANTS[variant],
        "parallel__pipeline_model_parallel_size": p,
        "parallel__world_size": world,
        **extra.pop("overrides", {}),
    }
    return {"overrides": overrides, "steps": steps, "weights": True, **extra}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("moe_pipe")


@pytest.fixture(scope="module")
def runs(tmp: Path) -> dict[str, list[dict]]:
    bf16 = {"training__precision": "bf16"}
    one = {v: sc(v) for v in EP_VARIANTS}  # top-1, top-2, PR-MoE, Megatron-LM's router at k = 3, a shared expert
    one["residual_long"] = sc("residual", steps=5)
    one["residual_bf16"] = sc("residual", overrides=bf16)
    one["from_p2"] = {**sc("residual_zero1"), "load": str(tmp / "ck_p2_zero1")}  # through its universal form
    one["from_p3"] = sc("residual", steps=2, load=str(tmp / "ck_p3"))  # its dense stages' files too
    two = {f"{v}_p2": sc(v, p=2, world=2) for v in VARIANTS}
    two["residual_zero1_p2"]["save"] = str(tmp / "ck_p2_zero1")
    two["residual_zero1_p2_resumed"] = sc("residual_zero1", p=2, world=2, load=str(tmp / "ck_p2_zero1"))
    two["residual_zero1_p2_straight"] = sc("residual_zero1", p=2, world=2, steps=6)
    two["residual_bf16_p2"] = sc("residual", p=2, world=2, overrides=bf16)
    ep = {"parallel__expert_parallel_size": 2}
    two["top1_p1_ep2"] = {**sc("top1", world=2, overrides=ep), "weights": False}  # the plain engine's moe loss
    both = {"layout": {"dedicated": "both"}}
    three = {"residual_p3": sc("residual", p=3, world=3, save=str(tmp / "ck_p3"), **both)}
    three["residual_p3_resumed"] = sc("residual", p=3, world=3, steps=2, load=str(tmp / "ck_p3"), **both)
    four = {"top1_p2_ep2": sc("top1", p=2, world=4, overrides=ep)}
    four["residual_zero1_p2_ep2"] = sc("residual_zero1", p=2, world=4, overrides=ep)
    results: dict[str, list[dict]] = {}
    for name, world, scenarios in (("w2", 2, two), ("w3", 3, three), ("w1", 1, one), ("w4", 4, four)):
        per_rank = run_scenarios(tmp / name, world, list(scenarios.values()), timeout=150)
        results.update(by_name(list(scenarios), per_rank))
    return results


def assert_equal_to(ranks: list[dict], ref: dict, what: str, tol: float = TOL) -> None:
    """Every rank's losses, moe losses and norms against `ref`'s within `tol`; the union of the ranks' weights (each
    stage holds its own; the tied embedding on two) the one-process run's within WEIGHT_TOL, every weight covered."""
    assert min(ref["grad_norms"]) > 0.05, "clipping must be active (clip_grad 0.05)"
    moe = [s["moe loss"] for s in ref["other_losses"]]
    for r in ranks:
        assert r["engine"] == "PipelineEngine", (what, r["engine"])
        assert max(abs(a - b) for a, b in zip(r["losses"], ref["losses"], strict=True)) <= tol, (what, r, ref)
        assert max(abs(a - b) / b for a, b in zip(r["grad_norms"], ref["grad_norms"], strict=True)) <= tol, what
        mine = [s["moe loss"] for s in r["other_losses"]]
        assert max(abs(a - b) for a, b in zip(mine, moe, strict=True)) <= tol, (what, mine, moe)
    assert_weights_match(ranks, ref["weights"], WEIGHT_TOL, what)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_stages_equal_the_one_process_run(runs: dict, variant: str) -> None:
    ref = runs[variant.removesuffix("_zero1")][0]
    assert_equal_to(runs[f"{variant}_p2"], ref, f"{variant} P=2")
    assert all(r["layout"] == "Et*2|t*2L" for r in runs[f"{variant}_p2"])


def test_three_stages_with_dedicated_embedding_stages_equal_the_one_process_run(runs: dict) -> None:
    ranks = runs["residual_p3"]
    assert [r["layout"] for r in ranks] == ["E|t*4|L"] * 3
    assert not any(".deepspeed_experts." in n for r in (ranks[0], ranks[2]) for n in r["weights"])
    assert_equal_to(ranks, runs["residual"][0], "residual P=3 E|t*4|L")


@pytest.mark.parametrize("variant", ["top1", "residual_zero1"])
def test_expert_parallel_two_at_two_stages_equals_the_one_process_run(runs: dict, variant: str) -> None:
    ranks = runs[f"{variant}_p2_ep2"]
    ref = runs[variant.removesuffix("_zero1")][0]
    experts = {n for n in ref["weights"] if ".deepspeed_experts." in n}
    for r in ranks:  # each rank holds half of its stage's experts
        held = {n for n in r["weights"] if n in experts}
        assert held and all(n.split(".")[0] in {h.split(".")[0] for h in held} for n in held)
    assert_equal_to(ranks, ref, f"{variant} P=2 D=2 EP=2")


def test_one_and_two_stages_report_the_same_moe_loss(runs: dict) -> None:
    """The `moe loss` of the log line (`engine.step_losses`) is one quantity on both engines: the step's weighted
    load-balancing loss averaged over the micro-batches and the data-parallel ranks (DeepSpeed's pipeline engine's
    mean of GPTModelPipe's additional losses; docs/training.md). At D = 2, expert-parallel 2, 2 micro-batches per rank:
    the plain engine's at P = 1 and the pipeline engine's at P = 2 are the same on every rank, and the one-process
    run's (4 micro-batches); a rank's own mean would be about 1e-3 off."""
    ref = [s["moe loss"] for s in runs["top1"][0]["other_losses"]]
    for name, engine in (("top1_p1_ep2", "PlainEngine"), ("top1_p2_ep2", "PipelineEngine")):
        for r in runs[name]:
            assert r["engine"] == engine, (name, r["engine"])
            mine = [s["moe loss"] for s in r["other_losses"]]
            assert max(abs(a - b) for a, b in zip(mine, ref, strict=True)) <= TOL, (name, mine, ref)


def test_the_gates_learn_from_the_load_balancing_loss(runs: dict) -> None:
    """The moe loss is not zero, and it moves the gates: the one-process run's moe loss is what the pipelined run
    reports (above), and a gate weight there changed in training (the equality above would not hold for a pipeline
    that left the aggregated loss out)."""
    ref = runs["top1"][0]
    assert all(s["moe loss"] > 0.1 for s in ref["other_losses"]), ref["other_losses"]
    gates = [n for n in ref["weights"] if n.endswith("deepspeed_moe.gate.wg.weight")]
    assert len(gates) == 2


def test_bf16_two_stages_are_near_the_one_process_bf16_run(runs: dict) -> None:
    """bf16 (DeepSpeed's BF16_Optimizer on the pipeline engine, its FP16_UnfusedOptimizer with the experts counted at
    P = 1): the first step's norm, of the same weights, within 3e-4 (the experts' squares in it); the losses within
    bf16's 2e-2 (routing decisions may flip in bf16 after the first update)."""
    ref, fp32 = runs["residual_bf16"][0], runs["residual"][0]
    assert ref["losses"] != fp32["losses"]
    for r in runs["residual_bf16_p2"]:
        assert abs(r["grad_norms"][0] - ref["grad_norms"][0]) / ref["grad_norms"][0] <= 3e-4
        assert max(abs(a - b) for a, b in zip(r["losses"], ref["losses"], strict=True)) <= 2e-2


def test_a_checkpoint_saved_at_two_stages_resumes_exactly(runs: dict) -> None:
    """DeepSpeed's files of each stage (its experts under its model-parallel rank, ZeRO-1's partitions with the expert
    groups'): saved after 3 steps and resumed for 3, equal to the 6-step run bit for bit."""
    name = "residual_zero1_p2"
    for saved, resumed, straight in zip(runs[name], runs[f"{name}_resumed"], runs[f"{name}_straight"], strict=True):
        assert saved["losses"] + resumed["losses"] == straight["losses"]
        assert saved["grad_norms"] + resumed["grad_norms"] == straight["grad_norms"]
        assert resumed["other_losses"] == straight["other_losses"][3:]
        assert resumed["weights"] == straight["weights"]


def test_a_checkpoint_saved_at_three_stages_resumes_as_the_one_process_run_goes_on(runs: dict) -> None:
    """At P = 3 the embedding stage has no experts: DeepSpeed saves it as a dense stage (per-spec files), the others
    with their experts' files and, without ZeRO, the optimizer state per expert-parallel rank; resumed, steps 4-5 are
    the one-process run's."""
    ref = runs["residual_long"][0]
    for r in runs["residual_p3_resumed"]:
        assert max(abs(a - b) for a, b in zip(r["losses"], ref["losses"][3:], strict=True)) <= TOL


def test_a_checkpoint_saved_at_two_stages_resumes_in_one_process(runs: dict, tmp: Path) -> None:
    """Under another topology (P = 1, DeepSpeed's plain engine) through its universal form, converted once next to it
    (`universal/moe_pipeline_source.py`; more topologies in tests/dist/test_moe_pipeline_universal.py): steps 4-6 as
    the 6-step P = 2 run's, the final weights within WEIGHT_TOL, every one of them (the union of the stages')."""
    ranks = runs["residual_zero1_p2_straight"]
    straight = {n: v for r in ranks for n, v in r["weights"].items()}
    resumed = runs["from_p2"][0]
    assert resumed["engine"] == "PlainEngine"
    assert max(abs(a - b) for a, b in zip(resumed["losses"], ranks[0]["losses"][3:], strict=True)) <= WEIGHT_TOL
    names = set(model_weights(resumed["weights"]))
    assert names == set(model_weights(straight))  # every weight compared
    assert all(max_diff(resumed["weights"][n], straight[n]) <= WEIGHT_TOL for n in names)
    assert (tmp / "ck_p2_zero1" / "global_step3.universal").is_dir()


def test_a_checkpoint_saved_at_three_stages_resumes_in_one_process(runs: dict) -> None:
    """Saved at P = 3 without ZeRO (the embedding stage and the head's stage saved as dense stages: per-spec weight
    files, torch's optimizer state in their model-state files) and resumed in one process through its universal form:
    steps 4-5 as the one-process run's."""
    ref, resumed = runs["residual_long"][0], runs["from_p3"][0]
    assert max(abs(a - b) for a, b in zip(resumed["losses"], ref["losses"][3:], strict=True)) <= WEIGHT_TOL
    assert all(max_diff(v, ref["weights"][n]) <= WEIGHT_TOL for n, v in resumed["weights"].items())


def _inference_name(name: str) -> str:
    """A training name (`4.moe.deepspeed_moe...`, `tied_modules.word_embeddings.weight`) -> the inference model's
    (`layers.1.moe.deepspeed_moe...`, `embedding.weight`): tiny_config has 3 specs before the layers (token cast,
    embedding, position table) and its final norm at spec 7."""
    head, rest = name.split(".", 1)
    if head == "tied_modules":
        return "embedding.weight"
    index = int(head)
    return {2: "position.", 7: "final_norm."}.get(index, f"layers.{index - 3}.") + rest


@pytest.mark.parametrize("name", ["residual_zero1_p2", "residual_p3"])
def test_a_checkpoint_saved_at_several_stages_loads_for_generation(runs: dict, tmp: Path, name: str) -> None:
    """`inference.load_model` (one process, `moe_weights`) reads each stage's files (a stage with experts: its
    model-state file and its experts' files under its model-parallel rank, its MoE layers numbered from 0; the P = 3
    embedding stage: the per-spec files of a dense stage): every weight is the trained one, bit for bit."""
    import torch

    from megatron_ds.inference import load_model

    model = load_model(str(tmp / {"residual_zero1_p2": "ck_p2_zero1", "residual_p3": "ck_p3"}[name]))
    trained = {
        _inference_name(n): v
        for r in runs[name]
        for n, v in model_weights(r["weights"]).items()
    }
    loaded = dict(model.named_parameters())
    assert set(loaded) == set(trained)
    assert all(torch.equal(loaded[n], torch.tensor(v)) for n, v in trained.items())
