"""The generated DeepSpeed JSON, its merge with a user file, and the preflight comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ds.testing.scenario import tiny_config
from megatron_ds.training import deepspeed_config as dsc
from megatron_ds.training.preflight import PreflightError, compare


def test_generated_config_has_batch_sizes_and_always_clipping() -> None:
    cfg = tiny_config(optimizer__clip_grad=0.0, parallel__world_size=2)
    ds = dsc.generate(cfg)
    assert ds["train_batch_size"] == 8 and ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 2
    assert ds["gradient_clipping"] == 0.0  # written even when 0: DeepSpeed's default would clip at 1.0
    assert ds["zero_optimization"] == {"stage": 0} and ds["bf16"] == {"enabled": False}


def test_deepspeed_accepts_the_generated_config() -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    for overrides in ({}, {"training__precision": "bf16", "training__zero_stage": 1}):
        ds = dsc.generate(tiny_config(**overrides))
        parsed = (
            DeepSpeedConfig(ds, world_size=1)
            if "world_size" in DeepSpeedConfig.__init__.__code__.co_varnames
            else DeepSpeedConfig(ds)
        )
        assert parsed.train_batch_size == 8 and parsed.gradient_clipping == 0.05
        assert parsed.zero_optimization_stage == ds["zero_optimization"]["stage"]


def test_user_file_merges_and_contradictions_fail(tmp_path: Path) -> None:
    cfg = tiny_config()
    extra = tmp_path / "extra.json"
    extra.write_text(
        json.dumps(
            {"wall_clock_breakdown": True, "zero_optimization": {"reduce_bucket_size": 5e7}, "train_batch_size": 8.0}
        )
    )
    merged = dsc.build(cfg.replace(training__deepspeed_config=str(extra)))
    assert merged["wall_clock_breakdown"] is True and merged["zero_optimization"]["stage"] == 0
    assert merged["zero_optimization"]["reduce_bucket_size"] == 5e7
    clash = tmp_path / "clash.json"
    clash.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4}))
    with pytest.raises(dsc.DeepSpeedConfigError, match="sets train_micro_batch_size_per_gpu=4 but the flags give 2"):
        dsc.build(cfg.replace(training__deepspeed_config=str(clash)))


def test_zero_two_with_pipeline_and_bad_files_are_errors(tmp_path: Path) -> None:
    cfg = tiny_config(parallel__pipeline_model_parallel_size=2)
    z2 = tmp_path / "z2.json"
    z2.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    with pytest.raises(dsc.DeepSpeedConfigError, match="sets zero_optimization.stage=2"):
        dsc.build(cfg.replace(training__deepspeed_config=str(z2)))
    with pytest.raises(dsc.DeepSpeedConfigError, match="supports ZeRO 0 and 1 only"):
        dsc.build(cfg.replace(training__zero_stage=3))
    with pytest.raises(dsc.DeepSpeedConfigError, match="cannot read it"):
        dsc.build(cfg.replace(training__deepspeed_config=str(tmp_path / "missing.json")))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(dsc.DeepSpeedConfigError, match="not valid JSON"):
        dsc.build(cfg.replace(training__deepspeed_config=str(broken)))


def sig(groups=("decay", "no_decay"), sizes=(3, 2), tied=None, dtypes=("torch.float32",), trainable=True):
    return {
        "groups": list(groups),
        "group_sizes": list(sizes),
        "empty_groups": [g for g, n in zip(groups, sizes) if n == 0],
        "tied": tied if tied is not None else {"word_embeddings": [[128, 32]]},
        "dtypes": list(dtypes),
        "trainable": trainable,
    }


def test_preflight_accepts_consistent_ranks() -> None:
    compare([sig(), sig(sizes=(1, 1), tied={}), sig(sizes=(4, 5))], [0, 1, 2])


@pytest.mark.parametrize(
    "bad,message",
    [
        (sig(groups=("decay",), sizes=(2,)), "rank 1 (stage 1) has optimizer groups ['decay'] but rank 0"),
        (sig(sizes=(2, 0)), "rank 1 (stage 1) has empty optimizer group(s) ['no_decay']"),
        (sig(dtypes=("torch.bfloat16",)), "has parameter dtypes ['torch.bfloat16']"),
        (sig(trainable=False), "rank 1 (stage 1) holds no trainable parameter"),
        (sig(tied={"word_embeddings": [[256, 32]]}), "tied module 'word_embeddings' has shapes [[256, 32]] on rank 1"),
    ],
)
def test_preflight_names_rank_stage_and_difference(bad: dict, message: str) -> None:
    with pytest.raises(PreflightError) as err:
        compare([sig(), bad], [0, 1])
    assert message in str(err.value)
