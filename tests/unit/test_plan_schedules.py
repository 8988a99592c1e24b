"""The planner tries every pipeline schedule it can run (1F1B, ZB-H1, interleaved with v = 2; v = 3, 4 for
the fastest configuration), ranks them by predicted seconds with 1F1B first on ties, and its choice reaches
the printed command and the JSON."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_ds.estimate import pipeline_schedules
from megatron_ds.flags.parser import parse_config
from megatron_ds.plan import ds_json, no_fit, ranking, runnable_schedules, search
from megatron_ds.plan.__main__ import main
from megatron_ds.plan.hardware import PlanError
from megatron_ds.plan.inputs import PlanInputs, resolve
from megatron_ds.plan.zero_options import choose_all

JOB = dict(model="1.3b", num_gpus=32, gpus_per_node=8, gpu="A100-40GB", global_batch_size=64)


def _command_config(res, cand):
    config = ds_json.plan_config(res, cand)
    argv = ds_json.command_flags(config, res.dims["vocab_size"]) + list(res.dims.get("architecture", ()))
    parsed, _ = parse_config([*map(str, argv), "--train-iters", "10", "--lr", "1e-4"], world_size=res.num_gpus)
    return config, parsed


def test_schedules_are_tried_only_where_the_engine_runs_them() -> None:
    res = resolve(PlanInputs(**JOB))
    assert runnable_schedules.schedules_for(res, 1, 1, 1, 2) == [("1f1b", 1)]  # P = 1: nothing to schedule
    assert runnable_schedules.schedules_for(res, 1, 4, 1, 2) == [("1f1b", 1)]  # ZeRO-2 runs on the plain engine
    assert runnable_schedules.schedules_for(res, 1, 4, 1, 1) == [("1f1b", 1), ("zbh1", 1), ("interleaved", 2)]
    # 24 layers do not split into 2 x 16 chunks; at micro-batch 4, 2 micro-batches are no multiple of P = 4
    assert ("interleaved", 2) not in runnable_schedules.schedules_for(
        resolve(PlanInputs(**{**JOB, "num_gpus": 16})), 1, 16, 1, 1
    )
    assert ("interleaved", 2) not in runnable_schedules.schedules_for(res, 1, 4, 4, 1)


def test_the_chosen_schedule_is_the_fastest_and_reaches_the_command_and_json(capsys) -> None:
    argv = ["pipeline", "--model", "1.3b", "--num-gpus", "32", "--gpu", "A100-40GB", "--global-batch-size", "64"]
    assert main([*argv, "--pipeline-model-parallel-size", "4", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    section = next(s for s in report["sections"] if s["name"] == "pipeline")
    data = section["data"]
    assert data["pipeline_parallel"] == 4 and data["pipeline_schedule"] == "zbh1" and data["virtual_stages"] == 1
    assert "--pp-schedule zbh1" in section["snippets"]["command"]
    res = resolve(PlanInputs(**JOB, pipeline_model_parallel_size=4))
    dp, mb = 32 // (data["tensor_parallel"] * 4), data["micro_batch_size"]
    t, recompute = data["tensor_parallel"], data["checkpoint_activations"]
    selective = data["selective_recompute"]
    seconds = {  # the default layout, as the search prices them before refining the winner's
        name: search.evaluate(
            res, t, 4, mb, 1, "bf16", recompute, "none", schedule=name, virtual_stages=v, selective=selective
        ).seconds
        for name, v in runnable_schedules.schedules_for(res, t, 4, mb, 1)
    }
    assert min(seconds, key=seconds.get) == "zbh1" and data["step_seconds"] <= seconds["zbh1"] < seconds["1f1b"]
    assert dp * mb * data["gradient_accumulation_steps"] == 64


def test_an_interleaved_candidate_prints_its_flags_and_parses_back() -> None:
    res = resolve(PlanInputs(**JOB))
    cand = search.evaluate(res, 1, 4, 1, 1, "bf16", False, "none", schedule="interleaved", virtual_stages=2)
    assert len(cand.layout.layers_per_stage) == 8 and len(cand.stages) == 4 and len(cand.time.forward) == 8
    assert len(cand.rank_times) == 4 and cand.schedule.display == "interleaved 1F1B (v=2)"
    config, parsed = _command_config(res, cand)
    flags = ds_json.command_flags(config, res.dims["vocab_size"])
    assert flags[flags.index("--pp-schedule") + 1] == "interleaved"
    assert flags[flags.index("--num-virtual-stages-per-pipeline-rank") + 1] == "2"
    assert parsed.parallel.pipeline_schedule == "interleaved" and parsed.parallel.virtual_stages == 2
    one = search.evaluate(res, 1, 4, 1, 1, "bf16", False, "none")
    assert "--pp-schedule" not in ds_json.command_flags(ds_json.plan_config(res, one), res.dims["vocab_size"])


def test_ties_prefer_1f1b() -> None:
    res = resolve(PlanInputs(**JOB))
    one = search.evaluate(res, 1, 4, 1, 1, "bf16", False, "none")
    same = dataclasses.replace(one, inputs=dataclasses.replace(one.inputs, schedule="zbh1"))
    assert same.seconds == one.seconds and sorted([same, one], key=ranking.rank_key)[0] is one


def test_the_choice_is_refined_over_every_schedule_and_v_and_the_report_lists_them_in_seconds(capsys) -> None:
    """The search tries v = 2; the fastest configuration is then priced under every schedule it can run,
    interleaving at v = 2, 3, 4 where the layers split, and the choice is the fastest of those that fit. The
    report's schedule lines are those prices, the choice's first at 1.000."""
    res = resolve(PlanInputs(**JOB))
    assert runnable_schedules.schedule_options(res, 1, 4, 1, 1) == [
        ("1f1b", 1),
        ("zbh1", 1),
        ("interleaved", 2),
        ("interleaved", 3),
    ]  # fmt: skip  (24 layers: 8 and 12 chunks, not 16)
    argv = ["pipeline", "--model", "1.3b", "--num-gpus", "32", "--gpu", "A100-40GB", "--global-batch-size", "64"]
    assert main([*argv, "--pipeline-model-parallel-size", "4"]) == 0
    out = capsys.readouterr().out
    lines = out[out.index("Pipeline schedules, each") :].splitlines()[1:]
    lines = lines[: next(i for i, line in enumerate(lines) if not line.startswith("  "))]
    assert "(1.000 x the choice)" in lines[0] and len(lines) == 4, lines
    assert any(
        "interleaved 1F1B (v=3)" in line and "--num-virtual-stages-per-pipeline-rank 3" in line for line in lines
    )
    res4 = resolve(PlanInputs(**JOB, pipeline_model_parallel_size=4))
    choice = choose_all(res4, "bf16")
    tried = choice.alternatives(res4)
    fitting = [t.candidate for t in tried if t.candidate is not None and search.fits(res4, t.candidate)]
    assert {t.schedule for t in tried} == {("1f1b", 1), ("zbh1", 1), ("interleaved", 2), ("interleaved", 3)}
    assert choice.candidate.seconds == min(c.seconds for c in fitting)
    priced = [float(line.split("step ")[1].split(" s ")[0].replace(",", "")) for line in lines]
    assert priced == sorted(priced) and abs(priced[0] - choice.candidate.seconds) < 1e-3 * priced[0]


def test_schedules_too_long_to_replay_are_left_out_and_named() -> None:
    """Past REPLAY_LIMIT micro-batches x stages x chunks the search and the refinement price 1F1B alone (its
    closed form); the report's schedule lines name what was left out."""
    res = resolve(PlanInputs(**{**JOB, "global_batch_size": 131072}))
    # t = 1, p = 4: 8 data-parallel ranks; micro-batch 1 gives M = 16384 (65536 steps), micro-batch 16 M = 1024
    assert runnable_schedules.schedules_for(res, 1, 4, 1, 1) == [("1f1b", 1)]
    assert runnable_schedules.too_long_to_replay(res, 1, 4, 1, 1) == [
        ("zbh1", 1),
        ("interleaved", 2),
        ("interleaved", 3),
    ]
    assert runnable_schedules.schedule_options(res, 1, 4, 16, 1) == [
        ("1f1b", 1), ("zbh1", 1), ("interleaved", 2), ("interleaved", 3),
    ]  # fmt: skip
    limit = search.REPLAY_LIMIT
    assert all(1024 * 4 * v <= limit < 16384 * 4 * v for _, v in runnable_schedules.too_long_to_replay(res, 1, 4, 1, 1))


def test_misses_are_priced_under_the_own_schedule_and_retimed_under_the_chosen_one() -> None:
    """The refinement times every layout under the search's own schedule and only fitting ones under the others;
    `retimed` prices a schedule's misses too (the layout table of a choice that switched schedule)."""
    res = resolve(PlanInputs(**JOB))
    top = search.evaluate(res, 1, 4, 1, 1, "bf16", False, "none")
    tight = dataclasses.replace(res, gpu_memory_bytes=top.peak.total * 0.99 / (1 - res.headroom))
    tried = ranking.alternatives(tight, top)
    priced = [t for t in tried if t.candidate is not None]
    assert all(t.candidate.time is not None for t in priced if t.schedule == ("1f1b", 1))
    misses = [t for t in priced if t.schedule == ("zbh1", 1) and not search.fits(tight, t.candidate)]
    assert misses and all(t.candidate.time is None for t in misses)
    again = ranking.retimed(tight, tried, ("zbh1", 1))
    assert all(t.candidate.time is not None for t in again if t.schedule == ("zbh1", 1) and t.candidate is not None)
    assert [t for t in again if t.schedule != ("zbh1", 1)] == [t for t in tried if t.schedule != ("zbh1", 1)]


def _planned(argv: list[str], capsys) -> dict:
    base = ["pipeline", "--model", "1.3b", "--num-gpus", "32", "--gpu", "A100-40GB", "--global-batch-size", "64"]
    assert main([*base, *argv, "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    return next(s for s in report["sections"] if s["name"] == "pipeline")


def test_a_schedule_the_flags_fix_is_the_one_planned_and_priced(capsys) -> None:
    """pretrain_gpt.py's --pp-schedule, --enable-zbh1-pipeline and --num-virtual-stages-per-pipeline-rank fix
    what the search otherwise chooses (here ZB-H1 at P = 4, the previous test): the plan prices the user's
    own schedule, and its refinement lists no other."""
    free = _planned(["--pipeline-model-parallel-size", "4"], capsys)["data"]
    assert free["pipeline_schedule"] == "zbh1"
    for flags, want in (
        (["--pp-schedule", "1f1b"], ("1f1b", 1)),
        (["--enable-zbh1-pipeline"], ("zbh1", 1)),
        (["--num-virtual-stages-per-pipeline-rank", "3"], ("interleaved", 3)),
        (["--pp-schedule", "interleaved"], None),  # v chosen among 2, 3, 4
    ):
        section = _planned(["--pipeline-model-parallel-size", "4", *flags], capsys)
        data = section["data"]
        got = (data["pipeline_schedule"], data["virtual_stages"])
        assert got == want if want else got[0] == "interleaved" and got[1] in (2, 3, 4), (flags, got)
        assert data["step_seconds"] >= free["step_seconds"] - 1e-9  # the free search's choice is the fastest
        listed = [line for line in section["text"] if "x the choice)" in line]  # the schedules the report compares
        label = pipeline_schedules.find(got[0], got[1] if got[0] == "interleaved" else None).display
        # one schedule when the flags fix its v; with interleaving alone, its v = 2 and 3 (24 layers: no 4 x 4 chunks)
        assert len(listed) == (1 if want else 2) and all(line.strip().startswith(label[:11]) for line in listed), listed
        res = resolve(PlanInputs(**JOB, pipeline_model_parallel_size=4))
        t, mb = data["tensor_parallel"], data["micro_batch_size"]
        recompute, selective = data["checkpoint_activations"], data["selective_recompute"]
        priced = search.evaluate(
            res, t, 4, mb, 1, "bf16", recompute, data["layout_method"], schedule=got[0], virtual_stages=got[1],
            selective=selective,
        )  # fmt: skip
        assert data["step_seconds"] == priced.seconds


def test_fixed_schedules_only_where_the_engine_runs_them() -> None:
    fixed = resolve(PlanInputs(**JOB, pp_schedule="interleaved", num_virtual_stages_per_pipeline_rank=3))
    assert fixed.schedule == ("interleaved", 3)
    assert runnable_schedules.schedules_for(fixed, 1, 4, 1, 1) == [("interleaved", 3)]  # 24 layers = 3 x 4 x 2
    assert runnable_schedules.schedules_for(fixed, 1, 16, 1, 1) == []  # 24 layers are not 3 x 16 chunks
    assert (
        runnable_schedules.schedules_for(fixed, 1, 1, 1, 1) == []
        and runnable_schedules.schedules_for(fixed, 1, 4, 1, 2) == []
    )
    zbh1 = resolve(PlanInputs(**JOB, enable_zbh1_pipeline=True))
    assert zbh1.schedule == ("zbh1", 1) and runnable_schedules.schedules_for(zbh1, 1, 1, 1, 1) == [("zbh1", 1)]
    assert runnable_schedules.schedules_for(zbh1, 1, 1, 1, 2) == []  # ZeRO-2 runs on the plain engine: no schedule
    one = resolve(PlanInputs(**JOB, num_virtual_stages_per_pipeline_rank=1))
    assert one.schedule == (None, 1) and runnable_schedules.schedules_for(one, 1, 4, 1, 1) == [("1f1b", 1), ("zbh1", 1)]
    assert resolve(PlanInputs(**JOB)).schedule == (None, None)


def test_a_fixed_schedule_too_long_to_replay_is_named_as_such() -> None:
    """A fixed schedule that runs only where its replay passes REPLAY_LIMIT is refused for that reason (not
    as one no configuration runs), naming the shortest; a no-fit message names what was left unpriced."""
    big = {**JOB, "global_batch_size": 131072}
    fixed = dict(pp_schedule="interleaved", num_virtual_stages_per_pipeline_rank=2, micro_batch_size=1)
    res = resolve(PlanInputs(**big, **fixed, pipeline_model_parallel_size=4, tensor_model_parallel_size=1))
    # t = 1, p = 4: 8 data-parallel ranks, M = 16384 micro-batches, 16384 x 4 x 2 replay steps
    assert runnable_schedules.unreplayed(res, 1, 4, [1], 1) == [runnable_schedules.Unreplayed(131072, 1, 4, 1)]
    with pytest.raises(PlanError) as e:
        choose_all(res, "bf16")
    message = str(e.value)
    assert message.startswith("--pp-schedule interleaved with --num-virtual-stages-per-pipeline-rank 2 cannot be")
    assert "replay too long" in message and "t=1, p=4, micro-batch 1, 131,072)" in message
    assert "runs on no configuration" not in message
    free = resolve(PlanInputs(**big, pipeline_model_parallel_size=4, tensor_model_parallel_size=1, micro_batch_size=1))
    assert runnable_schedules.unreplayed(free, 1, 4, [1], 1) == [
        runnable_schedules.Unreplayed(65536, 1, 4, 1), runnable_schedules.Unreplayed(131072, 1, 4, 1),
    ]  # fmt: skip
    skipped = [runnable_schedules.Unreplayed(131072, 1, 4, 1), runnable_schedules.Unreplayed(65536, 2, 4, 1)]
    said = no_fit.no_fit_message(res, None, [(1e12, 1, 4)], True, (), skipped)
    assert "2 configurations that run it were not priced, each replay too long" in said
    assert "the shortest: t=2, p=4, micro-batch 1, 65,536)" in said
    assert "not priced" not in no_fit.no_fit_message(res, None, [(1e12, 1, 4)], True, ())
