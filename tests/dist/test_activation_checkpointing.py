"""DeepSpeed's checkpointing options (--partition-activations, --contigious-checkpointing, --checkpoint-in-cpu,
--synchronize-each-layer, --profile-backward) change where recomputation's checkpoints wait, not what is computed:
on 2 ranks, at T=2 on the pipeline engine (ZeRO 0) and the plain engine (ZeRO 2), and at P=2 (contiguous buffers
with micro-batches in flight, on a stage holding three of four layers; 1F1B and ZB-H1), the losses and gradient
norms equal the run without them and the single-process run within 1e-6 in fp32, with an evaluation after every
step (eval forwards alone must not fill DeepSpeed's buffers). Hidden dropout is on, so the recompute must replay
the masks; attention dropout is off (per tensor rank streams: T=2 draws other masks than T=1, by design).
Both guards of `training.activation_checkpointing` are needed here: without the reset around evaluation forwards
the ZeRO-2 run indexes past DeepSpeed's contiguous buffers at its first evaluation, and with Megatron-DeepSpeed's
slot count (num_layers / checkpoint_num_layers = 4) the P=2 runs do in their first step (IndexError, tried).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from megatron_ds.testing.scenario_runs import by_name, run_scenarios

TOL = 1e-6
DROPOUT = 0.1
PARTITION = {"training__partition_activations": True}
CONTIGUOUS = {**PARTITION, "training__contiguous_checkpointing": True}
ALL = {**CONTIGUOUS, "training__checkpoint_in_cpu": True}


def scenario(t: int = 1, p: int = 1, zero: int = 0, layout: str | None = None, **options: Any) -> dict[str, Any]:
    overrides = {
        "parallel__tensor_model_parallel_size": t,
        "parallel__pipeline_model_parallel_size": p,
        "training__zero_stage": zero,
        "training__checkpoint_activations": True,
        "regularization__hidden_dropout": DROPOUT,
        **options,
    }
    return {"overrides": overrides, "layout": {"layout": layout} if layout else {}, "steps": 3, "eval": True,
            "loss_mask": "partial"}  # fmt: skip


UNEVEN = "Et*3|tL"  # stage 0: three layers, two micro-batches in flight under 1F1B: six checkpoints at its fullest
SCENARIOS = {
    "t2": scenario(t=2),
    "t2_partition": scenario(t=2, **PARTITION),
    "t2_all": scenario(t=2, **ALL, training__synchronize_each_layer=True, training__profile_backward=True),
    "t2_cpu": scenario(t=2, training__checkpoint_in_cpu=True),
    "t2_plain": scenario(t=2, zero=2),
    "t2_plain_all": scenario(t=2, zero=2, **ALL),
    "p2_all": scenario(p=2, layout=UNEVEN, **ALL),
    "p2_zbh1_all": scenario(p=2, layout=UNEVEN, parallel__pipeline_schedule="zbh1", **ALL),
    "p2_off_again": scenario(p=2, layout=UNEVEN),  # a later build in the same processes: DeepSpeed's defaults back
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("act_ckpt")
    results = run_scenarios(tmp / "two", 2, list(SCENARIOS.values()), timeout=240)
    ranks = by_name(list(SCENARIOS), results)
    ranks["reference"] = run_scenarios(tmp / "one", 1, [scenario()], timeout=120)[0]
    return ranks


def assert_equal(ranks: list[dict], ref: dict) -> None:
    for r in ranks:
        for key in ("losses", "grad_norms", "eval_losses"):
            diffs = [abs(a - b) for a, b in zip(r[key], ref[key], strict=True)]
            assert max(diffs) <= TOL, f"rank {r['rank']} {key}: {r[key]} vs {ref[key]}"


@pytest.mark.parametrize("name", [n for n in SCENARIOS])
def test_losses_equal_the_single_process_run(runs: dict, name: str) -> None:
    assert_equal(runs[name], runs["reference"][0])


def test_the_options_reach_deepspeed(runs: dict) -> None:
    for r in runs["t2_all"]:
        state = r["checkpointing"]
        assert state == {
            "partition_activations": True,
            "contiguous_checkpointing": True,
            "checkpoint_in_cpu": False,  # on a CPU device it changes nothing and is not passed on (see the module)
            "synchronize": True,
            "profile": True,
            "num_checkpoints": 4,  # four layers, one per chunk, one micro-batch in flight at P=1
            "partition_size": 2,  # the tensor-parallel group
        }, state
    assert [r["engine"] for r in runs["t2_plain_all"]] == ["PlainEngine"] * 2
    assert all(r["checkpointing"]["partition_activations"] for r in runs["t2_plain_all"])
    assert not any(r["checkpointing"]["partition_activations"] for r in runs["t2"] + runs["p2_off_again"])


def test_contiguous_slots_cover_the_micro_batches_in_flight(runs: dict) -> None:
    """Stage 0 keeps 2 micro-batches x 3 checkpoints before its first backward (Megatron-DeepSpeed's count,
    num_layers / checkpoint_num_layers = 4, would index past DeepSpeed's buffers there); stage 1 one layer, 1."""
    for name in ("p2_all", "p2_zbh1_all"):
        slots = {r["stage"]: r["checkpointing"]["num_checkpoints"] for r in runs[name]}
        assert slots == {0: 6, 1: 1}, (name, slots)
