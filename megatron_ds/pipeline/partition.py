"""Pure partition algorithms over a list of item weights (no torch, no torch.distributed).

`balanced` reproduces the boundaries DeepSpeed's `partition_balanced` chooses (its linear-partition
dynamic programme minimises max - min part weight, ties resolved towards the later cut), and
`uniform` those of its `partition_uniform`, so `--pp-partition-method` means what it means in
DeepSpeed. Both return `parts`: num_parts + 1 offsets, part i being items [parts[i], parts[i+1]).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np


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
    return list(_balanced(tuple(float(w) for w in weights), num_parts))


@functools.lru_cache(maxsize=64)
def _balanced(weights: tuple[float, ...], num_parts: int) -> tuple[int, ...]:
    # A planner search asks for the same model's split into each pipeline size many times: cached.
    n, m = len(weights), num_parts
    if n <= m:
        return tuple(uniform(n, m))
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best_*[k, j]: (max, min) part weight of the chosen split of the first k items into j parts; cut[i, j]
    # its last cut. Only the states the answer can reach are filled (i items in j parts with n - i items
    # left for m - j parts); states left infinite cost infinity, which never wins, as DeepSpeed's loop over
    # every k. For one i, every j and k at once: elementwise the same float operations as DeepSpeed's
    # loop, and its `>=` keeps the last of equal costs, so the last k reaching the row's minimum.
    best_max = np.full((n + 1, m + 1), np.inf)
    best_min = np.full((n + 1, m + 1), np.inf)
    cut = np.zeros((n + 1, m + 1), dtype=np.int64)
    best_max[0, 0] = 0.0
    prefix_arr = np.array(prefix)
    for i in range(1, n + 1):
        lo_j, hi_j = max(1, i - (n - m)), min(i, m)
        part = prefix_arr[i] - prefix_arr[:i]  # [k]: the last part's weight when it starts at item k
        hi = np.maximum(best_max[:i, lo_j - 1 : hi_j].T, part)  # [j, k]
        lo = np.minimum(best_min[:i, lo_j - 1 : hi_j].T, part)
        at = i - 1 - np.argmin((hi - lo)[:, ::-1], axis=1)
        rows = np.arange(hi_j - lo_j + 1)
        best_max[i, lo_j : hi_j + 1] = hi[rows, at]
        best_min[i, lo_j : hi_j + 1] = lo[rows, at]
        cut[i, lo_j : hi_j + 1] = at
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(int(cut[parts[-1], j]))
    parts.reverse()
    return tuple(parts)


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
