"""The schedule flags of every upstream: --pp-schedule, Megatron-DeepSpeed's --enable-zbh1-pipeline
(and its exact semantics), Megatron-LM's virtual stages (--num-virtual-stages-per-pipeline-rank, a
layout of k x P stages, --num-layers-per-virtual-pipeline-stage); each conflict is one line."""

from __future__ import annotations

import pytest

from megatron_ds.errors import UserError
from megatron_ds.flags.parser import parse_config

BASE = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
BASE += ["--vocab-size", "128", "--train-iters", "1", "--lr", "1e-3", "--pipeline-model-parallel-size", "4"]
BASE += ["--micro-batch-size", "1", "--global-batch-size", "8"]


def parallel(*argv: str):
    return parse_config([*BASE, *argv], world_size=4)[0].parallel


def error(*argv: str) -> str:
    with pytest.raises(UserError) as err:
        parse_config([*BASE, *argv], world_size=4)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_default_is_deepspeeds_1f1b() -> None:
    par = parallel()
    assert (par.pipeline_schedule, par.virtual_stages) == ("1f1b", 1)


def test_zbh1_from_megatron_deepspeeds_flag_with_a_notice_without_exact_semantics(capsys) -> None:
    assert parallel("--enable-zbh1-pipeline").pipeline_schedule == "zbh1"
    assert "NOTICE: --enable-zbh1-pipeline runs ZB-H1 with exact semantics here" in capsys.readouterr().out
    assert parallel("--enable-zbh1-pipeline", "--enable-zbh1-exact-semantics").pipeline_schedule == "zbh1"
    assert "NOTICE" not in capsys.readouterr().out
    assert parallel("--pp-schedule", "zbh1").pipeline_schedule == "zbh1"


def test_zbh1_conflicts() -> None:
    assert "needs --enable-zbh1-pipeline" in error("--enable-zbh1-exact-semantics")
    assert "--enable-zbh1-pipeline and --pp-schedule 1f1b were both given" in error(
        "--enable-zbh1-pipeline", "--pp-schedule", "1f1b"
    )
    assert "ZeRO 0 and 1 only" in error(
        "--pp-schedule", "zbh1", "--zero-stage", "2", "--pipeline-model-parallel-size", "1"
    )


@pytest.mark.parametrize(
    "argv,v",
    [
        (["--num-virtual-stages-per-pipeline-rank", "2"], 2),
        (["--num-layers-per-virtual-pipeline-stage", "1"], 2),  # (8 / 4) / 1
        (["--pipeline-model-parallel-layout", "Et|t|t|t|t|t|t|tL"], 2),
        (["--pp-layout", "E|t*2|t|t|t|t|t*2|L"], 2),
        (["--num-virtual-stages-per-pipeline-rank", "2", "--pp-schedule", "interleaved"], 2),
    ],
)
def test_virtual_stages_select_the_interleaved_schedule(argv: list[str], v: int) -> None:
    par = parallel(*argv)
    assert (par.pipeline_schedule, par.virtual_stages, par.num_flat_stages) == ("interleaved", v, 4 * v)


def test_virtual_stage_conflicts() -> None:
    assert "run only on the interleaved schedule, not --pp-schedule 1f1b" in error(
        "--num-virtual-stages-per-pipeline-rank", "2", "--pp-schedule", "1f1b"
    )
    assert "needs 2 or more model chunks per rank" in error("--pp-schedule", "interleaved")
    assert "were both given; Megatron-LM takes one of them" in error(
        "--num-virtual-stages-per-pipeline-rank", "2", "--num-layers-per-virtual-pipeline-stage", "1"
    )
    assert "whole number of chunks of 3 layers" in error("--num-layers-per-virtual-pipeline-stage", "3")
    # 10 micro-batches on 4 ranks: torch's interleaved order runs 2 rounds of 5; 9 would not divide
    assert parallel("--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "10").virtual_stages == 2
    assert "max(1, M // P) rounds, which must divide M" in error(
        "--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "9"
    )


def test_a_layout_of_several_stages_on_one_rank_names_the_layout_not_the_interleaved_schedule() -> None:
    """It said '--pp-schedule interleaved needs --pipeline-model-parallel-size 2 or more', a flag the line lacked."""
    for flag in ("--pp-layout", "--pipeline-model-parallel-layout"):
        got = error("--pipeline-model-parallel-size", "1", flag, "E|t*4|t*4|L")
        assert got == (
            f"{flag} 'E|t*4|t*4|L' has 4 stages but --pipeline-model-parallel-size is 1; give "
            "--pipeline-model-parallel-size 4 (a divisor of it from 2 up makes virtual stages), or a one-stage layout"
        )
    assert parallel("--pipeline-model-parallel-size", "1", "--pp-layout", "Et*8L").virtual_stages == 1


def test_methods_that_balance_one_stage_per_rank_are_refused_with_virtual_stages() -> None:
    from megatron_ds.errors import LayoutError
    from megatron_ds.estimate.machine import CPU
    from megatron_ds.estimate.run_layout import build_run_layout

    argv = ["--num-virtual-stages-per-pipeline-rank", "2", "--pp-partition-method", "memory"]
    with pytest.raises(LayoutError, match="balances one stage per rank, not 2 model chunks per rank"):
        build_run_layout(parse_config([*BASE, *argv], world_size=4)[0], CPU)


def test_zbh1_with_immediate_grad_update_is_refused_before_launch_and_by_print_layout(tmp_path, capsys) -> None:
    """The check ran in the builder, after the process group (once per rank), and --print-layout missed it."""
    import json

    import pretrain_gpt

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"bf16": {"enabled": True, "immediate_grad_update": True}}))
    argv = [*BASE, "--mock-data", "--bf16", "--pp-schedule", "zbh1", "--deepspeed_config", str(ds)]
    assert pretrain_gpt.main([*argv, "--print-layout", "--world-size", "4"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --pp-schedule zbh1 and the DeepSpeed JSON's bf16.immediate_grad_update: true: the deferred weight "
        "gradients would miss the fp32 accumulation; drop immediate_grad_update"
    )
    ds.write_text(json.dumps({"bf16": {"enabled": True}}))
    assert pretrain_gpt.main([*argv, "--print-layout", "--world-size", "4"]) == 0
