"""Measured group times turned into stage times (`--pp-partition-method profile`). Pure: no torch.

The runtime measures (`megatron_ds.training.measure.calibrate` times one micro-batch's forward and
backward of each spec group, and the optimizer step over its parameters, in this process) and hands
the numbers down as a `Calibration`. `stage_time_fn` then gives the `megatron_ds.pipeline` cost
function: stage s holding k layers takes pre + k x layer + post (its groups; the last stage also
steps its copy of a tied embedding, unless it is the first too, where DeepSpeed builds the tied
module once), recomputed layers add a layer forward to the backward
(`megatron_ds.estimate.stage_contents.recomputed_layers`), and at T > 1 each group's time is scaled by
its FLOPs per tensor rank over its FLOPs at T = 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megatron_ds.estimate.compute import ComputeInputs, core_attention_forward, spec_flops
from megatron_ds.estimate.stage_contents import recomputed_layers
from megatron_ds.model import naming
from megatron_ds.pipeline.costs import StageTime

GROUPS = ("pre", "layer", "post")
"""What is timed, in this order: the pre group, one transformer layer, the post group and the loss."""


@dataclass(frozen=True)
class GroupTiming:
    group: str
    forward: float
    """Seconds, one micro-batch."""
    backward: float
    flops: int
    """Forward + backward FLOPs of the group by the compute model (for FLOP/s)."""
    optimizer: float = 0.0
    """Seconds of the gradient-norm clip and the optimizer step over the group's parameters."""

    @property
    def flops_per_second(self) -> float:
        return self.flops / (self.forward + self.backward)


@dataclass(frozen=True)
class Calibration:
    micro_batch_size: int
    timings: tuple[GroupTiming, ...]
    """One per `GROUPS` entry, in that order."""
    tied_copy_optimizer: float = 0.0
    """Seconds of the optimizer over the last stage's copy of a tied word embedding (0 when untied).
    Not in the post group's `optimizer`: with one stage, DeepSpeed builds the tied module once."""

    def group(self, name: str) -> GroupTiming:
        return next(t for t in self.timings if t.group == name)


def group_flops(inputs: ComputeInputs) -> dict[str, int]:
    specs = spec_flops(inputs)
    return {
        "pre": sum(sp.forward + sp.backward for sp in specs if sp.group == "pre"),
        "layer": next(sp.forward + sp.backward for sp in specs if sp.group == "body"),
        "post": sum(sp.forward + sp.backward for sp in specs if sp.group in ("post", "loss")),
    }


def stage_time_fn(calibration: Calibration, inputs: ComputeInputs, num_stages: int) -> Callable[[int, int], StageTime]:
    """The measured `stage_time(s, k)` for `megatron_ds.pipeline.fastest`, in seconds."""
    assert inputs.micro_batch_size == calibration.micro_batch_size, (inputs, calibration.micro_batch_size)
    groups = naming.gpt_spec_groups(inputs.model)
    one_rank = group_flops(ComputeInputs(inputs.model, inputs.micro_batch_size))
    per_rank = group_flops(inputs)
    scale = {g: per_rank[g] / one_rank[g] if one_rank[g] else 1.0 for g in GROUPS}  # 1 at T = 1
    pre, layer, post = (calibration.group(g) for g in GROUPS)
    interval = inputs.checkpoint_num_layers if inputs.checkpoint_activations else 0
    body = next(sp for sp in spec_flops(inputs) if sp.group == "body")
    attention_share = core_attention_forward(body) / body.forward if inputs.selective_recompute else 0.0

    def stage_time(stage: int, num_layers: int) -> StageTime:
        first, last = stage == 0, stage == num_stages - 1
        parts = [(pre, scale["pre"], first), (layer, scale["layer"], num_layers), (post, scale["post"], last)]
        forward = sum(n * g.forward * f for g, f, n in parts)
        backward = sum(n * g.backward * f for g, f, n in parts)
        optimizer = sum(n * g.optimizer for g, _, n in parts)
        optimizer += calibration.tied_copy_optimizer * (last and not first)  # one stage: one shared module
        optimizer /= inputs.tensor_parallel_size
        again = recomputed_layers(len(groups.pre) * first, num_layers, len(groups.post) * last, interval)
        again += num_layers * attention_share  # selective recomputation: the core attention's share of a forward
        return StageTime(forward, backward + again * layer.forward * scale["layer"], optimizer)

    return stage_time
