"""Measured matmul rates by shape, for the GPUs a published table covers. Pure: no torch.

`SM90_BF16` is OpenXLA's default matmul performance table for sm_90 (`kDefaultMatmulPTable` in
`xla/service/gpu/model/matmul_interpolator_data.h`, as vendored in tensorflow/tensorflow at commit
372d578bb861; the default of XLA's matmul cost model): bf16 x bf16 -> bf16 FLOP/s of one (m x k) @ (k x n)
product (b = 1) for every m, n, k in 256, 512, ..., 4096, here in TFLOP/s rounded to 0.1. The figures are
timings (each is 2mnk over a measured time: 1024 x 2048 x 2048's 524288000000000 FLOP/s is exactly
16.384 us). Its largest product runs at 783.3 TFLOP/s, above the H100 PCIe's 756 TFLOP/s peak and next to
the MAMF table's 794.5 for the H100 SXM, so it is read as an SXM-class sm_90 part (H100 SXM, H200).

Between the grid's points the rate is interpolated linearly in log2 of each dimension and in the log of
the rate; beyond the grid each dimension is taken at the grid's nearest size: above 4096 a larger product
is assumed no less efficient per FLOP than the largest measured one; under 256 the product is so skinny that
moving its operands bounds it (`Kernels.matmul` takes the longer of this rate and its memory time). Both are
stated assumptions, not measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GRID = (256, 512, 1024, 2048, 4096)
"""Each dimension's measured sizes."""

SM90_BF16_TFLOPS = (  # [m][n][k], k over GRID
    (  # m = 256
        (6.5, 11.5, 19.5, 31.1, 84.3),  # n = 256
        (11.5, 22.0, 39.1, 62.4, 91.7),  # n = 512
        (22.7, 41.8, 72.5, 119.0, 172.3),  # n = 1024
        (41.8, 78.2, 138.1, 215.8, 285.9),  # n = 2048
        (78.0, 138.1, 225.2, 324.6, 412.0),  # n = 4096
    ),
    (  # m = 512
        (11.5, 21.8, 39.3, 60.1, 91.1),  # n = 256
        (21.6, 40.7, 71.2, 114.7, 174.5),  # n = 512
        (43.5, 80.5, 138.7, 216.5, 309.6),  # n = 1024
        (79.3, 143.4, 232.6, 342.4, 430.5),  # n = 2048
        (134.2, 236.3, 373.3, 522.2, 644.1),  # n = 4096
    ),
    (  # m = 1024
        (22.0, 40.9, 68.3, 113.2, 169.7),  # n = 256
        (42.9, 82.2, 141.3, 220.0, 298.9),  # n = 512
        (82.0, 145.6, 236.3, 350.0, 470.1),  # n = 1024
        (139.5, 237.6, 373.3, 524.3, 653.5),  # n = 2048
        (209.7, 338.9, 490.3, 634.2, 738.5),  # n = 4096
    ),
    (  # m = 2048
        (43.6, 77.3, 135.8, 216.1, 307.5),  # n = 256
        (83.9, 142.8, 235.9, 347.7, 451.2),  # n = 512
        (141.6, 238.4, 373.3, 523.3, 653.1),  # n = 1024
        (213.0, 345.5, 493.9, 632.0, 738.0),  # n = 2048
        (299.3, 450.4, 594.2, 715.4, 753.6),  # n = 4096
    ),
    (  # m = 4096
        (82.2, 137.2, 217.2, 304.7, 376.2),  # n = 256
        (142.5, 238.8, 370.8, 521.7, 650.0),  # n = 512
        (216.5, 343.7, 488.1, 632.0, 738.5),  # n = 1024
        (304.0, 447.0, 593.2, 716.1, 758.4),  # n = 2048
        (392.2, 543.1, 677.4, 738.7, 783.3),  # n = 4096
    ),
)


@dataclass(frozen=True)
class MatmulTable:
    """Measured rates of one device's matmuls over `GRID` in each dimension."""

    name: str
    tflops: tuple
    """[m][n][k] TFLOP/s at the grid's sizes."""
    source: str
    _rates: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """Rates already interpolated, by shape: a planner search asks for the same few shapes tens of thousands
    of times."""

    def flops_per_second(self, m: int, n: int, k: int) -> float:
        """FLOP/s of one (m x k) @ (k x n) product (see the module's interpolation and its limits)."""
        if min(m, n, k) <= 0:
            raise ValueError(f"matmul dimensions must be > 0, got {m} x {n} x {k}")
        rate = self._rates.get((m, n, k))
        if rate is None:
            rate = self._rates[(m, n, k)] = self._interpolate(m, n, k)
        return rate

    def _interpolate(self, m: int, n: int, k: int) -> float:
        (im, fm), (jn, fn), (ik, fk) = (_coordinate(d) for d in (m, n, k))
        log_rate = 0.0
        for dm, wm in ((0, 1.0 - fm), (1, fm)):
            for dn, wn in ((0, 1.0 - fn), (1, fn)):
                for dk, wk in ((0, 1.0 - fk), (1, fk)):
                    if wm * wn * wk:
                        log_rate += wm * wn * wk * math.log(self.tflops[im + dm][jn + dn][ik + dk])
        return math.exp(log_rate) * 1e12


def _coordinate(size: int) -> tuple[int, float]:
    """The grid cell a dimension falls in and its fraction of the way across it, in log2 of the size."""
    position = math.log2(min(max(size, GRID[0]), GRID[-1]) / GRID[0])
    cell = min(int(position), len(GRID) - 2)
    return cell, position - cell


SM90_BF16 = MatmulTable(
    "sm_90 bf16",
    SM90_BF16_TFLOPS,
    "OpenXLA's measured sm_90 matmul table (xla/service/gpu/model/matmul_interpolator_data.h)",
)
TABLES = {"sm90-bf16": SM90_BF16}
"""By the name a device row gives (`Device.matmul_table`)."""
