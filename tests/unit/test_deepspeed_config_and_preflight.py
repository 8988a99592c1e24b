"""The generated DeepSpeed JSON, its merge with a user file or dict, the builder's checks before any
process group, the test-only defect switches, and the preflight comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ds.errors import ConfigError
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
    with pytest.raises(dsc.DeepSpeedConfigError) as err:
        dsc.build(cfg.replace(training__deepspeed_config=str(clash)))
    assert str(err.value) == (
        f"--deepspeed_config {clash} sets train_micro_batch_size_per_gpu=4 but the flags give 2; "
        "remove train_micro_batch_size_per_gpu from the file or change the matching flag"
    )


def test_zero_two_with_pipeline_and_bad_files_are_errors(tmp_path: Path) -> None:
    cfg = tiny_config(parallel__pipeline_model_parallel_size=2)
    z2 = tmp_path / "z2.json"
    z2.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    with pytest.raises(dsc.DeepSpeedConfigError, match="sets zero_optimization.stage=2"):
        dsc.build(cfg.replace(training__deepspeed_config=str(z2)))
    with pytest.raises(ConfigError, match="pipeline engine runs ZeRO 0 and 1 only"):
        cfg.replace(training__zero_stage=3)  # ZeRO-3 with P > 1: refused when the config is built
    with pytest.raises(dsc.DeepSpeedConfigError, match="cannot read it"):
        dsc.build(cfg.replace(training__deepspeed_config=str(tmp_path / "missing.json")))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(dsc.DeepSpeedConfigError, match="not valid JSON"):
        dsc.build(cfg.replace(training__deepspeed_config=str(broken)))
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00 not text")
    with pytest.raises(dsc.DeepSpeedConfigError, match=r"binary.json: not valid JSON \(not UTF-8 text\)"):
        dsc.build(cfg.replace(training__deepspeed_config=str(binary)))


def test_optimizer_offload_adds_only_its_keys() -> None:
    cfg = tiny_config(training__zero_stage=1)
    plain = dsc.generate(cfg)
    for device in ("cpu", "nvme"):
        ds = dsc.generate(cfg, offload_optimizer=device)
        offload = ds["zero_optimization"].pop("offload_optimizer")
        assert ds.pop("zero_force_ds_cpu_optimizer") is False  # or DeepSpeed refuses the torch optimizer
        assert ds == plain
        assert offload == {
            "device": device,
            "pin_memory": True,
            **({"nvme_path": "/local_nvme"} if device == "nvme" else {}),
        }


def test_zero_snippet_for_non_pipeline_engines() -> None:
    assert dsc.zero_snippet(1) == {"zero_optimization": {"stage": 1}}
    assert dsc.zero_snippet(3, "cpu", "nvme") == {
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "nvme", "pin_memory": True, "nvme_path": "/local_nvme"},
        }
    }


def test_a_ds_config_dict_merges_like_a_user_file(tmp_path: Path) -> None:
    cfg = tiny_config()
    merged = dsc.build(cfg, {"steps_per_print": 5, "zero_optimization": {"reduce_bucket_size": 1e6}})
    assert merged["steps_per_print"] == 5 and merged["zero_optimization"] == {"stage": 0, "reduce_bucket_size": 1e6}
    with pytest.raises(dsc.DeepSpeedConfigError) as err:
        dsc.build(cfg, {"gradient_clipping": 1.0})
    assert str(err.value) == (
        "build_pipeline(ds_config=...) sets gradient_clipping=1.0 but the config gives 0.05; "
        "remove gradient_clipping from ds_config or change the matching config field"
    )
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"wall_clock_breakdown": True}))
    both = dsc.build(cfg.replace(training__deepspeed_config=str(user)), {"steps_per_print": 5})
    assert both["wall_clock_breakdown"] is True and both["steps_per_print"] == 5
    with pytest.raises(
        dsc.DeepSpeedConfigError,
        match=r"ds_config=...\) sets activation_checkpointing.profile true but --profile-backward",
    ):
        dsc.build(cfg, {"activation_checkpointing": {"profile": True}})


def test_builder_refuses_mismatched_sizes_before_any_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    import megatron_ds
    from megatron_ds.model.naming import gpt_spec_groups
    from megatron_ds.pipeline.layout import build_layout

    cfg = tiny_config(parallel__pipeline_model_parallel_size=2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError) as err:
        megatron_ds.build_pipeline(cfg)
    assert str(err.value) == (
        "--pipeline-model-parallel-size 2 x --tensor-model-parallel-size 1 x data parallel 1 (config.parallel) = 2 "
        "ranks but the world size is 4; set config.parallel.data_parallel_size to 2"
    )
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="world size is 3; launch a multiple of 2 processes \\(torchrun"):
        megatron_ds.build_pipeline(cfg)
    three = build_layout(gpt_spec_groups(cfg.model), 3)
    with pytest.raises(ConfigError, match="has 3 stages but config.parallel.pipeline_model_parallel_size is 2"):
        megatron_ds.build_pipeline(cfg, layout=three)
    with pytest.raises(TypeError, match="takes a callable that builds the optimizer"):
        megatron_ds.build_pipeline(cfg, optimizer=cfg.optimizer)
    assert not dist.is_initialized()


def test_import_stays_light() -> None:
    """`megatron_ds.build_pipeline` is loaded on first use (the test above uses it), not at import."""
    import subprocess
    import sys

    code = "import sys, megatron_ds; heavy = {'torch', 'deepspeed'} & set(sys.modules); assert not heavy, heavy"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_defect_switches_replace_the_builders_steps_and_restore_them() -> None:
    from megatron_ds.model import gpt_pipe
    from megatron_ds.testing.defects import UNFIXED, unfixed
    from megatron_ds.training import builder

    originals = {name: getattr(builder, name) for name in ("add_group_placeholders", "install_fp32_grad_norm")}
    with unfixed(UNFIXED):
        assert builder.add_group_placeholders(None) == []
        assert builder.install_fp32_grad_norm.__module__ == "megatron_ds.testing.defects"
        assert gpt_pipe.mark_norm_counting(None, 0) is None and builder.check_structure(None, None) is None
    assert {name: getattr(builder, name) for name in originals} == originals
    assert gpt_pipe.mark_norm_counting.__module__ == "megatron_ds.model.gpt_pipe"
    with pytest.raises(KeyError), unfixed(["preflight", "no_such_fix"]):
        pass
    assert builder.check_structure.__module__ == "megatron_ds.training.preflight"


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


def test_run_facts_that_differ_name_the_rank_and_the_fact() -> None:
    from megatron_ds.training.preflight import compare_run_facts, run_facts

    same = run_facts(tiny_config())
    compare_run_facts([same, dict(same)])
    with pytest.raises(PreflightError, match=r"rank 1 has micro-batches per step 2 but rank 0 has 4"):
        compare_run_facts([same, run_facts(tiny_config(training__global_batch_size=4))])


def test_settings_that_differ_name_the_rank_the_fields_and_both_values() -> None:
    from megatron_ds.training.preflight import _digest, _shared, config_difference

    base = _shared(tiny_config())
    other = _shared(tiny_config(optimizer__lr=3e-4, training__seed=7))
    assert _digest(base) == _digest(_shared(tiny_config())) != _digest(other)
    assert config_difference([base, base, other]) == (
        "rank 2 was launched with other settings than rank 0: optimizer.lr 0.0003 (rank 0: 0.01); training.seed 7 "
        "(rank 0: 1234); give every rank the same flags (only file locations may differ between nodes)"
    )
    many = _shared(tiny_config(optimizer__lr=3e-4, training__seed=7, training__eval_iters=3, logging__log_interval=5))
    assert config_difference([base, many]).endswith(
        "training.eval_iters 3 (rank 0: 100); training.seed 7 (rank 0: 1234); and 1 more; give every rank the same "
        "flags (only file locations may differ between nodes)"
    )


def test_where_a_node_keeps_its_files_may_differ() -> None:
    from megatron_ds.training.preflight import LOCAL_PATHS, _digest, _shared

    a = tiny_config(data__data_cache_path="/local/node0/cache", training__offload_nvme_path="/nvme0")
    b = tiny_config(data__data_cache_path="/local/node1/cache", training__offload_nvme_path="/nvme1")
    assert _digest(_shared(a)) == _digest(_shared(b))
    fields = {f"{s}.{n}" for s, section in tiny_config().to_dict().items() for n in section}
    assert LOCAL_PATHS <= fields  # every exemption names a real field


def _check_agreement(rank: int, lrs: tuple[float, float]) -> None:
    from megatron_ds.training.preflight import check_config_agreement

    check_config_agreement(tiny_config(optimizer__lr=lrs[rank]))


@pytest.mark.parametrize("lrs", [(1e-2, 1e-2), (1e-2, 3e-4)])
def test_every_rank_stops_with_the_same_line_when_one_was_given_another_lr(tmp_path, lrs) -> None:
    from megatron_ds.testing.launch import forked_gloo_ranks

    results = forked_gloo_ranks(_check_agreement, 2, str(tmp_path / "store"), lrs)
    expected = None if lrs[0] == lrs[1] else "rank 1 was launched with other settings than rank 0: optimizer.lr 0.0003"
    assert [m and m.split(" (rank 0")[0] for m in results] == [expected, expected]
