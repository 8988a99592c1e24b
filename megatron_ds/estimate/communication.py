"""Collective and point-to-point communication in seconds, over the link a group of ranks uses. Pure.

Ranks are placed as Megatron and DeepSpeed place them (and `Layout.format` prints): tensor-parallel
ranks innermost, then data-parallel, then pipeline stages, `gpus_per_node` consecutive ranks per node.
So a tensor-parallel group of t <= gpus_per_node shares a node; a stage's data-parallel group spans the
t x d consecutive ranks of that stage (one node when t x d <= gpus_per_node); consecutive stages sit on
different nodes when a stage fills a node or more.

Times are NCCL's ring formulas in its bus-bandwidth terms (nccl-tests' doc/PERFORMANCE.md): an all-reduce
of S bytes over r ranks moves 2 (r - 1) / r x S through each rank's link, a reduce-scatter or all-gather
(r - 1) / r x S, a send S; at `fraction` of the link's one-way datasheet bandwidth:
  INTRA_FRACTION  NVLink/NVSwitch inside a node: nccl-tests issues #149 and #178 report all-reduce bus
                  bandwidths of about 200-208 GB/s on 8 A100 SXM4 (NVLink 300 GB/s one way): 0.7
  INTER_FRACTION  InfiniBand between nodes: nccl-tests issue #119 reports 85-96 GB/s average-to-peak on
                  4 x HDR per 8 A100s (100 GB/s): 0.9
A group that spans nodes runs at its network link (one adapter per GPU in the reference systems, so the
ring's inter-node hop is each GPU's own adapter). Latency is not modelled (large messages only).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ds.estimate.devices import Device

INTRA_FRACTION = 0.7
INTER_FRACTION = 0.9
GB = 1e9


@dataclass(frozen=True)
class Links:
    """One-way bandwidths per GPU, bytes per second, and the node size."""

    intra_node: float
    """GPU-to-GPU inside a node (NVLink, or the PCIe link when the GPUs have no other)."""
    inter_node: float
    """Per GPU between nodes (its network adapter)."""
    gpus_per_node: int
    intra_fraction: float = INTRA_FRACTION
    inter_fraction: float = INTER_FRACTION
    source: str = ""

    @classmethod
    def for_device(cls, device: Device | None, gpus_per_node: int, network_gbps: float | None = None) -> Links:
        """The device's links (`estimate/devices.py`), the network in Gb/s from `network_gbps` when given, else
        its reference system's; an unknown device or one without figures gets PCIe Gen4 and HDR InfiniBand
        (assumptions, named in `source`)."""
        scale_up = device.scale_up if device else None
        host = device.pcie if device and device.pcie else 64.0
        intra = (scale_up or host) / 2 * GB  # the datasheets print both directions together
        net = network_gbps or (device.network if device else None)
        link = ("NVLink" if device.vendor == "nvidia" else "Infinity Fabric") if scale_up and device else "PCIe"
        source = f"{link} {intra / GB:g} GB/s one way"
        if net is None:
            net, source = 200.0, source + "; network assumed 200 Gb/s per GPU (HDR InfiniBand)"
        else:
            source += f"; network {net:g} Gb/s per GPU"
        return cls(intra, net / 8 * GB, gpus_per_node, source=source)

    def bandwidth(self, within_node: bool) -> float:
        """Achievable one-way bytes per second of a group inside one node, or spanning nodes."""
        if within_node:
            return self.intra_node * self.intra_fraction
        return min(self.inter_node * self.inter_fraction, self.intra_node * self.intra_fraction)

    def all_reduce(self, nbytes: float, ranks: int, within_node: bool) -> float:
        return 0.0 if ranks <= 1 else 2 * (ranks - 1) / ranks * nbytes / self.bandwidth(within_node)

    def reduce_scatter(self, nbytes: float, ranks: int, within_node: bool) -> float:
        """Also an all-gather of the same total size."""
        return 0.0 if ranks <= 1 else (ranks - 1) / ranks * nbytes / self.bandwidth(within_node)

    def send(self, nbytes: float, within_node: bool) -> float:
        return nbytes / self.bandwidth(within_node)


@dataclass(frozen=True)
class Placement:
    """Where a t x p x d configuration's groups sit."""

    tp: int
    pp: int
    dp: int
    gpus_per_node: int

    @property
    def tp_within_node(self) -> bool:
        return self.tp <= self.gpus_per_node

    @property
    def dp_within_node(self) -> bool:
        """A stage's data-parallel group (t x d consecutive ranks, stride t) fits one node."""
        return self.tp * self.dp <= self.gpus_per_node

    @property
    def stages_within_node(self) -> bool:
        """Adjacent stages share a node (a stage holds fewer ranks than a node)."""
        return self.tp * self.dp * self.pp <= self.gpus_per_node

    @property
    def ends_within_node(self) -> bool:
        """The first and last stage (the tied embedding's all-reduce) share a node."""
        return self.stages_within_node
