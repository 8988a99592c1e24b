"""DeepSpeed-Ulysses sequence parallelism (`--ds-sequence-parallel-size N`), with Megatron-DeepSpeed's meaning.

Groups, as Megatron-DeepSpeed's `parallel_state` builds them (T = P = 1): N consecutive ranks share each
sequence (a sequence-parallel group), ranks N apart form a data-parallel group. DeepSpeed's topology keeps
one 'data' axis of DP x N ranks, which is DeepSpeed's sequence-data-parallel group (ZeRO partitions and the
gradient reduction span it); `UlyssesGrid` tells DeepSpeed's plain engine which ranks are which
(`get_sequence_parallel_*`, `get_sequence_data_parallel_*`), and the engine then sums gradients over the
DP x N ranks and divides by DP (`DeepSpeedEngine._reduce_non_expert_gradients`): each rank's gradient is
its part of the sequence's share of the one loss, so the sum over a group is the whole gradient.

Data: the ranks of a group read the same micro-batches (their data-parallel rank is the group's); each
keeps its part of the tokens and labels, all of the loss mask (`local_part`, what Megatron-DeepSpeed's
`get_batch` cuts). Positions (learned or rotary) are the part's own.

Attention: DeepSpeed's `DistributedAttention` (`deepspeed.sequence.layer`) around the layer's core
attention: q, k, v of this rank's tokens (b, s/N, heads, hd) go through an all-to-all to the whole
sequence of heads/N heads, attend, and come back (batch-first: `batch_dim_idx=0`, heads scattered,
the sequence gathered). Its exchanges are `all_to_all_single`, which gloo has: nothing is replaced.

Loss: every rank computes the loss of the whole sequence from the per-token losses of all parts
(`sequence_loss`: all-gathered, whose backward keeps this rank's part of the gradient, as
Megatron-DeepSpeed's `vocab_sequence_parallel_cross_entropy`), so the reported loss is the same on each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.runtime.pipe.topology import PipelineParallelGrid, ProcessTopology

from megatron_ds.model.tensor_parallel_rank import UlyssesGroup


class UlyssesGrid(PipelineParallelGrid):
    """DeepSpeed's grid of a topology whose 'data' axis is DP x N ranks, N consecutive ones per sequence:
    the data-parallel group is the ranks N apart, the sequence-parallel group the N consecutive ones."""

    def __init__(self, topology: ProcessTopology, sequence_parallel_size: int) -> None:
        super().__init__(topology=topology)
        n = self.sequence_parallel_size = sequence_parallel_size
        self._seq_dp_rank = self.data_parallel_id  # the coordinate on the DP x N axis
        self._seq_dp_size, self._seq_dp_group = self.data_parallel_size, self.dp_proc_group
        self.sequence_parallel_rank = self._seq_dp_rank % n
        self.data_parallel_size = self._seq_dp_size // n
        self.data_parallel_id = self._seq_dp_rank // n
        for ranks in self.dp_groups:  # every rank creates every group, in the same order
            for first in range(0, len(ranks), n):
                group = dist.new_group(ranks=ranks[first : first + n])
                if self.global_rank in ranks[first : first + n]:
                    self.sequence_group, self.sequence_ranks = group, ranks[first : first + n]
            for offset in range(n):
                group = dist.new_group(ranks=ranks[offset::n])
                if self.global_rank in ranks[offset::n]:
                    self.dp_proc_group, self.dp_group = group, ranks[offset::n]

    def get_sequence_parallel_rank(self) -> int:
        return self.sequence_parallel_rank

    def get_sequence_parallel_world_size(self) -> int:
        return self.sequence_parallel_size

    def get_sequence_parallel_group(self) -> Any:
        return self.sequence_group

    def get_sequence_data_parallel_rank(self) -> int:
        return self._seq_dp_rank

    def get_sequence_data_parallel_world_size(self) -> int:
        return self._seq_dp_size

    def get_sequence_data_parallel_group(self) -> Any:
        return self._seq_dp_group


def group_of(grid: UlyssesGrid) -> UlyssesGroup:
    """This rank's `UlyssesGroup` in `grid`."""
    return UlyssesGroup(
        size=grid.sequence_parallel_size, rank=grid.sequence_parallel_rank, group=grid.get_sequence_parallel_group()
    )


def local_part(batch: Any, group: UlyssesGroup) -> Any:
    """((tokens,) or tokens, (labels, loss_mask)) of a micro-batch -> this rank's part of the tokens and labels
    (b, s/N), and the whole loss mask (b, s), as Megatron-DeepSpeed's `get_batch` cuts them."""
    inputs, (labels, loss_mask) = batch
    tokens = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
    part = tokens.shape[1] // group.size
    first = group.rank * part
    mine = tokens[:, first : first + part]
    return ((mine,) if isinstance(inputs, (tuple, list)) else mine), (labels[:, first : first + part], loss_mask)


def distributed_attention(
    group: UlyssesGroup,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    """q (b, nh, s/N, hd), k and v (b, kv, s/N, hd) of this rank's tokens -> the attention output of those
    tokens (b, nh, s/N, hd), through DeepSpeed's DistributedAttention; `attend` is the core attention of
    (b, heads, s, hd) tensors (it sees the whole sequence of nh/N query heads and kv/N key/value heads)."""
    from deepspeed.sequence.layer import DistributedAttention

    def local(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:  # each (b, s, heads/N, hd)
        return attend(q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2)).transpose(1, 2)

    layer = DistributedAttention(local, group.group, scatter_idx=2, gather_idx=1)
    out = layer(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), batch_dim_idx=0)  # (b, s/N, nh, hd)
    return out.transpose(1, 2)


class _GatherSequence(torch.autograd.Function):
    """Per-token values (b, s/N) of every rank of the group -> (b, s); backward keeps this rank's part (every
    rank computes the same function of the gathered values)."""

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, group: UlyssesGroup) -> torch.Tensor:
        ctx.rank, ctx.width = group.rank, part.shape[1]
        parts = [torch.empty_like(part) for _ in range(group.size)]
        dist.all_gather(parts, part.contiguous(), group=group.group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.narrow(1, ctx.rank * ctx.width, ctx.width).contiguous(), None


def sequence_loss(group: UlyssesGroup, logits: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The mean token cross entropy over the unmasked positions of the whole sequence, from this rank's
    fp32 logits (b, s/N, v), its labels (b, s/N) and the whole loss mask (b, s)."""
    targets, loss_mask = labels
    b, part, vocab = logits.shape
    losses = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1).long(), reduction="none")
    whole = _GatherSequence.apply(losses.view(b, part), group)  # (b, s)
    mask = loss_mask.reshape(-1).float()
    return (whole.reshape(-1) * mask).sum() / mask.sum().clamp(min=1.0)
