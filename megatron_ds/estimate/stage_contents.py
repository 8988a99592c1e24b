"""What one pipeline stage holds and what it recomputes, shared by the FLOPs, step-time and memory models:
a stage's specs as its ends and one transformer layer counted k times (`stage_parts`, `held_total`: the planner
prices stages of hundreds of layers), and the transformer layers DeepSpeed's activation checkpointing recomputes
in its backward (`checkpointed_chunks`, `recomputed_layers`). Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def recomputed_layers(num_pre: int, num_layers: int, num_post: int, interval: int) -> int:
    """Transformer layers of a stage that DeepSpeed recomputes in backward (`checkpointed_chunks`)."""
    return checkpointed_chunks(num_pre, num_layers, num_post, interval)[0]


def checkpointed_chunks(num_pre: int, num_layers: int, num_post: int, interval: int) -> tuple[int, int]:
    """(transformer layers recomputed in backward, the largest recomputed chunk in layers) of a stage of
    `num_pre` functions, `num_layers` transformer layers and `num_post` functions.

    PipelineModule.forward (deepspeed/runtime/pipe/module.py) cuts the stage's functions into chunks
    of `activation_checkpoint_interval` from local index 0 and checkpoints a chunk only when every
    function in it is a TransformerLayer (GPTModelPipe._is_checkpointable). `interval` 0: none.
    Closed form (a planner search asks for stages of thousands of layers): the chunks that start at or
    after the first layer and end by the last one, the stage's last chunk included when no post function
    follows it.
    """
    if interval <= 0 or num_layers <= 0:
        return 0, 0
    start = -(-num_pre // interval) * interval  # the first chunk boundary at or after the first layer
    end = num_pre + num_layers
    if start >= end:
        return 0, 0
    whole, rest = divmod(end - start, interval)
    tail = rest if num_post == 0 else 0  # the stage's last chunk, shorter, holding only layers
    return whole * interval + tail, interval if whole else tail


def stage_parts(specs: Sequence[Any], post_groups: tuple[str, ...] = ("post",)) -> tuple[tuple, tuple, Any]:
    """(the pre specs, the specs of `post_groups`, the first transformer layer) of a model's specs (`SpecFlops` or
    `SpecMemory`): every layer is that one's copy, so a stage's totals are its ends plus k times the layer."""
    pre = tuple(sp for sp in specs if sp.group == "pre")
    post = tuple(sp for sp in specs if sp.group in post_groups)
    return pre, post, next(sp for sp in specs if sp.group == "body")


def held_total(ends: Sequence[Any], layer: Any, num_layers: int, attr: str) -> float:
    """`attr` summed over a stage holding `ends` (pre and post specs) and `num_layers` copies of `layer`: the
    planner prices stages of hundreds of layers, so the layer is counted, not listed."""
    return sum(getattr(sp, attr) for sp in ends) + num_layers * getattr(layer, attr)
