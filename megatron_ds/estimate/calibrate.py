"""Measured time of each spec type, to turn the compute model into seconds (for a `profile` partition).

`calibrate(model, b)` builds one copy of each group of our GPT (the pre group, one transformer
layer, the post group with the loss) in this process, at T = 1, and times one micro-batch's forward
and backward of each: the median of `repeats` runs after `warmup` untimed ones. `stage_time_fn`
then gives the `megatron_ds.pipeline.fastest` cost function: stage s holding k layers takes
pre + k x layer + post (its groups), and recomputed layers add a layer forward to the backward
(`megatron_ds.estimate.compute.recomputed_layers`).

Times are of this process on this device with its thread settings: calibrate where the run will
run (a GPU stage on a GPU, with the run's precision), not on a login node.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.estimate.compute import ComputeInputs, recomputed_layers, spec_flops
from megatron_ds.model import naming
from megatron_ds.model.gpt_pipe import build_layer_specs
from megatron_ds.model.layers import cross_entropy_loss
from megatron_ds.pipeline.fastest import StageTime

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

    @property
    def flops_per_second(self) -> float:
        return self.flops / (self.forward + self.backward)


@dataclass(frozen=True)
class Calibration:
    micro_batch_size: int
    timings: tuple[GroupTiming, ...]
    """One per `GROUPS` entry, in that order."""

    def group(self, name: str) -> GroupTiming:
        return next(t for t in self.timings if t.group == name)


NO_DROPOUT = RegularizationConfig(hidden_dropout=0.0, attention_dropout=0.0)
"""Timing default: the flash kernel on CPU, as training without attention dropout runs."""


def _median_seconds(fn: Callable[[], object], repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _time_group(run: Callable[[], torch.Tensor], repeats: int, warmup: int) -> tuple[float, float]:
    """(forward, backward) seconds of `run` (returns a tensor; backward from a ones gradient)."""

    def backward_once() -> None:
        out = run()
        out.backward(torch.ones_like(out))

    forward = _median_seconds(lambda: run().detach(), repeats, warmup)
    both = _median_seconds(backward_once, repeats, warmup)
    return forward, max(both - forward, 0.0)


def calibrate(
    model: ModelConfig,
    micro_batch_size: int,
    repeats: int = 3,
    warmup: int = 1,
    seed: int = 1234,
    regularization: RegularizationConfig = NO_DROPOUT,
) -> Calibration:
    """Time each group once in this process (T = 1, fp32, on CPU tensors). Pass the run's
    `regularization`: attention dropout changes which SDPA kernel runs (see estimate.compute)."""
    torch.manual_seed(seed)
    groups = naming.gpt_spec_groups(model)
    specs = build_layer_specs(model, regularization, seed)
    modules = [s.build() if hasattr(s, "build") else s for s in specs]
    first_layer = len(groups.pre)
    first_post = first_layer + model.num_layers
    embedding = modules[groups.pre.index(naming.WORD_EMBEDDING)]
    b, s, h, v = micro_batch_size, model.seq_length, model.hidden_size, model.vocab_size
    tokens = torch.randint(0, v, (b, s))
    labels = (torch.randint(0, v, (b, s)), torch.ones(b, s))
    hidden = torch.randn(b, s, h, requires_grad=True)  # as a received activation

    def run_pre() -> torch.Tensor:
        x = tokens
        for module in modules[:first_layer]:
            x = module(x)
        return x

    def run_post() -> torch.Tensor:
        x = hidden
        for spec, module in zip(specs[first_post:], modules[first_post:]):
            fn = getattr(spec, "forward_fn", None)
            x = fn(embedding, x) if fn else module(x)
        return cross_entropy_loss(x, labels)

    layer = modules[first_layer]
    flops = spec_flops(ComputeInputs(model, micro_batch_size))
    totals = {
        "pre": sum(sp.forward + sp.backward for sp in flops if sp.group == "pre"),
        "layer": next(sp.forward + sp.backward for sp in flops if sp.group == "body"),
        "post": sum(sp.forward + sp.backward for sp in flops if sp.group in ("post", "loss")),
    }
    runs = {"pre": run_pre, "layer": lambda: layer(hidden), "post": run_post}
    timings = []
    for name in GROUPS:
        fwd, bwd = _time_group(runs[name], repeats, warmup)
        timings.append(GroupTiming(name, fwd, bwd, totals[name]))
    return Calibration(micro_batch_size, tuple(timings))


def stage_time_fn(calibration: Calibration, inputs: ComputeInputs, num_stages: int) -> Callable[[int, int], StageTime]:
    """The measured `stage_time(s, k)` for `megatron_ds.pipeline.fastest` (optimizer time 0)."""
    assert inputs.micro_batch_size == calibration.micro_batch_size, (inputs, calibration.micro_batch_size)
    groups = naming.gpt_spec_groups(inputs.model)
    pre, layer, post = (calibration.group(g) for g in GROUPS)
    interval = inputs.checkpoint_num_layers if inputs.checkpoint_activations else 0

    def stage_time(stage: int, num_layers: int) -> StageTime:
        first, last = stage == 0, stage == num_stages - 1
        forward = first * pre.forward + num_layers * layer.forward + last * post.forward
        backward = first * pre.backward + num_layers * layer.backward + last * post.backward
        again = recomputed_layers(len(groups.pre) * first, num_layers, len(groups.post) * last, interval)
        return StageTime(forward, backward + again * layer.forward)

    return stage_time
