"""The one GPU table (`estimate/devices.py`): found by planner name and by torch's device names,
each row reachable by its own name, the MFU peaks and the planner's facts as before."""

from __future__ import annotations

import re

import pytest

from megatron_ds.estimate.devices import DEVICES, architecture_of, find_device, find_named, peak_tflops
from megatron_ds.plan.hardware import PlanError, find_gpu


def test_device_peaks() -> None:
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4)
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5
    assert peak_tflops("A100-80GB", "bf16") == 312.0  # the planner's names too
    assert peak_tflops("NVIDIA A10", "bf16") == 125.0 and peak_tflops("NVIDIA A10G", "bf16") is None
    assert peak_tflops("Tesla V100-SXM2-32GB", "fp16") == 125.0
    assert peak_tflops("Tesla V100-SXM2-32GB", "bf16") is None  # no bf16 tensor cores
    assert peak_tflops("NVIDIA L40S", "bf16") == 362.0 and peak_tflops("NVIDIA L4", "bf16") == 121.0
    assert peak_tflops("cpu", "fp32") is None


@pytest.mark.parametrize(
    "device_name,row",
    [
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("NVIDIA H100 NVL", "H100-NVL"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("Tesla V100-SXM2-16GB", "V100-16GB"),
        ("Tesla V100-SXM2-32GB", "V100-32GB"),
        ("Tesla V100-PCIE-16GB", "V100-PCIe"),
        ("Tesla V100S-PCIE-32GB", "V100S"),
        ("Tesla T4", "T4"),
        ("Tesla P100-PCIE-16GB", "P100-16GB"),
        ("NVIDIA GeForce RTX 3090", "RTX-3090"),
        ("NVIDIA RTX A6000", "RTX-A6000"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA A10G", None),
        ("NVIDIA L40", None),
    ],
)
def test_torch_device_names(device_name, row) -> None:
    found = find_device(device_name)
    assert (found.name if found else None) == row


def test_every_row_is_reachable_by_its_own_name() -> None:
    names = [key.lower() for d in DEVICES for key in (d.name, *d.aliases)]
    assert len(names) == len(set(names))
    for d in DEVICES:
        assert find_device(d.name) is d, d.name  # no earlier row's pattern shadows it
        assert find_named(d.name) == (d,) and find_gpu(d.name.lower()) is d
        re.compile(d.pattern)


def test_each_row_states_its_facts() -> None:
    for d in DEVICES:
        assert d.memory_gb is None or d.memory_gb > 0, d.name
        peaks = (d.fp16, d.bf16, d.fp32)
        assert all(p is None or p > 0 for p in peaks), d.name
        assert (d.compute_capability is None) == (d.vendor != "nvidia"), d.name
        if d.compute_capability is not None and d.compute_capability < (8, 0):
            assert d.bf16 is None, d.name  # no bf16 tensor cores before Ampere
        assert architecture_of(d.compute_capability) in (
            "not NVIDIA",
            "Pascal",
            "Volta",
            "Turing",
            "Ampere",
            "Ada Lovelace",
            "Hopper",
        )
    assert architecture_of((7, 5)) == "Turing" and architecture_of((8, 9)) == "Ada Lovelace"


def test_planner_lookup_by_name(capsys) -> None:
    assert find_gpu("h100").name == "H100-80GB"  # the alias: `--gpu H100` is the SXM part
    assert find_gpu("l40").name == "L40S" and find_gpu("A100_80GB").name == "A100-80GB"
    with pytest.raises(PlanError, match="matches A100-40GB, A100-80GB; give the full name"):
        find_gpu("a100")
    from megatron_ds.plan.__main__ import main

    # a row without a memory figure (the V100 PCIe came with 16 or 32 GB): `pipeline` asks for it,
    # `precision` needs only the generation
    assert main(["pipeline", "--model", "1.3b", "--num-gpus", "8", "--gpu", "V100-PCIe"]) == 2
    assert "How much memory has one V100-PCIe? (--gpu-memory-gb" in capsys.readouterr().err
    assert main(["precision", "--gpu", "V100-PCIe"]) == 0
    assert "Recommended: fp16" in capsys.readouterr().out  # Volta: no bf16 tensor cores


def test_bandwidth_columns_for_the_gpus_the_time_model_prices() -> None:
    """The issue's list (A100, H100, H200, V100, L40S, MI300X) has memory and host bandwidth; only parts with
    a GPU-to-GPU link have one; a measured matmul ceiling, where given, is below the peak."""
    for name in ("A100-40GB", "A100-80GB", "H100-80GB", "H200", "V100-32GB", "L40S", "MI300X"):
        d = find_named(name)[0]
        assert d.memory_bandwidth and d.pcie and d.compute_units, name
    assert find_named("L40S")[0].scale_up is None and find_named("H100-80GB")[0].scale_up == 900.0
    assert find_named("A100-80GB")[0].memory_bandwidth == 2039.0 and find_named("H200")[0].memory_bandwidth == 4800.0
    for d in DEVICES:
        if d.matmul_tflops is not None:
            assert 0.4 < d.matmul_tflops / d.bf16 < 1.0, d.name
    assert find_device("AMD Instinct MI300X").name == "MI300X" and architecture_of(None) == "not NVIDIA"
