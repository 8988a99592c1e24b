"""The fastest split that fits: exact against brute force over every split, one-line errors, and fast at scale."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from megatron_ds.config import ModelConfig
from megatron_ds.errors import LayoutError
from megatron_ds.estimate.compute import ComputeInputs, stage_flops_for
from megatron_ds.estimate.step_simulator import simulate, step_estimator
from megatron_ds.pipeline.balance import minimax_split
from megatron_ds.pipeline.costs import StageTime, StepEstimate
from megatron_ds.pipeline.fastest import SearchBudgetError, fastest_counts, fastest_split
from megatron_ds.units import format_bytes


def splits(n: int, p: int):
    """Every legal layers_per_stage: first and last may be 0, middle stages need >= 1 layer."""
    if p == 1:
        yield (n,)
        return
    for first in range(n + 1):
        for last in range(n - first + 1):
            rest, middle = n - first - last, p - 2
            if middle == 0:
                if rest == 0:
                    yield (first, last)
                continue
            if rest < middle:
                continue
            for cuts in itertools.combinations(range(1, rest), middle - 1):
                bounds = (0, *cuts, rest)
                yield (first, *(b - a for a, b in zip(bounds[:-1], bounds[1:])), last)


def brute_force(n, p, stage_time, stage_memory, limit, step_time):
    """(step, peak, counts) of the fastest split that fits, or None; among steps within 1e-9 of the
    fastest, the smallest memories sorted from the largest, then the smallest counts."""
    fits = []
    for counts in splits(n, p):
        mems = [stage_memory(s, k) for s, k in enumerate(counts)]
        if max(mems) > limit:
            continue
        value = step_time([stage_time(s, k) for s, k in enumerate(counts)])
        step = value.time if isinstance(value, StepEstimate) else value
        fits.append((step, tuple(sorted(mems, reverse=True)), list(counts)))
    if not fits:
        return None
    fastest = min(step for step, _, _ in fits)
    step, mems, counts = min((f for f in fits if f[0] <= fastest * (1 + 1e-9)), key=lambda f: (f[1], f[2]))
    return step, mems[0], counts


def random_case(rnd: random.Random, n: int, p: int):
    """Per-stage costs with the ends heavier (embedding, head), noise that can make them non-monotone."""
    base = [rnd.uniform(0.0, 4.0) if s in (0, p - 1) else 0.0 for s in range(p)]
    per_layer = rnd.uniform(0.5, 1.5)
    noise = {(s, k): rnd.uniform(-0.3, 0.3) for s in range(p) for k in range(n + 1)}
    ratio = rnd.uniform(1.5, 3.0)
    opt = rnd.choice([0.0, 0.1])

    def stage_time(s: int, k: int) -> StageTime:
        f = max(0.0, base[s] + per_layer * k + noise[s, k])
        return StageTime(f, ratio * f, opt * k)

    mem_base = [rnd.uniform(0.0, 6.0) for _ in range(p)]

    def stage_memory(s: int, k: int) -> float:
        return mem_base[s] + (p - s) * k + 3 * noise[s, k]

    return stage_time, stage_memory


def objectives(rnd: random.Random, p: int):
    m = rnd.randint(1, 2 * p + 1)
    send, tied = rnd.choice([0.0, 0.2]), rnd.choice([True, False])
    with_certificate = step_estimator(m, send=send, tied=tied)
    return {
        "certificate": with_certificate,
        "bare": lambda ts: with_certificate(ts).time,  # no certificate: the pigeonhole bound
        "bottleneck": lambda ts: max(t.forward + t.backward for t in ts),  # any monotone objective
    }


@pytest.mark.parametrize("seed", range(12))
def test_exact_against_brute_force(seed: int) -> None:
    rnd = random.Random(seed)
    for _ in range(6):
        p = rnd.randint(1, 5)
        n = rnd.randint(max(1, p - 2), 9)
        stage_time, stage_memory = random_case(rnd, n, p)
        mems = sorted(stage_memory(s, k) for s in range(p) for k in range(n + 1))
        for limit in (math.inf, mems[len(mems) // 2], mems[len(mems) // 4]):
            for name, objective in objectives(rnd, p).items():
                expected = brute_force(n, p, stage_time, stage_memory, limit, objective)
                if expected is None:
                    with pytest.raises(LayoutError):
                        fastest_counts(n, p, stage_time, stage_memory, limit, step_time=objective)
                    continue
                got = fastest_split(n, p, stage_time, stage_memory, limit, step_time=objective)
                assert (got.step_time, got.peak_memory, list(got.counts)) == expected, (name, n, p, limit)


def test_slowest_stage_alone_does_not_decide() -> None:
    """Two splits with the same slowest stage: where it sits changes the step (M=2, P=3), and the
    search returns the faster one."""
    m = 2
    slow_first = simulate(m, [10.0, 1.0, 1.0], [20.0, 2.0, 2.0]).step_time
    slow_last = simulate(m, [1.0, 1.0, 10.0], [2.0, 2.0, 20.0]).step_time
    assert slow_first != slow_last

    # Stages 0 and 2 cost the same per layer; 12 layers: the 10-layer stage goes where it is cheapest.
    def stage_time(s: int, k: int) -> StageTime:
        return StageTime(float(k), 2.0 * k)

    counts = fastest_counts(12, 3, stage_time, lambda s, k: 0.0, math.inf, step_time=step_estimator(m))
    best = min((simulate(m, [float(k) for k in c], [2.0 * k for k in c]).step_time, c) for c in splits(12, 3))
    assert tuple(counts) == best[1]
    assert simulate(m, [float(k) for k in counts], [2.0 * k for k in counts]).step_time == best[0]


def test_nothing_fits_names_the_smallest_memory_in_one_line() -> None:
    rnd = random.Random(5)
    n, p = 7, 4
    stage_time, noisy = random_case(rnd, n, p)

    def stage_memory(s: int, k: int) -> float:
        # the memory model's shape: non-decreasing in k on every stage but the last, which may dip
        return noisy(s, k) if s == p - 1 else max(noisy(s, j) for j in range(k + 1))

    peak = min(max(stage_memory(s, k) for s, k in enumerate(c)) for c in splits(n, p))
    counts, smallest = minimax_split(n, p, stage_memory)
    assert smallest == peak and max(stage_memory(s, k) for s, k in enumerate(counts)) == peak
    scale = 2**30  # the memory model's bytes
    with pytest.raises(LayoutError) as err:
        fastest_counts(
            n,
            p,
            stage_time,
            lambda s, k: scale * stage_memory(s, k),
            scale * peak * 0.99,
            step_time=step_estimator(2),
        )
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("--pp-partition-method fastest: no split of --num-layers 7 over")
    assert f"needs {format_bytes(scale * peak)} on its largest stage" in message
    # at exactly that limit a split fits
    fastest_counts(n, p, stage_time, lambda s, k: scale * stage_memory(s, k), scale * peak, step_time=step_estimator(2))


@pytest.mark.parametrize(
    ("n", "p", "fix"),
    [(3, 0, "must be >= 1"), (0, 2, "--num-layers must be >= 1"), (2, 5, "at most 4 stages")],
)
def test_impossible_shapes(n: int, p: int, fix: str) -> None:
    with pytest.raises(LayoutError, match=fix):
        fastest_counts(n, p, lambda s, k: StageTime(1.0, 1.0), lambda s, k: 0.0, math.inf, step_time=step_estimator(1))


def test_a_certificate_longer_than_the_step_is_caught() -> None:
    def lying(times):
        return StepEstimate(1.0, tuple((1.0, 1.0, 0.0) for _ in times), 5.0)

    with pytest.raises(AssertionError, match="certificate longer"):
        fastest_counts(4, 2, lambda s, k: StageTime(1.0, 1.0), lambda s, k: 0.0, math.inf, step_time=lying)


@pytest.mark.parametrize(("n", "p", "m"), [(48, 5, 4), (64, 6, 16), (96, 8, 32)])
def test_realistic_sizes_need_few_simulations(n: int, p: int, m: int) -> None:
    """The issue's model and deeper ones: the certificates keep the search to a few dozen simulations
    (brute force: 212k splits for 48 layers on 5 stages)."""
    inputs = ComputeInputs(ModelConfig(n, 384, 8, 1536, 128, 128, 32000), 1)

    def stage_time(s: int, k: int) -> StageTime:
        st = stage_flops_for(inputs, s, p, k)
        return StageTime(st.forward / 1e9, st.backward_total / 1e9)

    split = fastest_split(n, p, stage_time, lambda s, k: 0.0, math.inf, step_time=step_estimator(m))
    assert split.evaluations < 100
    # no split one layer away is faster (a cheap necessary condition of optimality)
    for i, j in itertools.permutations(range(p), 2):
        moved = list(split.counts)
        moved[i], moved[j] = moved[i] - 1, moved[j] + 1
        if moved[i] >= (0 if i in (0, p - 1) else 1):
            times = [stage_time(s, k) for s, k in enumerate(moved)]
            assert step_estimator(m)(times).time >= split.step_time


def test_a_visit_budget_stops_the_search_with_one_line_and_a_larger_one_changes_nothing() -> None:
    """`max_visits` (the planner's limit on its refinement): past it a SearchBudgetError (a LayoutError) in one
    line naming the method and the limit; a budget the search stays within returns the unlimited answer."""
    rnd = random.Random(3)
    stage_time, stage_memory = random_case(rnd, 9, 5)
    objective = objectives(rnd, 5)["bare"]  # no certificate: the pigeonhole bound expands more nodes
    full = fastest_split(9, 5, stage_time, stage_memory, math.inf, step_time=objective)
    with pytest.raises(SearchBudgetError, match=r"^--pp-partition-method fastest: .* stopped after 1 nodes") as err:
        fastest_split(9, 5, stage_time, stage_memory, math.inf, step_time=objective, max_visits=1)
    assert isinstance(err.value, LayoutError) and "\n" not in str(err.value)
    roomy = fastest_split(9, 5, stage_time, stage_memory, math.inf, step_time=objective, max_visits=10**6)
    assert (roomy.counts, roomy.step_time) == (full.counts, full.step_time)
