"""Mixture-of-experts at pipeline size > 1 without a process group: what the config accepts and refuses in one line,
the aggregated load-balancing loss a layer passes on, DeepSpeed's expert groups from our topology, the expert
optimizer placeholders, the memory model's experts per stage, and the checkpoint rules (the training itself:
tests/dist/test_moe_pipeline.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from torch import nn

from megatron_ds.errors import ConfigError
from megatron_ds.estimate.memory_inputs import MemoryInputs
from megatron_ds.estimate.memory_model import stage_memory
from megatron_ds.flags.parser import parse_config
from megatron_ds.model import moe_loss, naming
from megatron_ds.model.gpt_pipe import build_layer_specs
from megatron_ds.pipeline.layout import build_layout
from megatron_ds.testing.scenario import tiny_config
from megatron_ds.training.checkpoint import experts
from megatron_ds.training.checkpoint.rules import moe_pipeline_refusal, moe_refusal, universal_refusal
from megatron_ds.training.moe_pipeline import expert_group_ranks
from megatron_ds.training.optimizer import add_group_placeholders, build_optimizer

BASE = "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 128 --lr 1e-3"
BASE += " --train-iters 2 --mock-data --micro-batch-size 2 --global-batch-size 4 --num-experts 4"


def config(extra: str = "", world: int = 2):  # noqa: ANN201 - a Config
    return parse_config([*BASE.split(), "--pipeline-model-parallel-size", "2", *extra.split()], world_size=world)[0]


def test_a_moe_model_at_two_stages_trains_on_the_pipeline_engine_and_at_one_on_the_plain_one() -> None:
    assert config().engine_kind == "pipeline"
    assert config("--zero-stage 1 --create-moe-param-group --moe-expert-parallel-size 2", world=4).engine_kind == (
        "pipeline"
    )
    assert parse_config(BASE.split(), world_size=1)[0].engine_kind == "plain"


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ("--checkpoint-activations", "--checkpoint-activations (--recompute-granularity full) at --pipeline-model"),
        ("--pp-schedule zbh1", "--pp-schedule zbh1 at --pipeline-model-parallel-size 2: mixture-of-experts"),
        ("--reset-position-ids", "--reset-position-ids / --reset-attention-mask at --pipeline-model-parallel-size 2"),
        ("--zero-stage 1", "--zero-stage 1 without --create-moe-param-group"),
        ("--zero-stage 2 --create-moe-param-group", "--zero-stage 2 with --pipeline-model-parallel-size 2"),
        ("--tensor-model-parallel-size 2", "--tensor-model-parallel-size 2: mixture-of-experts layers"),
    ],
)
def test_what_the_pipeline_engine_does_not_run_with_experts_is_one_line(extra: str, says: str) -> None:
    world = 4 if "tensor" in extra else 2
    with pytest.raises(ConfigError) as err:
        config(extra, world)
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_aggregate_is_started_carried_and_taken_off() -> None:
    h, ids = torch.ones(2, 3), (torch.zeros(2, 3, dtype=torch.long),) * 2
    start = moe_loss.add(None, None, h.device)  # a dense layer 0: a zero that DeepSpeed can run backward through
    assert start.item() == 0.0 and start.requires_grad and start.dtype == torch.float32
    l_aux = torch.tensor(0.5, dtype=torch.float64)
    out = moe_loss.give((h, *ids), moe_loss.add(start, l_aux, h.device))
    assert len(out) == 4 and out[-1].item() == 0.5 and out[-1].dtype == torch.float32
    rest, aggregate = moe_loss.take(out, carried=True)
    assert rest == (h, *ids) and aggregate is out[-1]
    assert moe_loss.take(moe_loss.give(h, aggregate), carried=True) == (h, aggregate)
    assert moe_loss.take(h, carried=False) == (h, None)


@pytest.mark.parametrize("data_first", [False, True])
def test_expert_groups_share_out_each_stages_data_parallel_ranks(data_first: bool) -> None:
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=4)  # stage s: ranks 4s .. 4s + 3
    expert, expert_data = expert_group_ranks(topo, 2, data_first)
    if data_first:  # DeepSpeed's use_data_before_expert_parallelism: every (D / E)-th rank shares out the experts
        assert expert == [[0, 2], [1, 3], [4, 6], [5, 7]] and expert_data == [[0, 1], [2, 3], [4, 5], [6, 7]]
    else:
        assert expert == [[0, 1], [2, 3], [4, 5], [6, 7]] and expert_data == [[0, 2], [1, 3], [4, 6], [5, 7]]


def _stage(layers: list[nn.Module]) -> nn.Module:
    stage = nn.Module()
    for i, layer in enumerate(layers):
        stage.add_module(str(i), layer)
    return stage


def test_every_stage_builds_the_same_expert_optimizer_groups() -> None:
    """--create-moe-param-group at P > 1: the stage of the embedding and a stage of dense layers get expert
    placeholders where a stage with experts has experts, so DeepSpeed's split gives every stage the same groups
    (ZeRO's per-group norm all-reduces span the stages); on a stage without experts they lose DeepSpeed's expert marks
    once grouped (its engine reduces a marked gradient by an expert group it knows only where a MoE layer is)."""
    cfg = config("--zero-stage 1 --create-moe-param-group")
    specs = build_layer_specs(cfg.model, cfg.regularization, 1, carry_moe_loss=True)
    first = len(naming.gpt_spec_groups(cfg.model).pre)
    with_experts, dense = _stage([specs[first + 1].build()]), _stage([specs[first].build()])
    shapes = []
    for stage in (with_experts, dense):
        add_group_placeholders(stage, expert_group="ep_size_1")
        optimizer = build_optimizer(stage, cfg.optimizer)
        shapes.append([(g["name"], g.get("moe", False)) for g in optimizer.param_groups])
    assert shapes[0] == shapes[1] == [("decay", False), ("no_decay", False), ("ep_size_1", True), ("ep_size_1", True)]
    marked = [n for n, p in dense.named_parameters() if hasattr(p, "allreduce")]
    assert marked == []
    assert any(not p.allreduce for p in with_experts.parameters() if hasattr(p, "allreduce"))


def test_the_memory_model_counts_each_stages_own_experts() -> None:
    """At P = 2 (Et|t*3L: a dense layer, then 4 experts on layers 2 and 4) and P = 3 (E|t*4|L) each stage's predicted
    parameters are those of the specs it holds (the last stage's tied head a copy of the word embedding), experts
    included, at E = 1 and 2 (the mean of every layer, as at P = 1, gave the first stage of Et|t*3L half of what an
    MoE layer holds beyond a dense one)."""
    model = dataclasses.replace(tiny_config().model, num_experts=(4,))
    cfg = tiny_config(model__num_experts=[4])
    specs = build_layer_specs(cfg.model, cfg.regularization, 1)
    built = [sum(p.numel() for p in s.build().parameters()) if hasattr(s, "build") else 0 for s in specs]
    groups = naming.gpt_spec_groups(model)
    for p, kwargs in ((2, {"layout": "Et|t*3L"}), (3, {"dedicated": "both"})):
        layout = build_layout(groups, p, **kwargs)
        for ep in (1, 2):
            inputs = MemoryInputs(model=model, micro_batch_size=2, num_micro_batches=4, expert_parallel_size=ep)
            for stage, predicted in enumerate(stage_memory(inputs, layout)):
                lo, hi = layout.parts[stage], layout.parts[stage + 1]
                held = sum(built[lo:hi]) - (model.num_experts[0] - 4 // ep) * _expert_params(model) * sum(
                    1 for i in range(lo, hi) if specs[i] is not None and _has_experts(model, groups, i)
                )
                assert predicted.num_params == held, (p, ep, stage, predicted.num_params, held)


def _expert_params(model) -> int:  # noqa: ANN001 - a ModelConfig
    h, f = model.hidden_size, model.ffn_hidden_size
    return 2 * h * f + f + h


def _has_experts(model, groups, index: int) -> bool:  # noqa: ANN001
    first = len(groups.pre)
    return first <= index < first + model.num_layers and model.experts_per_layer[index - first] > 1


def test_a_checkpoint_saved_at_two_stages_loads_anywhere_but_fp16_without_zero() -> None:
    """Saved at P = 2 it has a universal form and loads under another topology through it; saved in --fp16 without
    ZeRO (DeepSpeed's FP16_Optimizer) only under its own, said in one line."""
    saved = config()
    one = parse_config(BASE.split(), world_size=1)[0]
    meta = {"config": saved.to_dict(), "layout": "Et*2|t*2L", "world_size": 2, "optimizer_state": True}
    assert moe_pipeline_refusal(meta, saved, [], "ck") is None
    assert moe_pipeline_refusal(meta, one, ["layout Et*2|t*2L vs Et*4L"], "ck") is None
    assert universal_refusal(meta, "ck") is None
    export = moe_refusal(meta, "ck")
    assert export is not None and "resumes it under any pipeline size, layout, world size" in export
    fp16 = {**meta, "config": config("--fp16").to_dict()}
    line = moe_pipeline_refusal(fp16, one, ["layout Et*2|t*2L vs Et*4L"], "ck")
    assert line is not None and line.startswith("ck: a mixture-of-experts --fp16 checkpoint saved at pipeline size 2 ")
    assert "but layout Et*2|t*2L vs Et*4L; use the saved layout (Et*2|t*2L)" in line and "\n" not in line
    assert moe_pipeline_refusal(fp16, saved, [], "ck") is None
    assert "under the layout (Et*2|t*2L) and sizes it was saved with" in (moe_refusal(fp16, "ck") or "")
    zero1 = {**fp16, "config": config("--fp16 --zero-stage 1 --create-moe-param-group").to_dict()}
    assert moe_pipeline_refusal(zero1, one, ["x"], "ck") is None


def test_a_checkpoint_saved_at_one_stage_or_layout_free_loads_at_two() -> None:
    """Saved at P = 1, a universal checkpoint, or an import / conversion (weights in universal form): None at P = 2,
    whatever moved; saved at P = 2 and moved: None too (through its universal form)."""
    from megatron_ds.training.checkpoint.directory import CONVERTED

    staged = config()
    one = parse_config(BASE.split(), world_size=1)[0]
    meta = {"config": one.to_dict(), "layout": "Et*4L", "world_size": 1, "optimizer_state": True}
    assert moe_pipeline_refusal(meta, staged, ["layout Et*4L vs Et*2|t*2L", "world size 1 vs 2"], "ck") is None
    saved_staged = {"config": staged.to_dict(), "layout": "Et*2|t*2L", "world_size": 2}
    assert moe_pipeline_refusal(saved_staged, one, ["universal form"], "ck") is None
    converted = {**saved_staged, CONVERTED: {"upstream": "hf", "universal": "global_step0.universal"}}
    assert moe_pipeline_refusal(converted, one, ["hf (converted: ...)", "layout ..."], "ck") is None
    assert moe_pipeline_refusal(saved_staged, one, ["layout Et*2|t*2L vs Et*4L"], "ck") is None


def test_the_expert_record_keeps_each_stages_optimizer_groups(tmp_path: Path) -> None:
    """experts.json at P = 2, E = 1: each rank's stage, and each stage's groups apart (at P = 1 the record is as
    before: tests/unit/test_moe_universal.py)."""
    records = [
        {"expert_parallel_rank": 0, "expert_data_parallel_rank": 0, "stage": 0, "optimizer_groups": [["a"]]},
        {"expert_parallel_rank": 0, "expert_data_parallel_rank": 0, "stage": 1, "optimizer_groups": [["b"]]},
    ]
    experts.write(str(tmp_path), records)
    found = json.loads((tmp_path / experts.EXPERTS_FILE).read_text())
    assert found["stages"] == [0, 1] and found["optimizer_groups_by_stage"] == [[[["a"]]], [[["b"]]]]


def _staged_checkpoint(tmp: Path, layout: str, stages: list[int] | None, **fields: object):  # noqa: ANN202
    """A MoE checkpoint saved at P > 1: its metadata and `experts.json` (no tensors), enough for where things are."""
    from megatron_ds.training.checkpoint import reader
    from megatron_ds.training.checkpoint.directory import META

    world, ep = len(stages or [0, 1]), int(fields.get("parallel__expert_parallel_size", 1))
    cfg = tiny_config(model__num_experts=[4], parallel__world_size=world, **fields)
    directory = tmp / "global_step3"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / META).write_text(json.dumps({"config": cfg.to_dict(), "train_state": {}, "layout": layout}))
    (tmp / "latest").write_text("global_step3")
    ranks = [{"expert_parallel_rank": d % ep, "expert_data_parallel_rank": 0} for d in range(world)]
    record = {"format": 1, "expert_parallel_size": ep, "ranks": ranks, "optimizer_groups": [[["x"]]] * ep}
    if stages is not None:
        record.update(stages=stages, optimizer_groups_by_stage=[[[["x"]]] * ep for _ in range(1 + max(stages))])
    (directory / experts.EXPERTS_FILE).write_text(json.dumps(record))
    ckpt = reader.open_checkpoint(str(tmp), moe=True)
    ckpt.meta["world_size"] = world
    return ckpt


def test_a_staged_checkpoint_is_read_from_each_stages_files(tmp_path: Path) -> None:
    """P = 2 x DP = 2 at E = 2 under ZeRO-1: a tensor is read from its stage's files, a dense one from both of the
    stage's data-parallel ranks, expert 3 of spec 6 (local expert 1) from expert-parallel rank 1 of stage 1 only; at
    P = 3 with a dedicated embedding stage, that stage's optimizer state is in its model-state file."""
    from megatron_ds.training.checkpoint.universal import names
    from megatron_ds.training.checkpoint.universal.zero3_source import open_source

    fields = {"parallel__pipeline_model_parallel_size": 2, "parallel__expert_parallel_size": 2}
    zero1 = {"training__zero_stage": 1, "optimizer__create_moe_param_group": True}
    source = open_source(_staged_checkpoint(tmp_path / "p2", "Et*2|t*2L", [0, 0, 1, 1], **fields, **zero1))
    assert type(source).__name__ == "MoePipelineSource" and source.flat
    tensors = {t.name: t for t in names.model_tensors(source.model)}
    expert = tensors["06.TransformerLayer.moe.deepspeed_moe.experts.deepspeed_experts.3.fc1.weight"]
    local = "6.moe.deepspeed_moe.experts.deepspeed_experts.1.fc1.weight"
    assert source._holders(expert) == [(3, local)]
    assert source._zero_file(3).endswith("/zero_pp_rank_1_mp_rank_01_optim_states.pt")
    qkv = tensors["04.TransformerLayer.qkv.weight"]
    assert source._holders(qkv) == [(0, "4.qkv.weight"), (1, "4.qkv.weight")]
    assert source._zero_file(1).endswith("/zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert source._weight_location(expert) == ("layer_0_expert_3_mp_rank_01_model_states.pt", None, "6." + expert.key)
    three = {"parallel__pipeline_model_parallel_size": 3}
    source = open_source(_staged_checkpoint(tmp_path / "p3", "E|t*4|L", [0, 1, 2], **three))
    assert not source.flat and source.moe_stages == {1}
    assert source._optimizer_file(0, 0).endswith("/mp_rank_00_model_states.pt")
    assert source._optimizer_file(1, 0).endswith("/expp_rank_0_mp_rank_01_optim_states.pt")
    assert source._stage(tensors["01.WordEmbedding.weight"]) == 0


def test_a_staged_checkpoint_without_each_ranks_stage_is_one_line(tmp_path: Path) -> None:
    from megatron_ds.training.checkpoint.directory import CheckpointError
    from megatron_ds.training.checkpoint.universal.zero3_source import open_source

    ckpt = _staged_checkpoint(tmp_path, "Et*2|t*2L", None, parallel__pipeline_model_parallel_size=2)
    with pytest.raises(CheckpointError, match="records no stage of each rank at pipeline size 2") as err:
        open_source(ckpt)
    assert "resume it under the layout, sizes, ZeRO stage and precision it was saved with" in str(err.value)
    assert "\n" not in str(err.value)
