"""What a ZeRO stage and offload add to a training step, in seconds: traffic over the network, over PCIe to
the host and to NVMe, and the optimizer step on the CPU. Pure arithmetic over stated assumptions (`Links`).

Per step and data-parallel rank, for a model of Psi parameters per tensor rank in w-byte weights over DP
ranks (Rajbhandari et al. 2020, Sec. 7; Ren et al. 2021, ZeRO-Offload; Rajbhandari et al. 2021,
ZeRO-Infinity):

  data parallel     ZeRO 0-2: 2 Psi w (a reduce-scatter and an all-gather, or an all-reduce); ZeRO-3:
                    3 Psi w (parameters gathered in forward and again in backward); each rank moves
                    (DP - 1) / DP of it over its link
  optimizer offload the 16-bit gradient partition to the host and the updated 16-bit partition back:
                    2 w Psi / DP over PCIe; DeepSpeed's CPU Adam over Psi / DP parameters
  NVMe optimizer    its fp32 master, gradient and Adam states (16 bytes) read and written: 32 Psi / DP
  parameter offload the 16-bit partition to the GPU for forward and for backward: 2 w Psi / DP over PCIe
                    (from NVMe too with NVMe parameter offload)

The numbers are estimates for comparing options, not predictions of a real step: the compute they
overlap with, PCIe contention between a node's GPUs and the host's cores are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Links:
    """Bandwidths and rates the estimate assumes (bytes or parameters per second, per GPU)."""

    network: float = 25 * GB
    """Data-parallel link per GPU: InfiniBand HDR (200 Gb/s); NVLink inside one node is faster."""
    pcie: float = 12 * GB
    """Host <-> GPU, effective: PCIe 3.0 x16's 16 GB/s less protocol overhead (PCIe 4.0 about doubles it)."""
    nvme: float = 3 * GB
    """One NVMe drive's sequential read or write (PCIe 3.0 x4 class)."""
    cpu_adam: float = 1e9
    """Parameters per second DeepSpeed's CPU Adam updates for one GPU's partition (its AVX kernel on a
    server's cores; ZeRO-Offload reports roughly this order, Ren et al. 2021, Sec. 5)."""


LINKS = Links()
INTERCONNECT = {"nvlink": 150 * GB, "infiniband": 25 * GB, "ethernet": 10 * GB}
"""Per-GPU data-parallel bandwidth by the planner's `--interconnect` (NVLink 3 one-way; HDR InfiniBand;
100 Gb/s Ethernet at 80% efficiency)."""


def step_overheads(
    params: float,
    data_parallel: int,
    weight_bytes: int,
    zero_stage: int,
    offload_optimizer: str = "none",
    offload_param: str = "none",
    links: Links = LINKS,
) -> dict[str, float]:
    """Seconds one step spends on each term above (only the terms that apply)."""
    terms: dict[str, float] = {}
    dp = data_parallel
    if dp > 1:
        volume = (3 if zero_stage == 3 else 2) * params * weight_bytes
        terms["data-parallel communication"] = volume * (dp - 1) / dp / links.network
    partition = params / dp
    if offload_optimizer != "none":
        terms["gradients to the host and parameters back (PCIe)"] = 2 * weight_bytes * partition / links.pcie
        terms["CPU Adam step"] = partition / links.cpu_adam
    if offload_optimizer == "nvme":
        terms["optimizer states through NVMe"] = 32 * partition / links.nvme
    if offload_param != "none":
        terms["parameters to the GPU for forward and backward (PCIe)"] = 2 * weight_bytes * partition / links.pcie
    if offload_param == "nvme":
        terms["parameters from NVMe"] = 2 * weight_bytes * partition / links.nvme
    return terms
