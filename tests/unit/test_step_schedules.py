"""What changes step by step: the legacy curriculum against DeepSpeed's own CurriculumScheduler, the
batch ramp-up against megatron-core's calculator, Megatron-LM's step schedule against a fixture its
own code made (tests/unit/fixtures/README.md), the training length they give, the learning-rate and
weight-decay schedules they drive, and their one-line errors."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from megatron_ds.config.schedules import CurriculumConfig, rampup_batch_size
from megatron_ds.errors import ConfigError
from megatron_ds.flags.lengths import steps_to_reach
from megatron_ds.flags.parser import parse_config
from megatron_ds.training.lr_schedule import LRSchedule, learning_rate, weight_decay
from megatron_ds.training.optimizer import DECOUPLED_GROUP, param_groups
from megatron_ds.training.step_plan import StepPlan

FIXTURES = Path(__file__).parent / "fixtures"
SEQ = 64
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", "128", "--lr", "1e-3"]


def parse(*argv: str, seq: int = SEQ, world_size: int = 1):
    return parse_config([*BASE, "--seq-length", str(seq), *argv], world_size=world_size)[0]


def curriculum(kind: str, min_d: int, max_d: int, **schedule: object) -> dict:
    return {
        "enabled": True,
        "curriculum_type": "seqlen",
        "min_difficulty": min_d,
        "max_difficulty": max_d,
        "schedule_type": kind,
        "schedule_config": schedule,
    }


CURRICULA = {
    "linear": curriculum("fixed_linear", 8, 64, total_curriculum_step=50, difficulty_step=8),
    "linear, max not a multiple": curriculum("fixed_linear", 5, 30, total_curriculum_step=20, difficulty_step=8),
    "root 2": curriculum("fixed_root", 16, 64, total_curriculum_step=100, difficulty_step=8, root_degree=2),
    "root 3, min below the step": curriculum(
        "fixed_root", 10, 60, total_curriculum_step=40, difficulty_step=16, root_degree=3
    ),
    "discrete": curriculum("fixed_discrete", 8, 32, difficulty=[8, 16, 32], max_step=[10, 20]),
    "discrete, max then lower": curriculum("fixed_discrete", 8, 32, difficulty=[8, 32, 16], max_step=[5, 10]),
    "discrete, never max": curriculum("fixed_discrete", 8, 32, difficulty=[8, 16], max_step=[5]),
}


@pytest.mark.parametrize("name", CURRICULA)
def test_curriculum_lengths_are_deepspeeds(name: str) -> None:
    from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

    section = CURRICULA[name]
    ours, theirs = CurriculumConfig.from_json(section, "ds.json"), CurriculumScheduler(section)
    # Megatron-DeepSpeed asks update_difficulty(iteration + 1) before every step, from step 1.
    lengths = [theirs.update_difficulty(step) for step in range(1, 301)]
    assert [ours.seq_length(step) for step in range(1, 301)] == lengths
    assert len(set(lengths)) > 1
    settle = ours.settle_step()
    assert len({ours.seq_length(s) for s in range(settle, settle + 300)}) == 1


def test_curriculum_off_and_errors() -> None:
    assert CurriculumConfig.from_json(None, "f") is None
    assert CurriculumConfig.from_json({**CURRICULA["linear"], "enabled": False}, "f") is None
    bad = {
        "has no 'max_difficulty'": {k: v for k, v in CURRICULA["linear"].items() if k != "max_difficulty"},
        "schedule_type 'custom' is not supported": {**CURRICULA["linear"], "schedule_type": "custom"},
        "only 'seqlen'": {**CURRICULA["linear"], "curriculum_type": "vocabularyrarity"},
        "has no 'total_curriculum_step'": curriculum("fixed_linear", 8, 64, difficulty_step=8),
        "min_difficulty '8' is not an integer": {**CURRICULA["linear"], "min_difficulty": "8"},
        "schedule_config.difficulty [8, '16'] is not a list of integers": curriculum(
            "fixed_discrete", 8, 16, difficulty=[8, "16"], max_step=[3]
        ),
        "not a key of the legacy curriculum": {**CURRICULA["linear"], "data_cluster_path": "x"},
        "one more entry than 'max_step'": curriculum("fixed_discrete", 8, 32, difficulty=[8, 16], max_step=[5, 9]),
        "must satisfy 1 <= min <= max": curriculum("fixed_linear", 64, 8, total_curriculum_step=5, difficulty_step=8),
        "root_degree 0 must be > 0": curriculum(
            "fixed_root", 8, 64, total_curriculum_step=5, difficulty_step=8, root_degree=0
        ),
    }
    for message, section in bad.items():
        with pytest.raises(ConfigError) as err:
            CurriculumConfig.from_json(section, "--deepspeed_config ds.json")
        assert message in str(err.value) and str(err.value).startswith("--deepspeed_config ds.json ")
        assert "\n" not in str(err.value)


def test_curriculum_comes_from_the_json_and_must_fit_the_sequence(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"curriculum_learning": CURRICULA["linear"], "steps_per_print": 10}))
    config = parse("--train-iters", "10", "--deepspeed_config", str(path))
    assert config.training.curriculum == CurriculumConfig.from_json(CURRICULA["linear"], "x")
    with pytest.raises(ConfigError, match="sequences of 64 tokens, beyond --seq-length 32"):
        parse("--train-iters", "10", "--deepspeed_config", str(path), seq=32)
    from megatron_ds.training import deepspeed_config

    ds = deepspeed_config.build(config)
    assert "curriculum_learning" not in ds and ds["steps_per_print"] == 10  # the loop runs it, not DeepSpeed
    with pytest.raises(deepspeed_config.DeepSpeedConfigError, match="config.training.curriculum does not hold"):
        deepspeed_config.build(config.replace(training__curriculum=None))


@pytest.mark.parametrize("rampup", [(4, 2, 20), (16, 16, 300), (8, 8, 1), (3, 5, 17)])
def test_rampup_is_megatrons_calculator(rampup: tuple[int, int, int]) -> None:
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    gbs = rampup[0] + 4 * rampup[1]
    theirs = RampupBatchsizeNumMicroBatchesCalculator(gbs, 1, 1, False, 1, *rampup)
    for consumed in range(0, rampup[2] + 40):
        theirs.update(consumed, consistency_check=False)
        assert rampup_batch_size(rampup, gbs, consumed) == theirs.get_current_global_batch_size(), consumed


@pytest.mark.parametrize("case", json.loads((FIXTURES / "step_batch_size_schedule.json").read_text()))
def test_step_schedule_is_megatron_lms(case: dict) -> None:
    sizes = {b for _, b in case["samples_schedule"]}
    dp = math.gcd(*sizes)
    argv = ["--step-batch-size-schedule", case["schedule"], "--micro-batch-size", "1"]
    for samples, iters in case["train_iters_for_samples"].items():
        t = parse(*argv, "--train-samples", samples, seq=case["seq_length"], world_size=dp).training
        assert t.step_batch_size_schedule == tuple(map(tuple, case["samples_schedule"]))
        assert t.global_batch_size == case["samples_schedule"][-1][1]
        assert t.train_iters == iters, samples
    for consumed, size in case["batch_size_at"].items():
        assert t.batch_size_at(int(consumed)) == size


def test_batch_schedule_errors() -> None:
    for argv, message in (
        (["--rampup-batch-size", "8", "4", "100", "--global-batch-size", "8"], "must be below --global-batch-size 8"),
        (["--rampup-batch-size", "2", "4", "100", "--global-batch-size", "8"], "not a multiple of the increment 4"),
        (
            ["--rampup-batch-size", "2", "0", "100", "--global-batch-size", "8"],
            "start, increment and samples must be > 0",
        ),
        (["--rampup-batch-size", "2", "2"], "expected 3 arguments"),
        (["--rampup-batch-size", "3", "1", "9", "--global-batch-size", "8", "--micro-batch-size", "2"], "size of 3"),
        (["--step-batch-size-schedule", "0:4 16"], "expected THRESHOLD:BATCH_SIZE"),
        (["--step-batch-size-schedule", "0:4 1x:8"], "'1x' is not a number"),
        (["--step-batch-size-schedule", "64:4 128:8"], "the first threshold must be 0"),
        (["--step-batch-size-schedule", "0:4 10:8 20:16"], "strictly increasing"),  # 10 and 20 tokens: sample 0
        (["--step-batch-size-schedule", "0:4 128:8", "--global-batch-size", "4"], "--global-batch-size is 4"),
        (["--step-batch-size-schedule", "0:4", "--rampup-batch-size", "2", "2", "9"], "were both given"),
    ):
        with pytest.raises(ConfigError) as err:
            parse(*argv, "--train-iters", "10")
        assert message in str(err.value) and "\n" not in str(err.value), (argv, str(err.value))


def brute_force(training, seq: int, samples: int | None, tokens: int | None) -> int:
    step = consumed = used = 0
    while not ((samples is not None and consumed >= samples) or (tokens is not None and used >= tokens)):
        batch = training.batch_size_at(consumed)
        consumed, used, step = consumed + batch, used + batch * training.seq_length_at(step + 1, seq), step + 1
    return step


def megatron_deepspeed_iters(training, ramp_samples: int, train_samples: int) -> int:
    """Megatron-DeepSpeed's `update_train_iters` (megatron/training.py at 4efb479) with a batch ramp-up."""
    iterations = consumed_samples = 0
    while consumed_samples <= ramp_samples:
        consumed_samples += training.batch_size_at(consumed_samples)
        iterations += 1
    return iterations + (train_samples - consumed_samples) // training.global_batch_size


@pytest.mark.parametrize("train_samples", [40, 100, 160, 161, 1000])
def test_train_samples_with_a_rampup_run_megatron_deepspeeds_iterations_and_read_exactly_them(
    train_samples: int,
) -> None:
    # The dataset was asked for iterations x the final batch (224 for 160 samples), so every sample differed;
    # tools/show_samples.py counted without the ramp-up and so showed yet other samples.
    from megatron_ds.data.demo_corpus import _load_tool
    from megatron_ds.data.splits import requested_samples

    tool = _load_tool("show_samples")
    argv = ["--rampup-batch-size", "2", "2", "40", "--global-batch-size", "8", "--train-samples", str(train_samples)]
    t = parse(*argv).training
    assert t.train_iters == megatron_deepspeed_iters(t, 40, train_samples)
    assert requested_samples(t)[0] == train_samples
    shown = tool.training_config(tool.parse_args([*BASE, "--seq-length", str(SEQ), *argv, "--mock-data"]))
    assert (shown.train_iters, requested_samples(shown)) == (t.train_iters, requested_samples(t))


def test_train_samples_not_a_multiple_of_the_batch_run_whole_batches() -> None:
    from megatron_ds.data.splits import requested_samples

    t = parse("--global-batch-size", "8", "--train-samples", "161").training
    assert (t.train_iters, requested_samples(t)[0]) == (20, 161)  # Megatron: 161 // 8, and all 161 asked for
    with pytest.raises(ConfigError, match=r"--train-samples 5 is less than one global batch of 8 samples"):
        parse("--global-batch-size", "8", "--train-samples", "5")


def test_a_rampup_with_train_iters_says_the_decay_outlasts_training(capsys: pytest.CaptureFixture) -> None:
    # Megatron-DeepSpeed refuses the pair (Megatron-LM runs it): 6 ramp-up steps consume 12 samples of a 48-sample decay
    parse("--rampup-batch-size", "2", "2", "40", "--global-batch-size", "8", "--train-iters", "6")
    out = capsys.readouterr().out
    assert (
        "NOTICE: --rampup-batch-size with --train-iters 6: the ramp-up's smaller batches make them consume 12 " in out
    )
    assert "the learning-rate decay spans 48" in out
    parse(
        "--rampup-batch-size", "2", "2", "40", "--global-batch-size", "8", "--train-iters", "6", "--lr-decay-iters", "1"
    )
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("curriculum_name", [None, "linear", "discrete, never max"])
def test_training_length_counts_each_steps_samples_and_tokens(tmp_path: Path, curriculum_name: str | None) -> None:
    argv = ["--rampup-batch-size", "2", "2", "30", "--global-batch-size", "8"]
    if curriculum_name:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps({"curriculum_learning": CURRICULA[curriculum_name]}))
        argv += ["--deepspeed_config", str(path)]
    t = parse(*argv, "--train-iters", "10").training
    for samples, tokens in ((1, None), (31, None), (500, None), (None, 1), (None, 3000), (200, 9000)):
        assert steps_to_reach(t, SEQ, samples, tokens) == brute_force(t, SEQ, samples, tokens)
    assert parse(*argv, "--train-samples", "100").training.train_iters == megatron_deepspeed_iters(t, 30, 100)
    assert parse(*argv, "--train-tokens", "3000").training.train_iters == brute_force(t, SEQ, None, 3000)
    capped = parse(*argv, "--train-iters", "10", "--train-tokens", "3000").training
    assert capped.train_iters == min(10, brute_force(t, SEQ, None, 3000)) and capped.train_tokens == 3000


def test_lr_and_weight_decay_follow_the_consumed_samples_and_tokens() -> None:
    config = parse(
        "--rampup-batch-size", "2", "2", "10", "--global-batch-size", "8", "--train-iters", "12",
        "--lr-warmup-tokens", str(4 * SEQ), "--lr-decay-tokens", str(60 * SEQ), "--lr-decay-style", "cosine",
        "--weight-decay-incr-style", "cosine", "--start-weight-decay", "0.01", "--end-weight-decay", "0.1",
    )  # fmt: skip
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(param_groups(model, config.optimizer.weight_decay), lr=0.0)
    sched = LRSchedule.from_config(opt, config)
    assert config.optimizer.weight_decay_incr_samples == 12 * 8  # Megatron: train_iters x global batch
    samples = tokens = 0
    for step in range(1, 13):
        batch, length = config.training.batch_size_at(samples), 16 + step  # any lengths: tokens are told
        sched.set_next_step(batch, batch * length)
        sched.step()
        samples, tokens = samples + batch, tokens + batch * length
        assert sched.get_lr() == [learning_rate(sched.schedule, tokens)] * 2
        # Megatron's get_wd over the samples, cosine from start to end; the no-decay group keeps 0
        ratio = samples / (12 * 8)
        wd = 0.01 + 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0) * (0.1 - 0.01)
        assert [g["weight_decay"] for g in opt.param_groups] == [pytest.approx(wd, abs=1e-15), 0.0]
        assert weight_decay(sched.schedule, samples) == pytest.approx(wd, abs=1e-15)
    restored = LRSchedule.from_config(torch.optim.AdamW(param_groups(model, 0.1), lr=0.0), config)
    restored.load_state_dict(sched.state_dict())
    assert (restored.samples, restored.tokens, restored.get_lr()) == (samples, tokens, sched.get_lr())
    old = {k: v for k, v in sched.state_dict().items() if k not in ("samples", "tokens")}
    restored.load_state_dict(old)  # written before the counters: fixed-size steps of --global-batch-size
    assert (restored.samples, restored.tokens) == (12 * 8, 12 * 8 * SEQ)


def test_weight_decay_schedule_errors() -> None:
    for argv, message in (
        (["--start-weight-decay", "0.1"], "need --weight-decay-incr-style linear or cosine"),
        (["--weight-decay-incr-style", "linear", "--start-weight-decay", "0.1"], "needs --start-weight-decay and"),
        (
            ["--weight-decay-incr-style", "linear", "--start-weight-decay", "0.1", "--end-weight-decay", "0.01"],
            "--end-weight-decay 0.01 is below --start-weight-decay 0.1",
        ),
        (["--decoupled-min-lr", "0.1"], "--decoupled-min-lr needs --decoupled-lr"),
        (["--decoupled-lr", "1e-4", "--decoupled-min-lr", "1e-3"], "is above --decoupled-lr"),
    ):
        with pytest.raises(ConfigError) as err:
            parse(*argv, "--train-iters", "10")
        assert message in str(err.value) and "\n" not in str(err.value)


def test_decoupled_lr_gives_the_embedding_and_head_their_own_group() -> None:
    from megatron_ds.model.gpt_pipe import mark_embedding_and_output
    from megatron_ds.model.layers import LMHead, WordEmbedding

    config = parse("--train-iters", "10", "--decoupled-lr", "5e-3", "--lr-warmup-iters", "2", "--min-lr", "1e-5")
    m = config.model
    model = torch.nn.ModuleDict(
        {"emb": WordEmbedding(m, config.regularization, 1), "head": LMHead(m, config.regularization, 2)}
    )
    model["norm"] = torch.nn.LayerNorm(m.hidden_size)
    model["proj"] = torch.nn.Linear(m.hidden_size, m.hidden_size)
    mark_embedding_and_output(model)
    groups = param_groups(model, 0.1, decoupled=True)
    by_name = {g["name"]: g for g in groups}
    assert [p.shape for p in by_name[DECOUPLED_GROUP]["params"]] == [(128, 32), (128, 32)]
    assert by_name[DECOUPLED_GROUP]["weight_decay"] == 0.1 and by_name["decay"]["params"][0].shape == (32, 32)
    opt = torch.optim.AdamW(groups, lr=0.0)
    sched = LRSchedule.from_config(opt, config)
    differ = 0
    for _ in range(10):
        sched.step()
        s = sched.schedule
        lr = learning_rate(s, sched.samples)
        own = learning_rate(dataclasses.replace(s, max_lr=5e-3, min_lr=1e-5), sched.samples)
        assert [g["lr"] for g in opt.param_groups] == [lr, lr, own]  # decay, no_decay, decoupled
        differ += own != lr
    assert differ == 9  # the tenth step ends the decay: both groups reach the floor --min-lr


def test_step_plan_cuts_micro_batches_and_resets_shapes_on_change(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"curriculum_learning": CURRICULA["discrete"]}))
    ramp = ["--rampup-batch-size", "2", "2", "8", "--global-batch-size", "8"]
    config = parse("--train-iters", "30", "--deepspeed_config", str(path), *ramp)

    class Engine:
        resets, batch = 0, 8
        lr_scheduler = None

        def train_batch_size(self) -> int:
            return self.batch

        def set_train_batch_size(self, b: int) -> None:
            self.batch = b

        def reset_activation_shape(self) -> None:
            self.resets += 1

    engine, state = Engine(), type("S", (), {"iteration": 0, "consumed_train_samples": 0})()
    plan = StepPlan(config, engine)
    tokens = torch.arange(2 * SEQ).view(2, SEQ)
    batches = plan.cut(iter([(tokens, (tokens + 1, torch.ones(2, SEQ)))] * 40))
    seen = []
    for step in range(1, 26):
        size = plan.before_step(state)
        cut, (labels, mask) = next(batches)
        assert cut.shape == labels.shape == mask.shape == (2, size.seq_length) and torch.equal(labels, cut + 1)
        assert engine.batch == size.samples == config.training.batch_size_at(state.consumed_train_samples)
        seen.append(size.seq_length)
        state.iteration, state.consumed_train_samples = step, state.consumed_train_samples + size.samples
        if step == 12:
            plan.before_eval()  # whole samples: the shape is reset, and again at the next step
    assert seen == [8] * 10 + [16] * 10 + [32] * 5
    assert engine.resets == 5  # 64 -> 8, 8 -> 16, eval 16 -> 64, 64 -> 16, 16 -> 32


def test_per_token_loss_warns_once_when_a_micro_batch_masks_tokens(capsys: pytest.CaptureFixture) -> None:
    plan = StepPlan(parse("--train-iters", "4", "--calculate-per-token-loss"), engine=None)
    full, padded = torch.ones(2, SEQ), torch.ones(2, SEQ)
    padded[1, -3:] = 0  # megatron-core's padding of a sample it cannot fill
    tokens = torch.zeros(2, SEQ, dtype=torch.long)
    batches = [(tokens, (tokens, full)), (tokens, (tokens, padded)), (tokens, (tokens, padded))]
    assert len(list(plan.cut(iter(batches)))) == 3
    out = capsys.readouterr().out
    assert out.count("WARNING: --calculate-per-token-loss: a micro-batch of 128 tokens masks 3") == 1
    assert (
        list(StepPlan(parse("--train-iters", "4"), engine=None).cut(iter(batches[1:]))) and not capsys.readouterr().out
    )
