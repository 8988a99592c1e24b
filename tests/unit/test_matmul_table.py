"""The measured matmul table (`estimate/matmul_table.py`): its grid points as published, the interpolation
between them, the stated behaviour beyond the grid, and which devices and precisions it prices."""

from __future__ import annotations

import dataclasses
import math

import pytest

from megatron_ds.estimate.devices import find_named
from megatron_ds.estimate.efficiency import Kernels
from megatron_ds.estimate.matmul_table import GRID, SM90_BF16, SM90_BF16_TFLOPS

H100 = find_named("H100-80GB")[0]


@pytest.mark.parametrize(
    "shape,published",
    [  # OpenXLA's FLOP/s for these (m, n, k), b = 1, bf16, rounded to 0.1 TFLOP/s
        ((4096, 4096, 4096), 783328793548203),
        ((2048, 2048, 2048), 631984593290170),
        ((256, 256, 256), 6452775384615),
        ((512, 4096, 4096), 644116271145770),
        ((4096, 256, 4096), 376223484232655),
        ((1024, 2048, 2048), 524288000000000),
    ],
)
def test_grid_points_are_the_published_figures(shape: tuple[int, int, int], published: int) -> None:
    assert SM90_BF16.flops_per_second(*shape) == pytest.approx(published, abs=0.05e12)


def test_between_points_the_log_rate_is_linear_in_log2_of_each_size() -> None:
    t = SM90_BF16_TFLOPS
    f = math.log2(3072 / 2048)  # m between 2048 and 4096
    expected = math.exp((1 - f) * math.log(t[3][4][4]) + f * math.log(t[4][4][4])) * 1e12
    assert SM90_BF16.flops_per_second(3072, 4096, 4096) == pytest.approx(expected)
    a, b = SM90_BF16.flops_per_second(2048, 4096, 4096), SM90_BF16.flops_per_second(4096, 4096, 4096)
    assert a < SM90_BF16.flops_per_second(3072, 4096, 4096) < b
    assert len(t) == len(GRID) and all(len(row) == len(GRID) and all(len(c) == len(GRID) for c in row) for row in t)


def test_beyond_the_grid_each_size_is_taken_at_the_nearest_measured_one() -> None:
    corner = SM90_BF16.flops_per_second(4096, 4096, 4096)
    assert SM90_BF16.flops_per_second(8192, 16384, 65536) == pytest.approx(corner)
    assert SM90_BF16.flops_per_second(16, 4096, 4096) == pytest.approx(SM90_BF16.flops_per_second(256, 4096, 4096))
    with pytest.raises(ValueError, match="> 0"):
        SM90_BF16.flops_per_second(0, 4096, 4096)


def test_the_table_prices_16_bit_matmuls_on_sxm_hopper_only() -> None:
    k = Kernels.for_device(H100, "bf16")
    assert k.shape_rates is SM90_BF16 and "OpenXLA" in k.source
    assert k.matmul(2048, 2048, 2048) == pytest.approx(2 * 2048**3 / SM90_BF16.flops_per_second(2048, 2048, 2048))
    assert k.matmul(4096, 4096, 4096, batch=3) == pytest.approx(3 * k.matmul(4096, 4096, 4096))
    assert k.matmul(8192, 8192, 1) == pytest.approx(k.memory(2 * (8192 + 8192 + 8192 * 8192)))  # memory-bound
    assert k.matmul(16, 8192, 8192) == pytest.approx(k.memory(2 * (16 * 8192 + 8192 * 8192 + 16 * 8192)))
    assert Kernels.for_device(find_named("H200")[0], "fp16").shape_rates is SM90_BF16
    assert Kernels.for_device(H100, "fp32").shape_rates is None  # the table is 16-bit
    for other in ("A100-80GB", "H100-PCIe"):  # no table: the ceiling and wave quantization
        assert Kernels.for_device(find_named(other)[0], "bf16").shape_rates is None
    profiled = k.measured({"matmul_tflops": 500.0})  # a measured rate replaces the table
    assert profiled.shape_rates is None and profiled.matmul(4096, 4096, 4096) == pytest.approx(
        2 * 4096**3 / (500e12 * profiled.wave_efficiency(4096, 4096, 4096))
    )
    plain = dataclasses.replace(k, shape_rates=None)
    assert k.matmul(2048, 2048, 2048) > plain.matmul(2048, 2048, 2048)  # 632 measured vs 794.5 x 97% modelled
