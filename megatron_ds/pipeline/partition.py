"""Pure partition algorithms over a list of item weights (no torch, no torch.distributed).

`balanced` reproduces the boundaries DeepSpeed's `partition_balanced` chooses (its linear-partition
dynamic programme minimises max - min part weight, ties resolved towards the later cut), and
`uniform` those of its `partition_uniform`, so `--pp-partition-method` means what it means in
DeepSpeed. Both return `parts`: num_parts + 1 offsets, part i being items [parts[i], parts[i+1]).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def uniform(num_items: int, num_parts: int) -> list[int]:
    """Equal counts; the first `num_items % num_parts` parts take one more item."""
    assert num_parts >= 1 and num_items >= 0
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    base, extra = divmod(num_items, num_parts)
    parts = [0]
    for p in range(num_parts):
        parts.append(parts[-1] + base + (1 if p < extra else 0))
    return parts


def balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Contiguous parts minimising (heaviest part - lightest part), as DeepSpeed chooses them."""
    n, m = len(weights), num_parts
    if n <= m:
        return uniform(n, m)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = math.inf
    # best[i][j]: (cost, max, min) of splitting the first i items into j parts.
    best_max = [[inf] * (m + 1) for _ in range(n + 1)]
    best_min = [[inf] * (m + 1) for _ in range(n + 1)]
    best_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    cut = [[0] * (m + 1) for _ in range(n + 1)]
    best_max[0][0] = 0.0
    best_cost[0][0] = 0.0
    # Only the states the answer can reach are filled (i items in j parts with n - i items left for m - j
    # parts), and only cuts k after j - 1 items (fewer cannot make j - 1 non-empty parts: infinite cost,
    # which never wins the comparison); DeepSpeed's loop computes the same values for those states.
    for i in range(1, n + 1):
        pi = prefix[i]
        for j in range(max(1, i - (n - m)), min(i, m) + 1):
            row_max, row_min = best_max, best_min
            cost, hi_best, lo_best, at = best_cost[i][j], best_max[i][j], best_min[i][j], cut[i][j]
            for k in range(j - 1, i) if j > 1 else (0,):
                part = pi - prefix[k]
                hk, lk = row_max[k][j - 1], row_min[k][j - 1]
                hi = hk if hk > part else part
                lo = lk if lk < part else part
                if cost >= hi - lo:
                    cost, hi_best, lo_best, at = hi - lo, hi, lo, k
            best_cost[i][j], best_max[i][j], best_min[i][j], cut[i][j] = cost, hi_best, lo_best, at
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(cut[parts[-1]][j])
    parts.reverse()
    return parts


def min_max(weights: Sequence[float], num_parts: int) -> list[int]:
    """Contiguous non-empty parts minimising the heaviest part (ties: the lexicographically
    smallest list of part sizes from the back, so earlier parts take the remainder)."""
    n, m = len(weights), num_parts
    if not 1 <= m <= n:
        raise ValueError(f"cannot split {n} items into {m} non-empty parts")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = math.inf
    # best[j][i]: smallest achievable max part weight splitting the first i items into j parts.
    best = [[inf] * (n + 1) for _ in range(m + 1)]
    cut = [[0] * (n + 1) for _ in range(m + 1)]
    best[0][0] = 0.0
    for j in range(1, m + 1):
        for i in range(j, n - (m - j) + 1):
            for k in range(j - 1, i):
                cost = max(best[j - 1][k], prefix[i] - prefix[k])
                if cost < best[j][i] - 1e-12 * max(1.0, abs(cost)):
                    best[j][i], cut[j][i] = cost, k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(cut[j][parts[-1]])
    parts.reverse()
    return parts
