"""The simulated step time of DeepSpeed's TrainSchedule: the 1F1B formula on equal stages, a slow stage's
dominance, and agreement with a second, independently written event-by-event replay."""

from __future__ import annotations

import random

import pytest
from deepspeed.runtime.pipe import schedule as ds

from megatron_ds.estimate.step_simulator import BACKWARD, FORWARD, balanced_step_time, program, simulate

SIZES = [(p, m) for p in (1, 2, 3, 4, 5, 8) for m in (1, 2, 3, 4, 5, 8, 13)]


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_equal_stages_take_m_plus_p_minus_1_slots(p: int, m: int) -> None:
    """Equal stages: step = (M + P - 1)(f + b); every stage idles (P - 1)(f + b), a bubble of
    (P - 1) / M of the compute, for DeepSpeed's schedule exactly as for textbook 1F1B."""
    for f, b in ((1.0, 2.0), (1.0, 1.0), (3.0, 0.5)):
        result = simulate(m, [f] * p, [b] * p)
        assert result.step_time == pytest.approx((m + p - 1) * (f + b), rel=1e-12)
        for idle, busy in zip(result.idle, result.busy):
            assert idle == pytest.approx((p - 1) * (f + b), rel=1e-9, abs=1e-9)
            assert idle / busy == pytest.approx((p - 1) / m, rel=1e-9)
        assert balanced_step_time(m, [f] * p, [b] * p) == result.step_time


@pytest.mark.parametrize("m", [1, 4, 7])
def test_one_stage_runs_its_micro_batches_back_to_back(m: int) -> None:
    result = simulate(m, [1.5], [2.5], optimizer=0.75, send=10.0, tied_reduce=10.0)
    assert result.step_time == m * (1.5 + 2.5) + 0.75
    assert result.comm == (0.0,) and result.idle == (0.0,)


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in SIZES if p > 1])
def test_a_slow_stage_dominates(p: int, m: int) -> None:
    """One stage 10x slower: it runs its M micro-batches back to back; upstream stages' fill and
    drain add to that, downstream stages' are hidden behind its queued backwards once M >= P."""
    for slow in range(p):
        f, b = [1.0] * p, [2.0] * p
        f[slow], b[slow] = 10.0, 20.0
        step = simulate(m, f, b).step_time
        upstream, others = 3.0 * slow, 3.0 * (p - 1)
        assert m * 30.0 + upstream <= step <= m * 30.0 + others
        if m >= p:
            assert step == m * 30.0 + upstream


def test_optimizer_waits_for_the_global_norm() -> None:
    """With gradient clipping the step's norm joins every stage: the step is the latest backward
    end plus the slowest optimizer; without it each stage steps when its own backward ends."""
    f, b, opt = [1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [5.0, 0.0, 0.0]
    synced = simulate(4, f, b, optimizer=opt).step_time
    assert synced == (4 + 2) * 3.0 + 5.0
    unsynced = simulate(4, f, b, optimizer=opt, grad_norm_sync=False)
    # stage 0's backward finishes last (the drain ends there), so its own step still ends the batch
    assert unsynced.step_time == synced
    late_last = [0.0, 0.0, 5.0]
    # the tied embedding's all-reduce holds the last stage until stage 0's backward is done ...
    assert simulate(4, f, b, optimizer=late_last, grad_norm_sync=False).step_time == synced
    # ... without a tied head its step overlaps the drain of the stages before it
    assert simulate(4, f, b, optimizer=late_last, grad_norm_sync=False, tied=False).step_time < synced


def test_sends_cost_time_on_both_ends() -> None:
    m, p, c = 4, 3, 0.5
    result = simulate(m, [1.0] * p, [2.0] * p, send=c)
    # every micro-batch crosses each link twice (activation forward, gradient back)
    assert [n for n, _ in program(m, p).comm_counts] == [2 * m, 4 * m, 2 * m]
    assert result.comm == (2 * m * c, 4 * m * c, 2 * m * c)
    assert result.step_time > (m + p - 1) * 3.0
    for idle in result.idle:
        assert idle >= -1e-12


def test_every_stage_runs_m_forwards_and_m_backwards_in_1f1b_order() -> None:
    for p, m in SIZES:
        for s, order in enumerate(program(m, p).order):
            assert order.count(FORWARD) == m and order.count(BACKWARD) == m
            warmup = min(p - s, m)  # forwards before the first backward
            assert order[:warmup] == (FORWARD,) * warmup and (warmup == m or order[warmup] == BACKWARD)


def replay(m: int, fwd: list[float], bwd: list[float], opt: list[float], send: float, tied: float) -> float:
    """A second simulator: step the ranks' DeepSpeed instruction lists with clocks, matching each send
    with the peer's receive as the engine's blocking p2p does."""
    p = len(fwd)
    streams = [[c for step in ds.TrainSchedule(m, p, s).steps() for c in step] for s in range(p)]
    clock, pos = [0.0] * p, [0] * p
    peer_of = {ds.SendActivation: 1, ds.RecvActivation: -1, ds.SendGrad: -1, ds.RecvGrad: 1}
    partner = {ds.SendActivation: ds.RecvActivation, ds.SendGrad: ds.RecvGrad}
    partner.update({v: k for k, v in partner.items()})
    while any(pos[s] < len(streams[s]) for s in range(p)):
        moved = False
        for s in range(p):
            if pos[s] >= len(streams[s]):
                continue
            cmd = streams[s][pos[s]]
            kind = type(cmd)
            if kind in peer_of:
                t = s + peer_of[kind]
                if pos[t] < len(streams[t]) and type(streams[t][pos[t]]) is partner[kind]:
                    clock[s] = clock[t] = max(clock[s], clock[t]) + send
                    pos[t] += 1
                else:
                    continue
            elif kind is ds.ReduceTiedGrads and p > 1 and s in (0, p - 1):
                t = p - 1 - s
                if pos[t] < len(streams[t]) and type(streams[t][pos[t]]) is ds.ReduceTiedGrads:
                    clock[s] = clock[t] = max(clock[s], clock[t]) + tied
                    pos[t] += 1
                else:
                    continue
            elif kind is ds.OptimizerStep:
                if not all(pos[t] < len(streams[t]) and type(streams[t][pos[t]]) is ds.OptimizerStep for t in range(p)):
                    continue
                norm = max(clock)
                for t in range(p):
                    clock[t] = norm + opt[t]
                    pos[t] += 1
                moved = True
                continue
            elif kind is ds.ForwardPass:
                clock[s] += fwd[s]
            elif kind is ds.BackwardPass:
                clock[s] += bwd[s]
            pos[s] += 1
            moved = True
        assert moved, "deadlock"
    return max(clock)


def test_agrees_with_an_independent_replay_on_random_stages() -> None:
    rnd = random.Random(7)
    for _ in range(300):
        p, m = rnd.randint(1, 7), rnd.randint(1, 12)
        fwd = [rnd.uniform(0.1, 3.0) for _ in range(p)]
        bwd = [f * rnd.uniform(1.5, 3.0) for f in fwd]
        opt = [rnd.uniform(0.0, 1.0) for _ in range(p)]
        send, tied = rnd.choice([0.0, 0.05, 0.4]), rnd.choice([0.0, 0.3])
        got = simulate(m, fwd, bwd, optimizer=opt, send=send, tied_reduce=tied).step_time
        assert got == pytest.approx(replay(m, fwd, bwd, opt, send, tied), rel=1e-12)


def test_never_beats_the_dataflow_bound_and_is_monotone() -> None:
    """Stage s cannot start before micro-batch 0 passed stages < s, runs 2M passes, and its last
    gradient must pass back through stages < s; and slowing any stage never speeds the step."""
    rnd = random.Random(3)
    for _ in range(300):
        p, m = rnd.randint(1, 6), rnd.randint(1, 10)
        fwd = [rnd.uniform(0.1, 3.0) for _ in range(p)]
        bwd = [f * 2 for f in fwd]
        step = simulate(m, fwd, bwd).step_time
        bound = max(sum(fwd[:s]) + sum(bwd[:s]) + m * (fwd[s] + bwd[s]) for s in range(p))
        assert step >= bound * (1 - 1e-12)
        s = rnd.randrange(p)
        slower = list(bwd)
        slower[s] += rnd.uniform(0.0, 1.0)
        assert simulate(m, fwd, slower).step_time >= step


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        simulate(2, [1.0, -1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="need 2"):
        simulate(2, [1.0, 1.0], [1.0])
    with pytest.raises(ValueError, match=">= 1 micro-batch"):
        simulate(0, [1.0], [1.0])


def random_times(rnd: random.Random, p: int) -> tuple[list[float], list[float], list[float]]:
    fwd = [rnd.uniform(0.1, 3.0) for _ in range(p)]
    return fwd, [f * rnd.uniform(1.0, 3.0) for f in fwd], [rnd.uniform(0.0, 1.0) for _ in range(p)]


def length(path, constant: float, fwd: list[float], bwd: list[float], opt: list[float], wgt=None) -> float:
    wgt = wgt or [0.0] * len(fwd)
    return constant + sum(
        nf * f + nb * b + no * o + nw * w for (nf, nb, no, nw), f, b, o, w in zip(path, fwd, bwd, opt, wgt)
    )


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1", "interleaved"])
def test_critical_path_is_a_certificate(schedule: str) -> None:
    """The reported path's length is the step for its own times and a lower bound for any others
    (for ZB-H1 with weight passes of their own, for interleaving over v x P flat stages)."""
    rnd = random.Random(11)
    for _ in range(200):
        p, m = rnd.randint(1, 6), rnd.randint(1, 9)
        v = 1
        if schedule == "interleaved":
            p, v, m = max(p, 2), rnd.choice([2, 3]), p * rnd.randint(1, 3)
        send, tied = rnd.choice([0.0, 0.3]), rnd.choice([0.0, 0.2])
        kwargs = {"send": send, "tied_reduce": tied, "schedule": schedule, "virtual_stages": v}

        fwd, bwd, opt = random_times(rnd, p * v)
        wgt = [b * rnd.uniform(0.0, 0.6) for b in bwd] if schedule == "zbh1" else None
        result = simulate(m, fwd, bwd, opt, weight=wgt or 0.0, **kwargs)
        got = length(result.path, result.path_constant, fwd, bwd, opt, wgt)
        assert got == pytest.approx(result.step_time, rel=1e-12)
        assert all(nf <= m and nb <= m and no <= 1 for nf, nb, no, _ in result.path)
        other = random_times(rnd, p * v)
        other_w = [b * rnd.uniform(0.0, 0.6) for b in other[1]] if schedule == "zbh1" else None
        step = simulate(m, *other, weight=other_w or 0.0, **kwargs).step_time
        assert length(result.path, result.path_constant, *other, other_w) <= step * (1 + 1e-12)


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in SIZES if m >= p])
def test_each_schedules_bubble_matches_its_formula_on_equal_stages(p: int, m: int) -> None:
    """1F1B: (P - 1) / M; ZB-H1: (P - 1)(F + B - W) of time, B the input-gradient pass (M >= P);
    interleaved: (P - 1) / (v M) when P divides M (torch's rounds); and a stage idles the rest."""
    from megatron_ds.estimate.step_simulator import bubble_ratio, idle_fraction

    assert bubble_ratio("1f1b", m, p) == pytest.approx((p - 1) / m, abs=1e-12)
    assert idle_fraction("1f1b", m, p) == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    for f, b, w in ((1.0, 2.0, 1.0), (1.0, 2.0, 0.5), (2.0, 3.0, 1.0), (1.0, 3.0, 1.0)):  # W <= F, as the paper assumes
        zb = simulate(m, [f] * p, [b] * p, weight=w, schedule="zbh1", tied=False, grad_norm_sync=False)
        assert zb.step_time == pytest.approx(m * (f + b) + (p - 1) * (f + (b - w) - w), rel=1e-12)
    assert bubble_ratio("zbh1", m, p) == pytest.approx((p - 1) / (3 * m), abs=1e-12)
    if p > 1 and m % p == 0:
        for v in (2, 3, 4):
            assert bubble_ratio("interleaved", m, p, v) == pytest.approx((p - 1) / (v * m), abs=1e-12)


def test_interleaving_wraps_from_the_last_rank_to_the_first() -> None:
    """Chunk c of rank P - 1 feeds chunk c + 1 of rank 0: a slow flat stage anywhere delays the
    step, and the ranks' busy time is the sum of their chunks'."""
    m, v = 4, 2  # P = 2: four flat stages
    base = simulate(m, [1.0] * 4, [2.0] * 4, schedule="interleaved", virtual_stages=v)
    assert base.busy == (2 * m * 3.0, 2 * m * 3.0)
    for slow in range(4):
        f = [1.0] * 4
        f[slow] = 3.0
        assert simulate(m, f, [2.0] * 4, schedule="interleaved", virtual_stages=v).step_time > base.step_time
