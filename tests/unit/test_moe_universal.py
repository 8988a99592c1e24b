"""The universal form of a mixture-of-experts checkpoint without a process group: its tensor names against the built
model, where each expert's state is in DeepSpeed's files (`universal/moe_source.py`, `experts.json`), and the one-line
refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from megatron_ds.config import RegularizationConfig
from megatron_ds.model.gpt_pipe import build_layer_specs
from megatron_ds.testing.scenario import tiny_config
from megatron_ds.training.checkpoint import experts, reader
from megatron_ds.training.checkpoint.directory import META, CheckpointError
from megatron_ds.training.checkpoint.universal import names
from megatron_ds.training.checkpoint.universal.moe_source import MoeSource

MOE = {"model__num_experts": (4,)}


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"model__mlp_type": "residual"},
        {"model__activation": "swiglu", "model__add_bias_linear": False},
        {"model__num_experts": (2, 4)},
        {"model__activation": "swiglu", "model__add_bias_linear": False, "model__moe_router": "megatron",
         "model__moe_shared_expert_size": 24, "model__moe_shared_expert_gate": True},
    ],
    ids=["standard", "residual", "swiglu-no-bias", "list", "shared-gated"],
)  # fmt: skip
def test_the_tensor_names_and_shapes_are_the_one_process_models(variant: dict) -> None:
    """Every parameter of the model built at E = 1 (every expert local: its global name), by `module_name`, with its
    shape and optimizer group; nothing more, nothing less."""
    model = tiny_config(**{**MOE, **variant}).model
    built: dict[str, tuple[int, ...]] = {}
    for index, spec in enumerate(build_layer_specs(model, RegularizationConfig(), 1234)):
        if isinstance(spec, TiedLayerSpec):
            built.update({f"tied_modules.{spec.key}.{n}": tuple(p.shape) for n, p in spec.build().named_parameters()})
        elif isinstance(spec, LayerSpec):
            built.update({f"{index}.{n}": tuple(p.shape) for n, p in spec.build().named_parameters()})
    tensors = names.model_tensors(model)
    ours = {names.module_name(model, t): t.rule.shape for t in tensors}
    assert list(ours) == [n for n in built if n in ours]  # the model's own order
    assert ours == built
    gate = next(t for t in tensors if t.key == "moe.deepspeed_moe.gate.wg.weight")
    assert gate.name == "04.TransformerLayer.moe.deepspeed_moe.gate.wg.weight" and gate.group == "decay"


def _checkpoint(tmp: Path, world: int, ep: int, ranks: list[dict] | None, **fields: object) -> reader.Checkpoint:
    """A MoE checkpoint's metadata and `experts.json` (no tensors): enough for where things are."""
    config = tiny_config(**MOE, parallel__world_size=world, parallel__expert_parallel_size=ep, **fields)
    directory = tmp / "global_step3"
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"config": config.to_dict(), "train_state": {}, "layout": "Et*4L", "world_size": world}
    (directory / META).write_text(json.dumps(meta))
    (tmp / "latest").write_text("global_step3")
    if ranks is not None:
        groups = [[["some.name"]] for _ in range(ep)]
        (directory / experts.EXPERTS_FILE).write_text(
            json.dumps({"format": 1, "expert_parallel_size": ep, "ranks": ranks, "optimizer_groups": groups})
        )
    return reader.open_checkpoint(str(tmp), moe=True)


def _ranks(pairs: list[tuple[int, int]]) -> list[dict]:
    return [{"expert_parallel_rank": r, "expert_data_parallel_rank": q} for r, q in pairs]


def _expert(model: object, expert: int, key: str = "fc1.weight") -> names.ModelTensor:
    return next(
        t for t in names.model_tensors(model) if t.key == f"moe.deepspeed_moe.experts.deepspeed_experts.{expert}.{key}"
    )


@pytest.mark.parametrize(
    ("pairs", "holders"),
    [
        # DeepSpeed's default (expert groups [0, 1], [2, 3]; expert-data groups [0, 2], [1, 3])
        ([(0, 0), (1, 0), (0, 1), (1, 1)], [1, 3]),
        # use_data_before_expert_parallelism (expert groups [0, 2], [1, 3]; expert-data groups [0, 1], [2, 3])
        ([(0, 0), (0, 1), (1, 0), (1, 1)], [2, 3]),
    ],
    ids=["expert-first", "data-first"],
)
def test_an_expert_is_read_from_its_expert_parallel_ranks_by_its_local_name(
    tmp_path: Path, pairs: list, holders: list[int]
) -> None:
    """E = 2 of 4 experts on 4 ranks: expert 3 is local expert 1 of expert-parallel rank 1, its ZeRO partitions on
    the ranks of that rank's expert-data-parallel group in their order there; a dense tensor on every rank."""
    source = MoeSource(
        _checkpoint(tmp_path, 4, 2, _ranks(pairs), training__zero_stage=2, optimizer__create_moe_param_group=True)
    )
    model = source.model
    local = "4.moe.deepspeed_moe.experts.deepspeed_experts.1.fc1.weight"
    assert source._expert(_expert(model, 3)) == (3, 1, local)
    assert source._holders(_expert(model, 3)) == [(d, local) for d in holders]
    assert source._expert(_expert(model, 0))[1:] == (0, local.replace(".1.", ".0."))
    qkv = next(t for t in names.model_tensors(model) if t.key == "qkv.weight")
    assert source._holders(qkv) == [(d, f"{qkv.spec_index}.qkv.weight") for d in range(4)]


def test_a_moe_checkpoint_without_its_record_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as err:
        MoeSource(_checkpoint(tmp_path, 2, 2, None))
    line = str(err.value)
    assert "a mixture-of-experts checkpoint without experts.json" in line and "\n" not in line
    assert "its experts do not fit this model; load it with the megatron_ds release that wrote it" in line


def test_a_record_of_another_world_is_damaged(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not describe 2 ranks at --moe-expert-parallel-size 2"):
        MoeSource(_checkpoint(tmp_path, 2, 2, _ranks([(0, 0)])))


def test_the_per_spec_reader_refuses_a_moe_checkpoint_and_the_conversion_opens_it(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path, 2, 2, _ranks([(0, 0), (1, 0)]))
    assert ckpt.config.model.is_moe
    with pytest.raises(CheckpointError, match="which the per-spec weight readers do not read"):
        reader.open_checkpoint(str(tmp_path))
    assert os.path.isfile(os.path.join(ckpt.directory, experts.EXPERTS_FILE))


def test_fp16_without_zero_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="--fp16 checkpoint without ZeRO") as err:
        MoeSource(_checkpoint(tmp_path, 2, 2, _ranks([(0, 0), (1, 0)]), training__precision="fp16"))
    assert "\n" not in str(err.value)


def test_the_record_names_every_rank_and_each_expert_parallel_ranks_groups(tmp_path: Path) -> None:
    records = [
        {"expert_parallel_rank": 0, "expert_data_parallel_rank": 0, "optimizer_groups": [["a"], ["b"]]},
        {"expert_parallel_rank": 1, "expert_data_parallel_rank": 0, "optimizer_groups": [["a"], ["c"]]},
        {"expert_parallel_rank": 0, "expert_data_parallel_rank": 1},
        {"expert_parallel_rank": 1, "expert_data_parallel_rank": 1},
    ]
    experts.write(str(tmp_path), records)
    found = experts.read(str(tmp_path), 4, 2)
    assert found["optimizer_groups"] == [[["a"], ["b"]], [["a"], ["c"]]]
    assert [r["expert_data_parallel_rank"] for r in found["ranks"]] == [0, 0, 1, 1]


def test_a_dense_model_has_no_moe_tensors() -> None:
    dense = tiny_config().model
    assert not any("moe." in t.key for t in names.model_tensors(dense))
