"""DeepSpeed's activation-checkpointing flags: flags -> config -> deepspeed.checkpointing.configure's keywords, the
NOTICEs where upstream configures nothing or the option changes nothing, every refusal (one line, before any process
group), the user JSON's section against the flags, and the contiguous buffers' slot count read off the schedule."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ds.config import Config
from megatron_ds.errors import ConfigError
from megatron_ds.estimate import pipeline_schedules
from megatron_ds.estimate.machine import CPU, Machine
from megatron_ds.flags.parser import build_parser
from megatron_ds.flags.to_config import build_config
from megatron_ds.model import naming
from megatron_ds.pipeline.layout import Layout, build_layout
from megatron_ds.testing.scenario import tiny_config
from megatron_ds.training import activation_checkpointing as ac
from megatron_ds.training import deepspeed_config as dsc

ROOT = Path(__file__).resolve().parents[2]
BASE = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 128 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 10 --lr 1e-3"
).split()
ON = ["--deepspeed-activation-checkpointing", "--checkpoint-activations"]
FIVE = [
    "--partition-activations",
    "--contigious-checkpointing",
    "--checkpoint-in-cpu",
    "--synchronize-each-layer",
    "--profile-backward",
]
FIELDS = (
    "partition_activations",
    "contiguous_checkpointing",
    "checkpoint_in_cpu",
    "synchronize_each_layer",
    "profile_backward",
)


def parse(*argv: str, world_size: int = 2, machine: Machine | None = None) -> Config:
    args = build_parser().parse_args([*BASE, *argv])
    return build_config(args, world_size=world_size, machine=machine)


def fields(config: Config) -> dict[str, bool]:
    return {f: getattr(config.training, f) for f in FIELDS}


def test_the_five_flags_set_the_config_under_deepspeed_activation_checkpointing(capsys: pytest.CaptureFixture) -> None:
    config = parse(*ON, *FIVE, "--tensor-model-parallel-size", "2", machine=Machine(device="cuda"))
    assert fields(config) == dict.fromkeys(FIELDS, True)
    assert tuple(capsys.readouterr()) == ("", "")  # T = 2 on a GPU: every option does something
    assert fields(parse(*ON)) == dict.fromkeys(FIELDS, False)
    assert fields(parse(*ON, "--synchronize-each-layer")) == {
        **dict.fromkeys(FIELDS, False),
        "synchronize_each_layer": True,
    }


def test_without_deepspeed_activation_checkpointing_they_change_nothing_as_upstream(
    capsys: pytest.CaptureFixture,
) -> None:
    """Megatron-DeepSpeed calls deepspeed.checkpointing.configure only under --deepspeed-activation-checkpointing."""
    assert fields(parse("--checkpoint-activations", "--partition-activations", "--checkpoint-in-cpu")) == dict.fromkeys(
        FIELDS, False
    )
    assert capsys.readouterr().out == (
        "NOTICE: --partition-activations and --checkpoint-in-cpu change nothing without "
        "--deepspeed-activation-checkpointing: Megatron-DeepSpeed configures deepspeed.checkpointing with them only "
        "under it; add --deepspeed-activation-checkpointing\n"
    )


def test_without_recomputation_they_change_nothing(capsys: pytest.CaptureFixture) -> None:
    assert fields(parse("--deepspeed-activation-checkpointing", "--profile-backward")) == dict.fromkeys(FIELDS, False)
    out, err = capsys.readouterr()
    assert "NOTICE: --profile-backward changes nothing: no layer is recomputed; add --checkpoint-activations" in out
    assert "recomputes nothing by itself" in err  # the warning --deepspeed-activation-checkpointing alone gives


def test_notices_for_what_changes_nothing_at_t1_or_on_cpu(capsys: pytest.CaptureFixture) -> None:
    config = parse(*ON, *FIVE, world_size=1, machine=CPU)
    assert fields(config) == dict.fromkeys(FIELDS, True)  # accepted and run, as upstream runs them
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[1].strip() for ln in lines] == [
        "--partition-activations changes nothing at --tensor-model-parallel-size 1",
        "--checkpoint-in-cpu changes nothing on a CPU device",
        "--synchronize-each-layer changes nothing on a CPU device",
    ]
    parse(*ON, "--checkpoint-in-cpu", "--synchronize-each-layer", world_size=1, machine=Machine(device="cuda"))
    assert tuple(capsys.readouterr()) == ("", "")


REFUSALS = [
    (
        [*ON, "--contigious-checkpointing"],
        "--contigious-checkpointing needs --partition-activations: DeepSpeed keeps only partitioned checkpoints in "
        "contiguous buffers (deepspeed.checkpointing.configure asserts it); add --partition-activations or drop "
        "--contigious-checkpointing",
    ),
    (
        [*ON, "--partition-activations", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
        "--partition-activations with --sequence-parallel at --tensor-model-parallel-size 2: each tensor rank's "
        "checkpointed input is already its own 1/2 of the sequence, and DeepSpeed's partitioning assumes inputs equal "
        "on every tensor rank (its all-gather would join pieces of different tensors); drop one of them",
    ),
    (
        ["--deepspeed-activation-checkpointing", "--recompute-activations", "--partition-activations"],
        "--partition-activations with selective recomputation (--recompute-activations / --recompute-granularity "
        "selective): it configures full recomputation's checkpoints (each recomputed chunk's input, the same on every "
        "tensor rank); selective recomputation checkpoints each rank's own q, k and v, which partitioning would mix "
        "across tensor ranks; use --checkpoint-activations or drop --partition-activations",
    ),
    (
        ["--deepspeed-activation-checkpointing", "--recompute-granularity", "selective", "--checkpoint-in-cpu"],
        "--checkpoint-in-cpu with selective recomputation",
    ),
]


@pytest.mark.parametrize("argv,message", REFUSALS)
def test_refusals_are_one_line_naming_the_flags(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(*argv)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_python_config_is_held_to_the_same_rules() -> None:
    with pytest.raises(ConfigError, match="^--checkpoint-in-cpu needs full recomputation"):
        tiny_config(training__checkpoint_in_cpu=True)
    with pytest.raises(ConfigError, match="^--contigious-checkpointing needs --partition-activations"):
        tiny_config(training__checkpoint_activations=True, training__contiguous_checkpointing=True)
    tiny_config(training__selective_recompute=True, training__synchronize_each_layer=True)  # any recomputation


def test_the_pretrain_script_refuses_in_one_line_without_traceback() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_gpt.py"), *BASE, *ON, "--contigious-checkpointing", "--print-layout"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1 and "--contigious-checkpointing needs --partition-activations" in out.stderr


# --- the user JSON's activation_checkpointing section -------------------------------------------------------


def test_the_json_section_must_agree_with_the_flags(tmp_path: Path) -> None:
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"activation_checkpointing": {"partition_activations": True, "profile": False}}))
    on = tiny_config(
        training__checkpoint_activations=True,
        training__partition_activations=True,
        training__deepspeed_config=str(user),
    )
    assert dsc.build(on)["activation_checkpointing"]["partition_activations"] is True
    with pytest.raises(dsc.DeepSpeedConfigError) as err:
        dsc.build(on.replace(training__partition_activations=False))
    assert str(err.value) == (
        f"--deepspeed_config {user} sets activation_checkpointing.partition_activations true but "
        f"--partition-activations makes it false; set it to false or remove it, or give --partition-activations "
        f"(with --deepspeed-activation-checkpointing and recomputation on, where it takes effect)"
    )
    with pytest.raises(dsc.DeepSpeedConfigError, match="activation_checkpointing.profile false but --profile-backward"):
        dsc.build(on.replace(training__profile_backward=True))


def test_number_checkpoints_in_the_json_is_replaced_with_a_notice(tmp_path: Path) -> None:
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"activation_checkpointing": {"number_checkpoints": 48}}))
    notices = dsc.launch_notices(tiny_config(training__deepspeed_config=str(user)))
    assert [n for n in notices if "number_checkpoints 48" in n]


# --- configure's keywords and the contiguous buffers' slots -------------------------------------------------


def simulated_calls(num_pre: int, num_layers: int, num_post: int, interval: int) -> int:
    """PipelineModule.forward's loop written out: chunks of `interval` functions from local index 0, checkpointed
    when every function in the chunk is a transformer layer."""
    kinds = ["pre"] * num_pre + ["layer"] * num_layers + ["post"] * num_post
    chunks = [kinds[i : i + interval] for i in range(0, len(kinds), interval)]
    return sum(1 for c in chunks if all(k == "layer" for k in c))


def test_checkpoint_calls_follow_pipeline_module_chunking() -> None:
    for pre in range(4):
        for layers in range(7):
            for post in range(4):
                for interval in range(1, 5):
                    got = ac.checkpoint_calls(pre, layers, post, interval)
                    assert got == simulated_calls(pre, layers, post, interval), (pre, layers, post, interval)
    assert ac.checkpoint_calls(3, 4, 0, 0) == 0  # no recomputation


def uneven(config: Config, layout: str = "Et*3|tL") -> Layout:
    return build_layout(
        naming.gpt_spec_groups(config.model), config.parallel.pipeline_model_parallel_size, layout=layout
    )


def recompute(**overrides: object) -> Config:
    return tiny_config(training__checkpoint_activations=True, **overrides)


def test_slots_are_the_checkpoints_a_rank_keeps_before_a_backward_empties_them() -> None:
    """1F1B, P=2, 4 micro-batches: stage 0 (three layers) runs two forwards before its first backward, 6 checkpoints
    (Megatron-DeepSpeed's num_layers / checkpoint_num_layers, 4, would index past DeepSpeed's buffers); the last
    stage one forward, its one layer. ZB-H1's input-gradient backwards recompute as 1F1B's do."""
    config = recompute(parallel__pipeline_model_parallel_size=2)
    layout = uneven(config)
    assert [ac.chunk_calls(config, layout, r) for r in (0, 1)] == [(3,), (1,)]
    assert [ac.checkpoint_slots(config, layout, r) for r in (0, 1)] == [6, 1]
    zbh1 = config.replace(parallel__pipeline_schedule="zbh1")
    assert [ac.checkpoint_slots(zbh1, layout, r) for r in (0, 1)] == [6, 1]
    one_micro = config.replace(training__global_batch_size=2)  # one micro-batch: nothing else in flight
    assert ac.checkpoint_slots(one_micro, layout, 0) == 3
    chunks_of_two = config.replace(training__checkpoint_num_layers=2)  # stage 0: [E, E, E, t] [t, t] -> one call
    assert [ac.checkpoint_slots(chunks_of_two, layout, r) for r in (0, 1)] == [2, 0]


def test_slots_on_the_plain_engine_and_under_interleaving() -> None:
    plain = recompute(training__zero_stage=2)
    layout = build_layout(naming.gpt_spec_groups(plain.model), 1)
    assert ac.checkpoint_slots(plain, layout, 0) == 4  # one forward, then its backward
    chunked = recompute(
        parallel__pipeline_model_parallel_size=2, parallel__pipeline_schedule="interleaved", parallel__virtual_stages=2
    )
    layout = build_layout(naming.gpt_spec_groups(chunked.model), 2, virtual_stages=2)
    schedule = pipeline_schedules.find("interleaved", 2)
    for rank in (0, 1):
        calls = ac.chunk_calls(chunked, layout, rank)
        flight = max(
            sum(calls[c] * n for c, n in enumerate(moment[0]))
            for moment in pipeline_schedules.backward_moments(schedule, 4, 2, rank)
        )
        assert ac.checkpoint_slots(chunked, layout, rank) >= flight  # never fewer than the calls alive at a backward


def test_a_batch_ramp_up_sizes_the_slots_for_its_largest_step() -> None:
    ramp = recompute(
        parallel__pipeline_model_parallel_size=2, training__global_batch_size=8, training__rampup_batch_size=(2, 2, 8)
    )
    assert ac.checkpoint_slots(ramp, uneven(ramp), 0) == 6


def test_options_are_configure_keywords_and_host_copies_stay_off_on_cpu() -> None:
    config = recompute(
        parallel__pipeline_model_parallel_size=2,
        training__partition_activations=True,
        training__contiguous_checkpointing=True,
        training__checkpoint_in_cpu=True,
        training__profile_backward=True,
    )
    layout = uneven(config)
    assert ac.options(config, layout, 0, "cuda") == ac.CheckpointOptions(
        partition_activations=True,
        contiguous_checkpointing=True,
        num_checkpoints=6,
        checkpoint_in_cpu=True,
        synchronize=False,
        profile=True,
    )
    assert not ac.options(config, layout, 0, "cpu").checkpoint_in_cpu  # DeepSpeed would empty the input itself
    assert not ac.options(
        recompute(), build_layout(naming.gpt_spec_groups(recompute().model), 1), 0, "cpu"
    ).changes_defaults


# --- the planner ---------------------------------------------------------------------------------------------

PLAN = (
    "--model gpt3-1.3b --num-gpus 8 --gpu h100 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
    "--zero-stage 1 --checkpoint-activations --no-sequence-parallel"
).split()


def test_the_planner_counts_partitioned_and_host_checkpoints_and_prints_their_flags(
    capsys: pytest.CaptureFixture,
) -> None:
    from megatron_ds.flags.parser import parse_config
    from megatron_ds.plan.__main__ import main

    def activations(*extra: str) -> tuple[float, str]:
        assert main(["memory", *PLAN, *extra]) == 0
        out = capsys.readouterr().out
        line = next(ln for ln in out.splitlines() if ln.startswith("Configuration analysed"))
        stage = next(ln for ln in out.splitlines() if ln.startswith("Stage "))
        return float(stage.split("activations ")[1].split(" MiB")[0]), line

    whole, line = activations()
    parted, parted_line = activations("--partition-activations")
    host, host_line = activations("--checkpoint-in-cpu")
    assert host < parted < whole, (whole, parted, host)
    assert "recompute full," in line and "recompute full (checkpoints partitioned over t=2)," in parted_line
    assert "recompute full (checkpoints in host memory)," in host_line
    assert main(["pipeline", *PLAN, "--partition-activations", "--write-command"]) == 0
    command = capsys.readouterr().out.split("-- pretrain_gpt.py command --\n", 1)[1].split("\n\n")[0]
    argv = shlex.split(command.split("pretrain_gpt.py", 1)[1].replace("\\\n", " "))
    assert "--deepspeed-activation-checkpointing" in argv and "--partition-activations" in argv
    assert parse_config(argv, world_size=8)[0].training.partition_activations


def test_the_planner_refuses_partitioning_with_its_sequence_parallelism(capsys: pytest.CaptureFixture) -> None:
    from megatron_ds.plan.__main__ import main

    argv = [a for a in PLAN if a != "--no-sequence-parallel"]
    assert main(["memory", *argv, "--partition-activations"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "add --no-sequence-parallel" in err
