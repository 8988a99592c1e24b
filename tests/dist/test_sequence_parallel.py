"""Megatron's sequence parallelism (T = 2 inside pipeline stages, dedicated embedding and head stages
included, with DP = 2), selective recomputation and DeepSpeed-Ulysses (N = 2 and 4, with GQA; N = 2 with a
sliding window) equal a single-process run; checkpoints carry across them; the two traps of sequence
parallelism on DeepSpeed's pipeline engine are shown.

One process group per world size runs every scenario (start-up paid once); the tests judge the results
against single-process T = P = 1 runs of the same models. Hidden dropout is on where the reference has
it: the masks of split activations are parts of the unsplit masks, so they equal T=1's. Attention
dropout acts on each rank's own heads (a per-rank stream, as Megatron), so with it on a run is
compared with the same split without sequence parallelism or recomputation.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from megatron_ds.testing.scenario_runs import by_name, run_scenarios

LAYERS = 6
TOL = 1e-6
DROPOUT = 0.1
GQA = {"model__num_attention_heads": 8, "model__num_key_value_heads": 4}
WINDOW = {**GQA, "model__window_size": [5, 0], "model__window_attn_skip_freq": [1, 0, 1, 1, 0, 1]}
"""--window-size 5,0 on four of the six layers (16 tokens: each windowed layer attends in query chunks)."""


def scenario(t: int = 1, p: int = 1, sp: bool = False, n: int = 1, zero: int = 0, steps: int = 3,
             hidden_dropout: float = DROPOUT, attention_dropout: float = 0.0, dedicated: str = "none",
             **options: Any) -> dict[str, Any]:
    overrides = {"parallel__tensor_model_parallel_size": t, "parallel__pipeline_model_parallel_size": p,
                 "parallel__sequence_parallel": sp, "parallel__ds_sequence_parallel_size": n,
                 "model__num_layers": LAYERS, "training__zero_stage": zero,
                 "regularization__hidden_dropout": hidden_dropout,
                 "regularization__attention_dropout": attention_dropout}
    overrides.update(options.pop("overrides", {}))
    return {"overrides": overrides, "layout": {"dedicated": dedicated} if dedicated != "none" else {},
            "steps": steps, "loss_mask": "partial", **options}


def run(out: Path, world: int, scenarios: dict[str, dict], timeout: float) -> dict[str, list[dict]]:
    return by_name(list(scenarios), run_scenarios(out, world, list(scenarios.values()), timeout))


REFERENCE = {
    "dropout": scenario(),
    "untied": scenario(overrides={"model__untie_embeddings_and_output_weights": True}),
    "gqa": scenario(overrides=GQA),
    "window": scenario(overrides=WINDOW),
    "window_full": scenario(overrides={**WINDOW, "model__window_size": None}),  # the window changes the model
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    results = run(tmp_path_factory.mktemp("sp_ref") / "ref", 1, REFERENCE, timeout=300)
    return {name: ranks[0] for name, ranks in results.items()}


ZERO3 = {"ds_config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}}  # partition the tiny model
BOTH_DROPOUTS = {"attention_dropout": DROPOUT, "zero": 1}


def four_rank_scenarios(ckpt: Path) -> dict[str, dict]:
    sp = {"t": 2, "p": 2, "sp": True}
    return {
        "sp": scenario(**sp, output_shapes=True),
        "sp_untied_zero1": scenario(**sp, zero=1, overrides={"model__untie_embeddings_and_output_weights": True}),
        "sp_full_recompute": scenario(**sp, overrides={"training__checkpoint_activations": True}),
        "sp_dp2": scenario(t=2, sp=True, zero=1),
        "tp_both_dropouts": scenario(t=2, p=2, **BOTH_DROPOUTS),
        "sp_both_dropouts": scenario(**sp, **BOTH_DROPOUTS),
        "sp_selective": scenario(**sp, **BOTH_DROPOUTS, overrides={"training__selective_recompute": True}),
        "selective_t1": scenario(p=2, zero=1, overrides={"training__selective_recompute": True}),
        "unfixed_partial_gradients": scenario(**sp, steps=2, unfixed=["partial_gradients"]),
        "unfixed_pipe_partitioning": scenario(**sp, steps=2, unfixed=["pipe_partitioning"]),
        "sp_save": scenario(**sp, **BOTH_DROPOUTS, steps=1, save=str(ckpt / "sp")),
        "tp_resume": scenario(t=2, p=2, **BOTH_DROPOUTS, steps=2, load=str(ckpt / "sp")),
        "ulysses4_gqa": scenario(n=4, overrides=GQA, output_shapes=True),
        "ulysses2_window_zero1": scenario(n=2, zero=1, overrides=WINDOW),
        "ulysses2_dp2_zero1": scenario(n=2, zero=1),
        "ulysses2_dp2_zero3": scenario(n=2, zero=3, **ZERO3),
        "ulysses2_selective_zero2": scenario(n=2, zero=2, overrides={"training__selective_recompute": True}),
        "ulysses_save": scenario(n=2, zero=1, steps=1, save=str(ckpt / "ulysses")),
        "dp4_resume": scenario(zero=1, steps=2, load=str(ckpt / "ulysses")),
        "dp4_save": scenario(zero=1, steps=1, save=str(ckpt / "dp4")),
        "ulysses_resume": scenario(n=2, zero=1, steps=2, load=str(ckpt / "dp4")),
    }


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("sp4")
    return run(tmp / "run", 4, four_rank_scenarios(tmp / "ckpt"), timeout=540)


SIX_RANK = {
    "sp_dedicated": scenario(t=2, p=3, sp=True, zero=1, dedicated="both", output_shapes=True,
                             overrides={"training__checkpoint_activations": True}),
    "sp_dedicated_selective": scenario(t=2, p=3, sp=True, dedicated="both",
                                       overrides={"training__selective_recompute": True}),
}


@pytest.fixture(scope="module")
def six_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    return run(tmp_path_factory.mktemp("sp6") / "run", 6, SIX_RANK, timeout=420)


def assert_matches(ranks: list[dict], ref: dict, first_step: int = 0) -> None:
    """Every rank reports the reference's losses and gradient norms (from step `first_step` on), clipping active."""
    assert min(ref["grad_norms"]) > 0.05, "clipping must be active (clip_grad 0.05)"
    for r in ranks:
        where = f"rank {r['rank']} (stage {r['stage']}, tensor rank {r['tp_rank']}) {r['layout']}"
        want_losses = ref["losses"][first_step : first_step + len(r["losses"])]
        want_norms = ref["grad_norms"][first_step : first_step + len(r["losses"])]
        assert max(abs(a - b) for a, b in zip(r["losses"], want_losses)) <= TOL, (where, r["losses"], want_losses)
        assert max(abs(a - b) / b for a, b in zip(r["grad_norms"], want_norms)) <= TOL, (where, r["grad_norms"])


# --- Megatron's sequence parallelism, T = 2 x P = 2 ------------------------------------------------

@pytest.mark.parametrize("name", ["sp", "sp_full_recompute", "sp_dp2"])
def test_sequence_parallel_equals_single_process(four_ranks: dict, reference: dict, name: str) -> None:
    assert_matches(four_ranks[name], reference["dropout"])


def test_sequence_parallel_untied_head_equals_single_process(four_ranks: dict, reference: dict) -> None:
    assert_matches(four_ranks["sp_untied_zero1"], reference["untied"])


def test_stages_send_their_part_of_the_sequence(four_ranks: dict) -> None:
    """The first stage's output is sequence-first and split: (s/T, b, h) = (8, 2, 32)."""
    first = [r for r in four_ranks["sp"] if r["stage"] == 0]
    assert {tuple(r["output_shape"]) for r in first} == {(8, 2, 32)}


def test_attention_dropout_and_selective_recompute_match_tensor_parallelism(four_ranks: dict) -> None:
    """With attention dropout (per-rank heads) a sequence-parallel run, with or without selective
    recomputation, equals the same T = 2 run without sequence parallelism."""
    tp = {r["rank"]: r for r in four_ranks["tp_both_dropouts"]}
    for name in ("sp_both_dropouts", "sp_selective"):
        for r in four_ranks[name]:
            ref = tp[r["rank"]]
            assert max(abs(a - b) for a, b in zip(r["losses"], ref["losses"])) <= TOL, (name, r, ref)
            assert max(abs(a - b) / b for a, b in zip(r["grad_norms"], ref["grad_norms"])) <= TOL, (name, r)
    assert four_ranks["sp_selective"][0]["losses"] != four_ranks["sp"][0]["losses"]  # attention dropout was on


def test_selective_recompute_without_tensor_parallelism(four_ranks: dict, reference: dict) -> None:
    assert_matches(four_ranks["selective_t1"], reference["dropout"])


@pytest.mark.parametrize("fix", ["partial_gradients", "pipe_partitioning"])
def test_the_traps_change_the_result(four_ranks: dict, reference: dict, fix: str) -> None:
    """Without the all-reduce of the norms' and row-parallel biases' partial gradients (Megatron-DeepSpeed
    #170), or with DeepSpeed's own partitioning of pipe messages (DeepSpeed #4196), training is wrong."""
    got, ref = four_ranks[f"unfixed_{fix}"][0], reference["dropout"]
    wrong = [abs(a - b) for a, b in zip(got["losses"] + got["grad_norms"], ref["losses"][:2] + ref["grad_norms"][:2])]
    assert max(wrong) > 1e-4, (fix, got, ref)


def test_checkpoint_carries_from_sequence_parallel_to_tensor_parallel(four_ranks: dict) -> None:
    """Saved with sequence parallelism after one step, resumed without it: the uninterrupted run."""
    whole = {r["rank"]: r for r in four_ranks["tp_both_dropouts"]}
    for first, rest in zip(four_ranks["sp_save"], four_ranks["tp_resume"]):
        ref = whole[rest["rank"]]
        got = first["losses"] + rest["losses"]
        assert max(abs(a - b) for a, b in zip(got, ref["losses"])) <= TOL, (got, ref["losses"])


# --- DeepSpeed-Ulysses (4 ranks: N = 4, or N = 2 x DP = 2) -------------------------------------------

def test_ulysses_four_ways_with_gqa_equals_single_process(four_ranks: dict, reference: dict) -> None:
    assert_matches(four_ranks["ulysses4_gqa"], reference["gqa"])
    assert {tuple(r["output_shape"]) for r in four_ranks["ulysses4_gqa"]} == {(2, 4, 128)}  # logits of s/4 tokens
    assert all(r["engine"] == "PlainEngine" for r in four_ranks["ulysses4_gqa"])


def test_ulysses_with_a_sliding_window_equals_single_process(four_ranks: dict, reference: dict) -> None:
    """Ulysses attends with every token of its heads: the window sees the whole sequence's positions."""
    assert_matches(four_ranks["ulysses2_window_zero1"], reference["window"])
    assert reference["window"]["losses"] != reference["window_full"]["losses"]


@pytest.mark.parametrize("name", ["ulysses2_dp2_zero1", "ulysses2_dp2_zero3", "ulysses2_selective_zero2"])
def test_ulysses_with_data_parallelism_equals_single_process(four_ranks: dict, reference: dict, name: str) -> None:
    """Gradients summed over each sequence group and averaged over data parallelism; under ZeRO-3 too (the
    generated JSON avoids DeepSpeed's reduce-scatter, which divides by DP x N)."""
    assert_matches(four_ranks[name], reference["dropout"])


@pytest.mark.parametrize("save,resume", [("ulysses_save", "dp4_resume"), ("dp4_save", "ulysses_resume")])
def test_checkpoint_carries_across_the_ulysses_degree(four_ranks: dict, reference: dict, save: str,
                                                      resume: str) -> None:
    """N = 2 x DP = 2 <-> N = 1 x DP = 4 (plain engine <-> pipeline engine) through the universal form."""
    assert_matches(four_ranks[save], reference["dropout"])
    assert_matches(four_ranks[resume], reference["dropout"], first_step=1)


# --- T = 2 x P = 3, dedicated embedding and head stages (6 ranks) ------------------------------------

@pytest.mark.parametrize("name", ["sp_dedicated", "sp_dedicated_selective"])
def test_sequence_parallel_with_dedicated_stages_equals_single_process(six_ranks: dict, reference: dict,
                                                                       name: str) -> None:
    assert_matches(six_ranks[name], reference["dropout"])
    assert six_ranks[name][0]["layout"] == "E|t*6|L"


def test_the_embedding_stage_sends_its_part(six_ranks: dict) -> None:
    shapes = {r["stage"]: tuple(r["output_shape"]) for r in six_ranks["sp_dedicated"]}
    assert shapes[0] == shapes[1] == (8, 2, 32) and shapes[2] == (16, 2, 64)  # logits (s, b, v/T)
