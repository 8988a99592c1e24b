"""The learning-rate schedule: Megatron's shapes, one schedule whatever its unit, resume semantics."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_ds.flags.parser import ConfigError, parse_config
from megatron_ds.training.lr_schedule import (
    SAMPLES,
    TOKENS,
    LRSchedule,
    LRScheduleError,
    Schedule,
    build_schedule,
    learning_rate,
)

GBS, SEQ = 8, 32
MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    str(SEQ),
    "--vocab-size",
    "128",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    str(GBS),
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-5",
]


def config(*flags: str):
    return parse_config([*MODEL, *flags], world_size=1)[0]


def lrs(cfg, num_steps: int) -> list[float]:
    """The learning rate before each of `num_steps` optimizer steps, through LRSchedule."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    sched = LRSchedule.from_config(opt, cfg)
    out = []
    for _ in range(num_steps):
        out.append(sched.get_lr()[0])
        sched.step()
    return out


@pytest.mark.parametrize("style", ["linear", "cosine", "constant", "inverse-square-root"])
def test_iterations_samples_and_tokens_give_the_same_schedule(style: str) -> None:
    # 20 iterations of 8 samples of 32 tokens; warm-up 4 iterations, decay over 16.
    by_iters = config(
        "--train-iters", "20", "--lr-warmup-iters", "4", "--lr-decay-iters", "16", "--lr-decay-style", style
    )
    by_samples = config(
        "--train-samples",
        str(20 * GBS),
        "--lr-warmup-samples",
        str(4 * GBS),
        "--lr-decay-samples",
        str(16 * GBS),
        "--lr-decay-style",
        style,
    )
    by_tokens = config(
        "--train-iters",
        "20",
        "--lr-warmup-tokens",
        str(4 * GBS * SEQ),
        "--lr-decay-tokens",
        str(16 * GBS * SEQ),
        "--lr-decay-style",
        style,
    )
    only_tokens = config(
        "--train-tokens",
        str(20 * GBS * SEQ),
        "--lr-warmup-tokens",
        str(4 * GBS * SEQ),
        "--lr-decay-tokens",
        str(16 * GBS * SEQ),
        "--lr-decay-style",
        style,
    )
    reference = lrs(by_iters, 24)
    assert reference[0] == 0.0 and reference[4] == pytest.approx(1e-3)
    for other in (by_samples, by_tokens, only_tokens):
        assert lrs(other, 24) == reference  # bit-identical, not merely close


def test_warmup_fraction_and_default_decay_match_across_units() -> None:
    by_iters = config("--train-iters", "20", "--lr-warmup-fraction", "0.25", "--lr-decay-style", "cosine")
    by_samples = config("--train-samples", str(20 * GBS), "--lr-warmup-fraction", "0.25", "--lr-decay-style", "cosine")
    assert by_iters.optimizer.lr_decay_iters == 20 and by_samples.optimizer.lr_decay_samples == 160
    for cfg in (by_iters, by_samples):
        assert build_schedule(cfg.optimizer, 20, GBS, SEQ).warmup == 40
    assert lrs(by_iters, 22) == lrs(by_samples, 22)
    by_tokens = config("--train-iters", "20", "--lr-decay-tokens", str(20 * GBS * SEQ), "--lr-warmup-fraction", "0.25")
    assert build_schedule(by_tokens.optimizer, 20, GBS, SEQ).warmup == 5 * GBS * SEQ
    assert lrs(by_tokens, 22) == lrs(config("--train-iters", "20", "--lr-warmup-fraction", "0.25"), 22)


def test_a_warmup_fraction_is_not_rounded_to_whole_steps() -> None:
    # Megatron: lr_warmup_steps = lr_warmup_fraction * lr_decay_steps, in samples, a float. Half of a 5-iteration
    # decay is 2.5 iterations (20 samples); it was truncated to 2.
    cfg = config("--train-iters", "6", "--lr-decay-iters", "5", "--lr-warmup-fraction", "0.5", "--min-lr", "0")
    assert build_schedule(cfg.optimizer, 6, GBS, SEQ).warmup == 20.0
    assert lrs(cfg, 6) == pytest.approx([0.0, 4e-4, 8e-4, 8e-4, 4e-4, 0.0])
    assert build_schedule(
        config("--train-iters", "100", "--lr-warmup-fraction", "0.29").optimizer, 100, GBS, SEQ
    ).warmup == (
        0.29 * 100 * GBS  # 231.99999999999997, as Megatron computes it; int() gave 28 iterations
    )


@pytest.mark.parametrize(
    "flags",
    [
        ["--lr-warmup-iters", "10"],
        ["--lr-warmup-iters", "20"],
        ["--lr-decay-iters", "5", "--lr-warmup-iters", "6"],
        ["--lr-warmup-fraction", "1"],
    ],
)
def test_a_warmup_as_long_as_the_decay_is_refused(flags: list[str]) -> None:
    # Megatron's OptimizerParamScheduler asserts lr_warmup_steps < lr_decay_steps; the run only ever warmed up.
    with pytest.raises(ConfigError) as err:
        config("--train-iters", "10", *flags)
    assert f"{flags[-2]} {flags[-1]} warms up over" in str(err.value) and "shorter than the decay" in str(err.value)
    assert config("--train-iters", "10", "--lr-warmup-iters", "9").optimizer.lr_warmup_iters == 9


def test_build_schedule_units() -> None:
    s = build_schedule(config("--train-iters", "20", "--lr-warmup-iters", "2").optimizer, 20, GBS, SEQ)
    assert (s.unit, s.warmup, s.decay) == (SAMPLES, 2 * GBS, 20 * GBS)
    s = build_schedule(config("--train-iters", "20", "--lr-warmup-tokens", "100").optimizer, 20, GBS, SEQ)
    assert (s.unit, s.warmup, s.decay) == (TOKENS, 100, 20 * GBS * SEQ)


def schedule(style: str) -> Schedule:
    return Schedule(max_lr=1.0, min_lr=0.1, decay_style=style, unit=SAMPLES, warmup=10, decay=110)


def test_shapes_at_key_points() -> None:
    for style in ("linear", "cosine", "constant", "inverse-square-root"):
        s = schedule(style)
        assert learning_rate(s, 0) == 0.0 and learning_rate(s, 5) == 0.5 and learning_rate(s, 10) == 1.0
    lin, cos, const, isr = (schedule(x) for x in ("linear", "cosine", "constant", "inverse-square-root"))
    assert learning_rate(lin, 60) == pytest.approx(0.55) and learning_rate(lin, 85) == pytest.approx(0.325)
    assert learning_rate(lin, 110) == pytest.approx(0.1) and learning_rate(lin, 500) == 0.1
    assert learning_rate(cos, 60) == pytest.approx(0.55)
    assert learning_rate(cos, 35) == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi / 4) + 1))
    assert learning_rate(cos, 110) == pytest.approx(0.1) and learning_rate(cos, 111) == 0.1
    assert learning_rate(const, 60) == 1.0 and learning_rate(const, 10_000) == 1.0
    assert learning_rate(isr, 40) == pytest.approx(0.5) and learning_rate(isr, 4000) == 0.1  # floored at min_lr
    # past the decay it is min_lr, as Megatron (it tests the decay's end before the style); it went on as sqrt(W / p)
    assert learning_rate(isr, 110) == pytest.approx(math.sqrt(10 / 110)) and learning_rate(isr, 111) == 0.1


def make(sched: Schedule, **kw) -> LRSchedule:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    return LRSchedule(opt, sched, global_batch_size=1, seq_length=4, **kw)


def test_state_dict_round_trip() -> None:
    a = make(schedule("cosine"))
    for _ in range(37):
        a.step()
    b = make(schedule("cosine"))
    b.load_state_dict(a.state_dict())
    assert b.num_steps == 37 and b.get_lr() == a.get_lr() == [learning_rate(schedule("cosine"), 37)]
    b.step()
    a.step()
    assert b.get_lr() == a.get_lr()


def test_changed_schedule_on_resume_is_an_error_unless_a_flag_says_which_wins() -> None:
    saved = make(schedule("linear"))
    for _ in range(20):
        saved.step()
    state = saved.state_dict()
    flags = Schedule(max_lr=2.0, min_lr=0.1, decay_style="linear", unit=SAMPLES, warmup=10, decay=210)
    with pytest.raises(LRScheduleError) as err:
        make(flags).load_state_dict(state)
    msg = str(err.value)
    assert "lr 1.0 (checkpoint) vs 2.0 (flags)" in msg and "decay 110 samples (checkpoint) vs 210 samples" in msg
    assert "--override-opt_param-scheduler" in msg and "\n" not in msg
    override = make(flags, override=True)
    override.load_state_dict(state)
    assert override.schedule == flags and override.get_lr() == [learning_rate(flags, 20)]
    keep = make(flags, use_checkpoint=True)
    keep.load_state_dict(state)
    assert keep.schedule == schedule("linear") and keep.get_lr() == saved.get_lr()


def test_same_schedule_in_another_unit_is_not_a_difference() -> None:
    saved = make(schedule("linear"))
    in_tokens = Schedule(max_lr=1.0, min_lr=0.1, decay_style="linear", unit=TOKENS, warmup=40, decay=440)
    resumed = make(in_tokens)  # seq_length 4: 10 samples = 40 tokens
    resumed.load_state_dict(saved.state_dict())
    assert resumed.schedule == in_tokens


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--train-iters", "10", "--lr-decay-samples", "40"], "--lr-decay-samples does not go with --train-iters"),
        (["--train-samples", "80", "--lr-warmup-iters", "2"], "--lr-warmup-iters does not go with --train-samples"),
        (
            ["--train-iters", "10", "--lr-warmup-iters", "2", "--lr-warmup-tokens", "64"],
            "--lr-warmup-iters and --lr-warmup-tokens were both given",
        ),
        (
            ["--train-iters", "10", "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"],
            "were both given; keep one",
        ),
        (["--train-iters", "10", "--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction 1.5 must be in [0, 1]"),
    ],
)
def test_schedule_flag_errors(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        config(*flags)
    assert message in str(err.value)


def test_older_scheduler_flag_names_are_aliases() -> None:
    assert config("--train-iters", "10", "--override-lr-scheduler").optimizer.override_opt_param_scheduler
    assert config("--train-iters", "10", "--use-checkpoint-lr-scheduler").optimizer.use_checkpoint_opt_param_scheduler
