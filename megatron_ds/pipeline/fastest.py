"""The fastest pipeline split that fits: transformer layers per stage that minimise the predicted step
time subject to every stage's predicted memory <= a limit. Pure: the costs come in as functions.

    stage_time(s, k)    -> StageTime: one micro-batch's forward and backward (recomputation included)
                           and the optimizer step on stage s holding k transformer layers (plus the
                           pre group on stage 0, the post group and loss on the last stage)
    stage_memory(s, k)  -> the stage's predicted peak memory (bytes)
    step_time(times)    -> the step of a split from its stages' times: a number, or a StepEstimate
                           with a certificate (`megatron_ds.estimate.step_simulator.step_estimator`
                           simulates the run's pipeline schedule and returns its critical path)

Splits are those of `megatron_ds.pipeline.balance`: the pre group on stage 0, the post group on the
last, >= 1 layer on every middle stage, >= 0 on the first and last (a dedicated embedding or head
stage is a candidate, never forced).

Why not minimise the slowest stage: a pipeline step is not a function of the largest stage time
(`tests/unit/test_fastest.py` has two splits with the same slowest stage and different steps). The
search is an exact branch and bound over `step_time` itself; exactness needs only that `step_time`
is non-decreasing in every stage's times, as any replay of a fixed instruction order is. The bounds
(certificates: critical paths of evaluated splits and their averages; without them a pigeonhole
bound), the pruning tolerance (a relative `TOLERANCE`) and the tie rule (among steps within it, the
split whose stage memories sorted from the largest are smallest, then the smaller counts) are
explained in docs/compute.md section 3. Counts whose memory exceeds the limit are never considered;
when no split fits, `NoFitError` names the least memory any split needs on its largest stage
(`balance.minimax_split`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_ds.errors import LayoutError
from megatron_ds.pipeline.balance import minimax_split
from megatron_ds.pipeline.costs import StageMemoryFn, StageTime, StageTimeFn, StepEstimate, StepTimeFn, check_shape
from megatron_ds.units import format_bytes

METHOD = "fastest"
FLAG = f"--pp-partition-method {METHOD}"
TOLERANCE = 1e-9
"""Relative: a subtree is cut only when its bound exceeds the best step by more than this."""
TIME_FIELDS = ("forward", "backward", "optimizer", "weight")
"""The `StageTime` fields, in the order of a certificate's coefficients."""
MAX_PATHS = 64
"""Certificates kept for bounding (each adds one (P, N) table)."""


@dataclass(frozen=True)
class FastestSplit:
    counts: tuple[int, ...]
    """Transformer layers per stage."""
    step_time: float
    peak_memory: float
    """The largest stage's `stage_memory`."""
    evaluations: int
    """Calls of `step_time` the search made."""


class NoFitError(LayoutError):
    """No split fits the memory limit; `counts` is the split needing least memory, `least` its largest stage.
    A caller that knows the memory model adds what would fit (`estimate.fit_advice`)."""

    def __init__(self, message: str, counts: list[int], least: float, limit: float) -> None:
        super().__init__(message)
        self.counts, self.least, self.limit = counts, least, limit


class SearchBudgetError(LayoutError):
    """The search expanded `max_visits` nodes without finishing (a caller's limit on its work)."""


def fastest_counts(
    num_layers: int,
    num_stages: int,
    stage_time: StageTimeFn,
    stage_memory: StageMemoryFn,
    memory_limit: float,
    *,
    step_time: StepTimeFn,
    method: str = METHOD,
    max_visits: int | None = None,
) -> list[int]:
    """Layers per stage of the fastest split whose every stage fits `memory_limit` (module docstring)."""
    split = fastest_split(
        num_layers,
        num_stages,
        stage_time,
        stage_memory,
        memory_limit,
        step_time=step_time,
        method=method,
        max_visits=max_visits,
    )
    return list(split.counts)


def fastest_split(
    num_layers: int,
    num_stages: int,
    stage_time: StageTimeFn,
    stage_memory: StageMemoryFn,
    memory_limit: float,
    *,
    step_time: StepTimeFn,
    method: str = METHOD,
    max_visits: int | None = None,
) -> FastestSplit:
    """`fastest_counts` with the predicted step time, peak memory and search effort; `method` names
    the `--pp-partition-method` in errors; `max_visits`: SearchBudgetError once the search has expanded
    that many nodes, leaves included (None: no limit)."""
    flag = f"--pp-partition-method {method}"
    check_shape(num_layers, num_stages, flag)
    search = _Search(num_layers, num_stages, stage_time, stage_memory, memory_limit, step_time, max_visits, flag)
    if not search.reachable[0][num_layers]:
        counts, peak = minimax_split(num_layers, num_stages, stage_memory)
        raise NoFitError(
            f"{flag}: no split of --num-layers {num_layers} over --pipeline-model-parallel-size {num_stages} "
            f"fits {format_bytes(memory_limit)} per device; the split needing least memory "
            f"({' '.join(map(str, counts))} layers per stage) needs {format_bytes(peak)} on its largest stage",
            counts,
            peak,
            memory_limit,
        )
    search.run()
    step, memories, counts = search.result()
    return FastestSplit(tuple(counts), step, memories[0], search.evaluations)


class _Certificates:
    """Certificate paths as arrays: cost[i, s, k] = path i's length on stage s holding k layers
    (inf where k is not feasible), rest[i, j, r] = the least stages j.. add to it taking r layers."""

    def __init__(self, times: np.ndarray) -> None:
        self.times = times  # (P, N + 1, 4): forward, backward, optimizer, weight; inf where infeasible
        p, n1, _ = times.shape
        self.keys: set = set()
        self.cost = np.empty((0, p, n1))
        self.rest = np.empty((0, p + 1, n1))
        self.constant = np.empty(0)

    def add(self, estimate: StepEstimate) -> None:
        key = (estimate.path, estimate.path_constant)
        if key in self.keys or len(self.keys) >= MAX_PATHS:
            return
        self.keys.add(key)
        p, n1, _ = self.times.shape
        with np.errstate(invalid="ignore"):  # 0 x inf: a count that never occurs on the path
            cost = np.nan_to_num(np.einsum("skc,sc->sk", self.times, np.asarray(estimate.path, float)), nan=0.0)
        cost[~np.isfinite(self.times[:, :, 0])] = np.inf  # infeasible counts stay impossible
        rest = np.full((p + 1, n1), np.inf)
        rest[p, 0] = 0.0
        for j in range(p - 1, -1, -1):  # rest[j, r] = min_k cost[j, k] + rest[j + 1, r - k]
            for r in range(n1):
                rest[j, r] = np.min(cost[j, : r + 1] + rest[j + 1, r::-1])
        self.cost = np.concatenate([self.cost, cost[None]])
        self.rest = np.concatenate([self.rest, rest[None]])
        self.constant = np.append(self.constant, estimate.path_constant)

    def bounds(self, counts: Sequence[int], left: int, ks: np.ndarray) -> np.ndarray:
        """For each count k in `ks` of stage len(counts): the bound of the node that adds it."""
        j = len(counts)
        fixed = self.constant + self.cost[:, np.arange(j), np.asarray(counts, dtype=int)].sum(axis=1)
        return (fixed[:, None] + self.cost[:, j, ks] + self.rest[:, j + 1, left - ks]).max(axis=0)


class _Search:
    """Branch and bound over splits (the state of one `fastest_split` call)."""

    def __init__(
        self,
        n: int,
        p: int,
        stage_time: StageTimeFn,
        stage_memory: StageMemoryFn,
        limit: float,
        step_time: StepTimeFn,
        max_visits: int | None = None,
        flag: str = f"--pp-partition-method {METHOD}",
    ) -> None:
        self.n, self.p, self.step_time, self.evaluations = n, p, step_time, 0
        self.visits, self.max_visits, self.flag = 0, max_visits, flag
        self.best = math.inf  # the smallest step evaluated
        self.ties: list[tuple[float, tuple[float, ...], list[int]]] = []  # (step, memories sorted down, counts)
        # Feasible counts per stage with their times and memory (each cost function called once per count).
        self.feasible: list[dict[int, tuple[StageTime, float]]] = []
        for s in range(p):
            options = {}
            for k in _count_range(s, p, n):
                mem = stage_memory(s, k)
                if mem <= limit:
                    options[k] = (stage_time(s, k), mem)
            self.feasible.append(options)
        # reachable[j][r]: stages j.. can take exactly r layers within the limit.
        self.reachable = [[False] * (n + 1) for _ in range(p + 1)]
        self.reachable[p][0] = True
        for j in range(p - 1, -1, -1):
            for r in range(n + 1):
                self.reachable[j][r] = any(self.reachable[j + 1][r - k] for k in self.feasible[j] if k <= r)
        times = np.full((p, n + 1, len(TIME_FIELDS)), np.inf)
        for s, options in enumerate(self.feasible):
            for k, (t, _) in options.items():
                times[s, k] = [getattr(t, a) for a in TIME_FIELDS]
        self.certificates = _Certificates(times)
        # floor_from[s, q]: componentwise minimum of stage s's times over feasible counts >= q.
        self.floor_from = np.minimum.accumulate(times[:, ::-1], axis=1)[:, ::-1]

    def run(self) -> None:
        # Seed: the split with the smallest slowest stage, a good first incumbent and certificate.
        def stage_cost(s: int, k: int) -> float:
            option = self.feasible[s].get(k)
            return math.inf if option is None else option[0].forward + option[0].backward + option[0].optimizer

        seed, slowest = minimax_split(self.n, self.p, stage_cost)
        if math.isinf(slowest):
            # The solver is exact for costs non-decreasing in k (every stage but the last); memory
            # that is not can leave the seed infeasible: then the search starts without one.
            self.visit([], self.n)
            return
        self._leaf(seed)
        if self.p == 1:  # the seed is the only split
            return
        if self.certificates.keys:
            self._collect_certificates(seed)
        self.visit([], self.n)

    def _collect_certificates(self, seed: list[int]) -> None:
        """Certificates that make the bounds tight (speed only: every certificate is valid).

        One path per stage that runs through that stage's passes (from the seed with one more layer
        there), then, for each j, the average of those of stages j..: a convex combination of path
        lengths is still <= the step, and minimised over a node's completions it bounds the work the
        open stages must share, which no single path does.
        """
        for s in range(self.p):
            donors = [t for t in range(self.p) if t != s and seed[t] - 1 in self.feasible[t]]
            if seed[s] + 1 in self.feasible[s] and donors:
                d = max(donors, key=lambda t: seed[t])
                self._leaf([k + (t == s) - (t == d) for t, k in enumerate(seed)])
        paths = list(self.certificates.keys)
        through = [max(paths, key=lambda key: sum(key[0][s])) for s in range(self.p)]  # noqa: B023
        for j in range(self.p - 1):
            chosen = through[j:]
            mix = tuple(
                tuple(sum(key[0][s][c] for key in chosen) / len(chosen) for c in range(len(TIME_FIELDS)))
                for s in range(self.p)
            )
            self.certificates.add(StepEstimate(0.0, mix, sum(key[1] for key in chosen) / len(chosen)))

    def visit(self, counts: list[int], left: int) -> None:
        """Expand the node with stages < len(counts) <= P - 2 fixed and `left` layers to place."""
        self._count_visit()
        j = len(counts)
        ks = np.array([k for k in self.feasible[j] if k <= left and self.reachable[j + 1][left - k]], dtype=int)
        lower = self._bounds(counts, left, ks)
        for i in np.argsort(lower, kind="stable"):
            if lower[i] > self._cutoff():
                break  # sorted: every later child's bound is larger still
            k = int(ks[i])
            if j == self.p - 2:
                self._leaf([*counts, k, left - k])
            else:
                self.visit([*counts, k], left - k)

    def _bounds(self, counts: list[int], left: int, ks: np.ndarray) -> np.ndarray:
        if len(self.certificates.keys):
            return self.certificates.bounds(counts, left, ks)
        return np.array([self._pigeonhole_bound([*counts, int(k)], left - int(k)) for k in ks])

    def _pigeonhole_bound(self, counts: list[int], left: int) -> float:
        # Without certificates: one open stage takes >= ceil(left / open) layers (module docstring).
        fixed = [self.feasible[s][k][0] for s, k in enumerate(counts)]
        open_stages = range(len(counts), self.p)
        q = math.ceil(left / len(open_stages))
        lows = [StageTime(*self.floor_from[t, 0]) for t in open_stages]
        best = math.inf
        for i, t in enumerate(open_stages):
            if np.isfinite(self.floor_from[t, q, 0]):
                big = StageTime(*self.floor_from[t, q])
                best = min(best, self._evaluate([*fixed, *lows[:i], big, *lows[i + 1 :]]).time)
        return best

    def _cutoff(self) -> float:
        return self.best + TOLERANCE * abs(self.best)

    def result(self) -> tuple[float, tuple[float, ...], list[int]]:
        cutoff = self._cutoff()
        return min((t for t in self.ties if t[0] <= cutoff), key=lambda t: (t[1], t[2]))

    def _evaluate(self, times: Sequence[StageTime]) -> StepEstimate:
        self.evaluations += 1
        value = self.step_time(times)
        estimate = value if isinstance(value, StepEstimate) else StepEstimate(float(value))
        if estimate.path:  # a certificate longer than the step would make the bounds unsafe
            length = estimate.path_constant + sum(
                sum(k * getattr(t, a) for k, a in zip(c, TIME_FIELDS)) for c, t in zip(estimate.path, times)
            )
            assert length <= estimate.time * (1 + TOLERANCE) + 1e-12, ("certificate longer than the step", estimate)
        return estimate

    def _count_visit(self) -> None:
        """One more node expanded or leaf evaluated; SearchBudgetError past `max_visits`."""
        self.visits += 1
        if self.max_visits is not None and self.visits > self.max_visits:
            raise SearchBudgetError(
                f"{self.flag}: the exact search over --num-layers {self.n} and {self.p} stages stopped after "
                f"{self.max_visits:,} nodes (the caller's limit)"
            )

    def _leaf(self, counts: list[int]) -> None:
        self._count_visit()
        estimate = self._evaluate([self.feasible[s][k][0] for s, k in enumerate(counts)])
        if estimate.path:
            self.certificates.add(estimate)
        self.best = min(self.best, estimate.time)
        if estimate.time <= self._cutoff():
            memories = tuple(sorted((self.feasible[s][k][1] for s, k in enumerate(counts)), reverse=True))
            self.ties = [t for t in self.ties if t[0] <= self._cutoff()] + [(estimate.time, memories, counts)]


def _count_range(stage: int, num_stages: int, num_layers: int) -> range:
    if num_stages == 1:
        return range(num_layers, num_layers + 1)
    return range(0 if stage in (0, num_stages - 1) else 1, num_layers + 1)
