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
A group that spans nodes runs at the network adapters of its ranks in one node (one adapter per GPU in the
reference systems): NCCL splits a collective over channels, each a ring that enters and leaves every node
once, so a group with g ranks per node drives g adapters at once. NVIDIA/nccl issue #569 (NCCL_ALGO=Ring,
DGX-2 nodes, 8 GPUs: 1, 2 and 4 GPUs per node take 363, 173 and 132 ms) and #1168 (4 nodes: about 45 GB/s
bus bandwidth with 4 GPUs per node, 90 GB/s with 8) show the bus bandwidth growing with the adapters used;
the NVLink ring inside the node caps it. Megatron's data-parallel group of a stage has gpus_per_node / t
ranks per node (tensor ranks innermost), so at t = 8 one adapter, at t = 1 eight. Latency is not modelled
(large messages only).
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

    def bandwidth(self, within_node: bool, ranks_per_node: int = 1) -> float:
        """Achievable one-way bytes per second (bus bandwidth) of a group inside one node, or spanning nodes with
        `ranks_per_node` of its ranks (and their adapters) in each."""
        if within_node:
            return self.intra_node * self.intra_fraction
        network = self.inter_node * self.inter_fraction * max(1, ranks_per_node)
        return min(network, self.intra_node * self.intra_fraction)

    def all_reduce(self, nbytes: float, ranks: int, within_node: bool, ranks_per_node: int = 1) -> float:
        if ranks <= 1:
            return 0.0
        return 2 * (ranks - 1) / ranks * nbytes / self.bandwidth(within_node, ranks_per_node)

    def reduce_scatter(self, nbytes: float, ranks: int, within_node: bool, ranks_per_node: int = 1) -> float:
        """Also an all-gather of the same total size."""
        return 0.0 if ranks <= 1 else (ranks - 1) / ranks * nbytes / self.bandwidth(within_node, ranks_per_node)

    def all_to_all(self, nbytes: float, ranks: int, within_node: bool) -> float:
        """Each of `ranks` ranks hands the others (r - 1) / r of its `nbytes` (nccl-tests' PERFORMANCE.md: an
        all-to-all's bus bandwidth is its algorithm bandwidth x (n - 1) / n); across nodes each rank's share leaves
        through its own adapter."""
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

    expert_parallel: int = 1
    """E (`--moe-expert-parallel-size`): DeepSpeed's expert-parallel groups are E consecutive data-parallel ranks
    (`groups._create_expert_and_data_parallel`), its expert-data-parallel groups the d / E ranks E apart."""

    @property
    def ep_within_node(self) -> bool:
        """An expert-parallel group (E consecutive data-parallel ranks, stride t) fits one node."""
        return self.tp * self.expert_parallel <= self.gpus_per_node

    @property
    def experts_data_parallel(self) -> Placement:
        """Where an expert-data-parallel group sits: a data-parallel group of d / E ranks, E x t apart."""
        return Placement(self.tp * self.expert_parallel, self.pp, self.dp // self.expert_parallel, self.gpus_per_node)

    @property
    def tp_within_node(self) -> bool:
        return self.tp <= self.gpus_per_node

    @property
    def dp_within_node(self) -> bool:
        """A stage's data-parallel group (t x d consecutive ranks, stride t) fits one node."""
        return self.tp * self.dp <= self.gpus_per_node

    @property
    def dp_ranks_per_node(self) -> int:
        """Ranks of a stage's data-parallel group in one node (stride t: a node holds gpus_per_node / t of them)."""
        return max(1, min(self.dp, self.gpus_per_node // self.tp))

    @property
    def stages_within_node(self) -> bool:
        """Adjacent stages share a node (a stage holds fewer ranks than a node)."""
        return self.tp * self.dp * self.pp <= self.gpus_per_node

    @property
    def ends_within_node(self) -> bool:
        """The first and last stage (the tied embedding's all-reduce) share a node."""
        return self.stages_within_node
