"""Tensor parallelism inside pipeline stages equals a single-process run.

Two process groups (T=2 x P=2 on 4 ranks, T=2 x P=3 with dedicated embedding stages on 6 ranks)
each run several scenarios; module-scoped fixtures run them once and the tests below judge the
results against a single-process T=1, P=1 reference run of the same models.

What is exactly comparable with dropout: masks on activations every tensor rank holds in full
(embedding output, residual branches) come from per-spec streams, so they equal the T=1, P=1
masks; attention dropout acts on each rank's own heads with a per-rank stream (as Megatron),
so with it on, T=2 is compared with itself: recomputation under activation checkpointing must
replay the masks exactly.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from megatron_ds.testing.scenario_runs import by_name, run_scenarios

LAYERS = 6
TOL = 1e-6
BF16_LOSS_TOL = 5e-2
BF16_NORM_RTOL = 2e-2
DROPOUT = 0.1


def scenario(t: int = 2, p: int = 2, dedicated: str = "none", zero: int = 0, precision: str = "fp32",
             steps: int = 3, hidden_dropout: float = 0.0, attention_dropout: float = 0.0, checkpointing: bool = False,
             untied: bool = False, **options: Any) -> dict[str, Any]:
    overrides = {"parallel__tensor_model_parallel_size": t, "parallel__pipeline_model_parallel_size": p,
                 "model__num_layers": LAYERS, "training__zero_stage": zero, "training__precision": precision,
                 "regularization__hidden_dropout": hidden_dropout, "regularization__attention_dropout": attention_dropout,
                 "training__checkpoint_activations": checkpointing,
                 "model__untie_embeddings_and_output_weights": untied}
    overrides.update(options.pop("overrides", {}))
    return {"overrides": overrides, "layout": {"dedicated": dedicated} if dedicated != "none" else {},
            "steps": steps, "loss_mask": "partial", **options}


def run(out: Path, world: int, scenarios: list[dict], timeout: float) -> list[list[dict]]:
    """Run `scenarios` in one process group of `world` ranks; per scenario, the list of rank results."""
    per_rank = run_scenarios(out, world, scenarios, timeout)
    return [[ranks[i] for ranks in per_rank] for i in range(len(scenarios))]


EXACT_GELU = {"model__activation": "gelu"}  # --no-bias-gelu-fusion; the default is the tanh GeLU

REFERENCE = {
    "fp32": scenario(t=1, p=1, init_checksums=True),
    "exact_gelu": scenario(t=1, p=1, overrides=EXACT_GELU),
    "hidden_dropout": scenario(t=1, p=1, hidden_dropout=DROPOUT),
    "untied": scenario(t=1, p=1, untied=True),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Single-process T=1, P=1 runs, keyed as REFERENCE."""
    results = run(tmp_path_factory.mktemp("tp_ref") / "ref", 1, list(REFERENCE.values()), timeout=300)
    return {name: ranks[0] for name, ranks in zip(REFERENCE, results)}


def four_rank_scenarios(ckpt: Path) -> dict[str, dict]:
    dropout = {"hidden_dropout": DROPOUT, "attention_dropout": DROPOUT}
    return {
        "fp32": scenario(init_checksums=True),
        "fp32_zero1": scenario(zero=1),
        "bf16": scenario(precision="bf16"),
        "bf16_zero1": scenario(zero=1, precision="bf16"),
        "stock_clip": scenario(unfixed=["counted_fp32_clip"], steps=1),
        "untied": scenario(untied=True, zero=1),
        "exact_gelu": scenario(overrides=EXACT_GELU),
        "dp2": scenario(p=1, zero=1, swapped_axes=True),  # T=2 x DP=2: data axis between tensor and pipe
        "hidden_dropout_ckpt": scenario(hidden_dropout=DROPOUT, checkpointing=True),
        "dropout": scenario(zero=1, **dropout),
        "dropout_ckpt": scenario(zero=1, checkpointing=True, **dropout),
        "save": scenario(zero=1, steps=1, save=str(ckpt), **dropout),
        "resume": scenario(zero=1, steps=2, load=str(ckpt), **dropout),
    }


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("tp4")
    scenarios = four_rank_scenarios(tmp / "ckpt")
    return dict(zip(scenarios, run(tmp / "run", 4, list(scenarios.values()), timeout=420)))


SIX_RANK = {
    "fp32": scenario(p=3, dedicated="both", init_checksums=True),
    "fp32_zero1": scenario(p=3, dedicated="both", zero=1),
    "hidden_dropout_ckpt_zero1": scenario(p=3, dedicated="both", zero=1, hidden_dropout=DROPOUT, checkpointing=True),
}


@pytest.fixture(scope="module")
def six_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    results = run(tmp_path_factory.mktemp("tp6") / "run", 6, list(SIX_RANK.values()), timeout=540)
    return dict(zip(SIX_RANK, results))


def assert_matches(ranks: list[dict], ref: dict, tol: float = TOL, norm_rtol: float = TOL) -> None:
    """Every rank reports the reference's losses and gradient norms (clipping active)."""
    assert min(ref["grad_norms"]) > 0.05, "clipping must be active (clip_grad 0.05)"
    for r in ranks:
        where = f"rank {r['rank']} (stage {r['stage']}, tensor rank {r['tp_rank']}) {r['layout']}"
        steps = len(r["losses"])
        diffs = [abs(a - b) for a, b in zip(r["losses"], ref["losses"][:steps])]
        assert max(diffs) <= tol, f"{where}: losses {r['losses']} vs reference {ref['losses']}"
        rel = [abs(a - b) / b for a, b in zip(r["grad_norms"], ref["grad_norms"][:steps])]
        assert max(rel) <= norm_rtol, f"{where}: norms {r['grad_norms']} vs reference {ref['grad_norms']}"


def assert_same_runs(a: list[dict], b: list[dict]) -> None:
    for x, y in zip(a, b):
        assert x["losses"] == y["losses"] and x["grad_norms"] == y["grad_norms"], (x, y)


def assert_tied_shards_in_sync(ranks: list[dict], num_stages: int) -> None:
    """Each tensor rank's embedding shard is bit-identical on the first and last stage, and trained."""
    holders = [r for r in ranks if "embedding_checksum" in r]
    for tp_rank in sorted({r["tp_rank"] for r in ranks}):
        mine = [h for h in holders if h["tp_rank"] == tp_rank]
        assert sorted(h["stage"] for h in mine) == sorted({0, num_stages - 1}), mine
        assert len({h["embedding_checksum"] for h in mine}) == 1, mine
        assert all(h["embedding_changed"] for h in mine)
    assert len({h["embedding_checksum"] for h in holders}) == len({h["tp_rank"] for h in holders}), "shards differ"


def gathered_init(ranks: list[dict]) -> dict[str, str]:
    merged: dict[str, str] = {}
    for r in ranks:
        for name, value in r.get("init_checksums", {}).items():
            assert merged.setdefault(name, value) == value, name  # tied copies agree
    return merged


# --- T=2 x P=2 (4 ranks) ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ["fp32", "fp32_zero1"])
def test_fp32_equals_single_process(four_ranks: dict, reference: dict, name: str) -> None:
    assert_matches(four_ranks[name], reference["fp32"])
    assert_tied_shards_in_sync(four_ranks[name], num_stages=2)


def test_untied_head_equals_single_process(four_ranks: dict, reference: dict) -> None:
    assert_matches(four_ranks["untied"], reference["untied"])


def test_both_gelu_forms_equal_single_process(four_ranks: dict, reference: dict) -> None:
    """fp32 above is the default tanh GeLU; the exact GeLU is another model, and equal at T=2 too."""
    assert_matches(four_ranks["exact_gelu"], reference["exact_gelu"])
    assert reference["exact_gelu"]["losses"] != reference["fp32"]["losses"]


def test_data_parallel_replicas_equal_single_process(four_ranks: dict, reference: dict) -> None:
    assert_matches(four_ranks["dp2"], reference["fp32"])


def test_group_check_names_a_topology_megatron_core_disagrees_with(four_ranks: dict) -> None:
    """Start-up compares megatron-core's groups with DeepSpeed's axes; here with tensor and data swapped."""
    for r in four_ranks["dp2"]:
        assert re.search(r"rank 0: megatron-core's tensor-parallel group is \[0, 1\] but DeepSpeed's 'model' "
                         r"axis group is \[0, 2\]", r["topology_error"]), r


def test_gathered_initial_weights_equal_t1(four_ranks: dict, reference: dict) -> None:
    ours, ref = gathered_init(four_ranks["fp32"]), gathered_init([reference["fp32"]])
    assert ours == ref, sorted(k for k in ref if ours.get(k) != ref[k])


def test_stock_fp32_clip_counts_tied_shard_twice(four_ranks: dict, reference: dict) -> None:
    """DeepSpeed's own no-ZeRO fp32 norm, at T > 1, counts the last stage's tied shard again."""
    stock, ref = four_ranks["stock_clip"][0]["grad_norms"][0], reference["fp32"]["grad_norms"][0]
    assert stock > (1 + 2 * BF16_NORM_RTOL) * ref, (stock, ref)  # also: bf16's tolerance would see it


@pytest.mark.parametrize("name", ["bf16", "bf16_zero1"])
def test_bf16_trains_near_reference_and_counts_norm_once(four_ranks: dict, reference: dict, name: str) -> None:
    assert_matches(four_ranks[name], reference["fp32"], tol=BF16_LOSS_TOL, norm_rtol=BF16_NORM_RTOL)
    assert_tied_shards_in_sync(four_ranks[name], num_stages=2)


def test_hidden_dropout_with_recompute_equals_single_process(four_ranks: dict, reference: dict) -> None:
    assert_matches(four_ranks["hidden_dropout_ckpt"], reference["hidden_dropout"])
    assert four_ranks["hidden_dropout_ckpt"][0]["losses"] != reference["fp32"]["losses"]  # dropout was on


def test_attention_dropout_recompute_replays_masks(four_ranks: dict) -> None:
    assert_same_runs(four_ranks["dropout_ckpt"], four_ranks["dropout"])


def test_checkpoint_resumes_exactly(four_ranks: dict) -> None:
    """ZeRO-1 with dropout: saved after step 1 and resumed, the run is the uninterrupted one."""
    whole = four_ranks["dropout"]
    for full, first, rest in zip(whole, four_ranks["save"], four_ranks["resume"]):
        assert first["losses"] + rest["losses"] == full["losses"], (first, rest, full)
        assert first["grad_norms"] + rest["grad_norms"] == full["grad_norms"]


# Loading at another tensor-parallel size (the whole state or weights only) is tested in
# tests/dist/test_universal_resume.py.


# --- T=2 x P=3, dedicated embedding stages (6 ranks) -------------------------------------------

@pytest.mark.parametrize("name", ["fp32", "fp32_zero1"])
def test_dedicated_stages_equal_single_process(six_ranks: dict, reference: dict, name: str) -> None:
    assert_matches(six_ranks[name], reference["fp32"])
    assert_tied_shards_in_sync(six_ranks[name], num_stages=3)
    assert six_ranks[name][0]["layout"] == "E|t*6|L"


def test_dedicated_stages_gathered_initial_weights_equal_t1(six_ranks: dict, reference: dict) -> None:
    assert gathered_init(six_ranks["fp32"]) == gathered_init([reference["fp32"]])


def test_dedicated_stages_hidden_dropout_with_recompute(six_ranks: dict, reference: dict) -> None:
    assert_matches(six_ranks["hidden_dropout_ckpt_zero1"], reference["hidden_dropout"])
