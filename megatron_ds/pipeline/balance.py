"""Minimax stage balance: layers per stage that minimise the largest stage cost, the one solver of
that problem (the `memory` method; the least memory any split needs, in `fastest`'s error and the
planner's fit advice; the split with the smallest slowest stage, `fastest`'s first incumbent).

A stage's memory is not a fixed weight per layer: stage s keeps min(P - s, M) micro-batches of
activations alive under DeepSpeed's 1F1B TrainSchedule, the first stage holds the embedding and
the last the LM head and loss. So the cost of giving k layers to stage s is f_s(k), a different
non-decreasing function per stage. The caller supplies it (`megatron_ds.estimate.run_layout` wraps
`megatron_ds.estimate.memory_model.stage_memory_for`); this module only minimises.

Minimising max_s f_s(k_s) subject to sum k_s = N, k_s >= 1 for middle stages and k_s >= 0 for the
first and last (a dedicated embedding or head stage is a candidate, never forced) is solved
exactly by the greedy allocation of minimax resource allocation: start every stage at its lower
bound and hand out the remaining layers one at a time to the stage whose cost after the increment
is smallest. Because each f_s is non-decreasing, the increments handed out are the N - sum(lower)
smallest of all candidates, so no other split has a smaller maximum. The last stage's cost need
not be monotone (see `balanced_counts`), so its count is enumerated: O(N^2 log P) table look-ups,
O(N P) cost evaluations.
"""

from __future__ import annotations

import heapq
import math

from megatron_ds.pipeline.costs import StageCost, check_shape


def minimax_split(num_layers: int, num_stages: int, cost: StageCost) -> tuple[list[int], float]:
    """`balanced_counts` without a method to name (the shape must be valid), and the largest stage
    cost of the split it returns: the least any split needs when `cost` is non-decreasing in k on
    every stage but the last."""
    table = _CostTable(cost)
    counts = _balanced(num_layers, num_stages, table)
    return counts, max(table(s, k) for s, k in enumerate(counts))


def balanced_counts(num_layers: int, num_stages: int, cost: StageCost, method: str) -> list[int]:
    """Layers per stage minimising max(cost(s, k_s)), exactly; `method` names the
    `--pp-partition-method` in errors.

    `cost(s, k)` must be non-decreasing in k for every stage but the last. The last stage may
    dip (with --checkpoint-num-layers > 1 an added layer can move the head's functions out of a
    recomputed chunk), so its count is enumerated and the others are filled greedily for each.
    Ties: smallest maximum, then the smallest sorted-descending vector of stage costs.
    """
    check_shape(num_layers, num_stages, f"--pp-partition-method {method}")
    return _balanced(num_layers, num_stages, _CostTable(cost))


def _balanced(num_layers: int, num_stages: int, table: _CostTable) -> list[int]:
    if num_stages == 1:
        return [num_layers]
    lower = [0] + [1] * (num_stages - 2)
    best: tuple = ()
    for k_last in range(num_layers - sum(lower) + 1):
        counts = _greedy(num_layers - k_last, lower, table) + [k_last]
        costs = sorted((table(s, k) for s, k in enumerate(counts)), reverse=True)
        if not best or costs < best[0]:
            best = (costs, counts)
    return best[1]


class _CostTable:
    """Memoised cost(s, k)."""

    def __init__(self, cost: StageCost) -> None:
        self._cost, self._seen = cost, {}

    def __call__(self, s: int, k: int) -> float:
        key = (s, k)
        if key not in self._seen:
            self._seen[key] = self._cost(s, k)
        return self._seen[key]


def _greedy(num_layers: int, lower: list[int], cost: _CostTable) -> list[int]:
    """Minimax allocation over stages with non-decreasing costs (ties to the later stage)."""
    counts = list(lower)

    def next_cost(s: int) -> float:  # a count above num_layers is never handed out: not asked for
        return cost(s, counts[s] + 1) if counts[s] < num_layers else math.inf

    heap = [(next_cost(s), -s) for s in range(len(counts))]
    heapq.heapify(heap)
    for _ in range(num_layers - sum(counts)):
        _, neg = heapq.heappop(heap)
        counts[-neg] += 1
        heapq.heappush(heap, (next_cost(-neg), neg))
    return counts
