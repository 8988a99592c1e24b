"""What the layout engine's searches take as input: stage times, step estimates and cost functions,
and the one check of a split's shape. Pure: the costs come in from the caller."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_ds.errors import LayoutError


@dataclass(frozen=True)
class StageTime:
    """Times of one pipeline stage, in any one unit."""

    forward: float
    """One micro-batch's forward pass."""
    backward: float
    """One micro-batch's backward pass, recomputation included."""
    optimizer: float = 0.0
    """The optimizer step (with the gradient reductions that precede it)."""
    weight: float = 0.0
    """The part of `backward` that is weight gradients, which a schedule that splits backwards
    (ZB-H1) runs in a later weight pass; 0: none deferrable."""


@dataclass(frozen=True)
class StepEstimate:
    """A step time with an optional certificate: `path[s]` = the coefficients of stage s's forward,
    backward, optimizer and weight times on one path of the schedule whose other durations sum to
    `path_constant` (a weight coefficient may be negative: an input-gradient pass is backward -
    weight). For any stage times the step must be >= that path's length."""

    time: float
    path: tuple[tuple[float, float, float, float], ...] = ()
    path_constant: float = 0.0


StageCost = Callable[[int, int], float]
"""`cost(stage, num_layers)`: what stage `stage` costs holding `num_layers` transformer layers."""
StageTimeFn = Callable[[int, int], StageTime]
StageMemoryFn = Callable[[int, int], float]
StepTimeFn = Callable[[Sequence[StageTime]], "float | StepEstimate"]


def check_shape(num_layers: int, num_stages: int, flag: str) -> None:
    """P >= 1, N >= 1 and P <= N + 2 (embedding, one layer each, head), or a LayoutError naming `flag`."""
    if num_stages < 1:
        raise LayoutError(f"{flag}: --pipeline-model-parallel-size must be >= 1, got {num_stages}")
    if num_layers < 1:
        raise LayoutError(f"{flag}: --num-layers must be >= 1, got {num_layers}")
    if num_stages > num_layers + 2:
        raise LayoutError(
            f"{flag} cannot place --num-layers {num_layers} on --pipeline-model-parallel-size {num_stages}: "
            f"at most {num_layers + 2} stages (embedding, one layer each, head); use fewer stages or more layers"
        )
