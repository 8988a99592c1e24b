"""The record a mixture-of-experts checkpoint keeps beside DeepSpeed's files, so that its universal form can be read.

DeepSpeed's MoE files name what they hold by position or by each rank's LOCAL parameter names: without ZeRO the
optimizer state of expert-parallel rank r (`expp_rank_<r>_mp_rank_00_optim_states.pt`) is torch's state dict,
numbered group by group over that rank's parameters; under ZeRO 1/2 `param_slice_mappings` name each rank's local
experts 0 .. n/E - 1. Which global expert a local one is depends on the rank's place in DeepSpeed's expert-parallel
groups, which a DeepSpeed JSON can change (`use_data_before_expert_parallelism`). So every save of a MoE model writes
`experts.json` into the checkpoint directory before `megatron_ds.json` (both inside the directory renamed into place
at the end: written atomically with the checkpoint):

    {"format": 1, "expert_parallel_size": E,
     "ranks": [{"expert_parallel_rank": r, "expert_data_parallel_rank": q}, ...],   one per global rank
     "optimizer_groups": [[[global names of group 0], [group 1], ...], ...]}        one per expert-parallel rank

`optimizer_groups[r]` lists the optimizer's parameter groups on expert-parallel rank r in the optimizer's order, each
parameter by its one-process name (`model.moe.global_named_parameters`; the group placeholders by theirs). At pipeline
size P > 1 it adds "stages" (each global rank's stage) and "optimizer_groups_by_stage" (per stage, the same list per
expert-parallel rank); "optimizer_groups" is then stage 0's. A MoE checkpoint written before this record is refused by
the conversion in one line.
"""

from __future__ import annotations

import json
import os
from typing import Any

from megatron_ds.training.checkpoint.directory import CheckpointError, write_atomic

EXPERTS_FILE = "experts.json"
FORMAT = 1


def optimizer_param_groups(optimizer: Any) -> list[list[Any]]:
    """The model parameters of each optimizer group, in the order the optimizer numbers them: DeepSpeed's ZeRO-1/2
    (`bit16_groups`), its FP16_UnfusedOptimizer (bf16/fp16 without ZeRO: `fp16_groups`) or torch's own."""
    for attribute in ("bit16_groups", "fp16_groups", "bf16_groups"):
        groups = getattr(optimizer, attribute, None)
        if groups is not None:
            return [list(g) for g in groups]
    return [list(g["params"]) for g in optimizer.param_groups]


def rank_record(engine: Any, expert_parallel_size: int) -> dict[str, Any]:
    """This rank's part of the record (every rank, a stage without experts too; the collective gather is the
    caller's). At P > 1 each rank records its stage too, and every stage's optimizer groups are kept apart."""
    from deepspeed.utils import groups

    from megatron_ds.model.moe import global_named_parameters

    name = f"ep_size_{expert_parallel_size}"  # DeepSpeed's group name, made on every rank at P > 1 too
    out: dict[str, Any] = {
        "expert_parallel_rank": groups._get_expert_parallel_rank(name),
        "expert_data_parallel_rank": groups._get_expert_data_parallel_rank(name),
        "stage": int(engine.stage_id),
    }
    if out["expert_data_parallel_rank"] == 0:  # one rank per expert-parallel rank (and stage) sends its groups
        by_id = {id(p): n for n, p in global_named_parameters(engine.module).items()}
        out["optimizer_groups"] = [[by_id[id(p)] for p in g] for g in optimizer_param_groups(engine.optimizer)]
    return out


def write(directory: str, records: list[dict[str, Any]]) -> None:
    """Rank 0: the gathered `rank_record`s (in global rank order) as `directory/experts.json`."""
    size = 1 + max(r["expert_parallel_rank"] for r in records)
    stages = [r.get("stage", 0) for r in records]
    by_stage: list[list[Any]] = [[None] * size for _ in range(1 + max(stages))]
    for r, stage in zip(records, stages, strict=True):
        if "optimizer_groups" in r:
            by_stage[stage][r["expert_parallel_rank"]] = r["optimizer_groups"]
    record = {
        "format": FORMAT,
        "expert_parallel_size": size,
        "ranks": [{k: r[k] for k in ("expert_parallel_rank", "expert_data_parallel_rank")} for r in records],
        "optimizer_groups": by_stage[0],
    }
    if len(by_stage) > 1:  # P > 1: every rank's stage and each stage's groups (`universal.moe_pipeline_source`)
        record["stages"] = stages
        record["optimizer_groups_by_stage"] = by_stage
    write_atomic(os.path.join(directory, EXPERTS_FILE), json.dumps(record))


def check_recorded(directory: str) -> None:
    """CheckpointError naming what to do when the MoE checkpoint in `directory` has no record: it was saved before the
    record existed, when its experts had no fc2 bias."""
    if not os.path.isfile(os.path.join(directory, EXPERTS_FILE)):
        raise CheckpointError(
            f"{directory}: a mixture-of-experts checkpoint without {EXPERTS_FILE}, saved before megatron_ds gave "
            f"each expert the fc2 bias Megatron-DeepSpeed's experts have (and recorded where each expert's optimizer "
            f"state is): its experts do not fit this model; load it with the megatron_ds release that wrote it"
        )


def read(directory: str, world_size: int, expert_parallel_size: int) -> dict[str, Any]:
    """The record of the MoE checkpoint in `directory`, checked against its world size and E; CheckpointError naming
    what to do when it is missing (`check_recorded`) or does not fit."""
    check_recorded(directory)
    path = os.path.join(directory, EXPERTS_FILE)
    try:
        with open(path) as f:
            record = json.load(f)
        ranks, groups = record["ranks"], record["optimizer_groups"]
        fits = (
            record.get("format") == FORMAT
            and record["expert_parallel_size"] == expert_parallel_size
            and len(ranks) == world_size
            and len(groups) == expert_parallel_size
            and all(g is not None for g in groups)
        )
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: unreadable ({err}); the checkpoint is damaged") from None
    if not fits:
        raise CheckpointError(
            f"{path}: does not describe {world_size} ranks at --moe-expert-parallel-size {expert_parallel_size}; "
            f"the checkpoint is damaged"
        )
    return record
