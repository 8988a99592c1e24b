"""A Megatron-LM `--ckpt-format torch` checkpoint's experts: megatron-core's SequentialMLP keeps each expert-parallel
rank's local experts (`decoder.layers.<l>.mlp.experts.local_experts.<e>.*`) in that rank's own file; read as one model
under their global index (`global_experts`). Grouped-GEMM experts (GroupedMLP's `weight1`/`weight2`, TEGroupedMLP's
`linear_fc1.weight<e>`) are read from torch_dist only (`GROUPED_EXPERTS` names them)."""

from __future__ import annotations

import re
from typing import Any

from megatron_ds.training.checkpoint.directory import CheckpointError

_LOCAL_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")
"""megatron-core's SequentialMLP: a local expert's tensors in a rank's state dict."""
GROUPED_EXPERTS = re.compile(r"\.mlp\.experts\.(weight[12]|linear_fc[12]\.(weight|bias)\d+)$")
"""GroupedMLP's (`weight1`, `weight2`) and TEGroupedMLP's (`linear_fc1.weight<i>`) tensors of all local experts."""


def global_experts(models: list[dict[str, Any]], first: str) -> dict[str, Any]:
    """The state dicts of each expert-parallel rank as one: the first rank's, each rank's local experts renamed to
    their global index (expert e of rank r is r x local + e, megatron-core's numbering)."""
    if len(models) == 1:
        return models[0]
    out = {k: v for k, v in models[0].items() if not _LOCAL_EXPERT.match(k)}
    count: int | None = None
    for rank, model in enumerate(models):
        local = {int(m.group(2)) for k in model if (m := _LOCAL_EXPERT.match(k))}
        if local != set(range(len(local))) or count not in (None, len(local)):
            raise CheckpointError(
                f"{first}: expert-parallel rank {rank}'s file holds local experts {sorted(local)}; the checkpoint is "
                f"damaged"
            )
        count = len(local)
        for key, value in model.items():
            if (m := _LOCAL_EXPERT.match(key)) is not None:
                out[f"{m.group(1)}{rank * count + int(m.group(2))}{m.group(3)}"] = value
    return out
