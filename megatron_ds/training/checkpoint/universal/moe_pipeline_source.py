"""Read a mixture-of-experts checkpoint saved at pipeline size P > 1 (DeepSpeed's pipeline engine) as whole tensors.

DeepSpeed's pipeline engine saves each stage on its own, under its model-parallel rank mp = the stage (T = 1), as the
plain engine saves a whole P = 1 model (`moe_source`), except that a stage's MoE layers are numbered from 0 on the
stage and a stage without MoE layers is saved as a dense stage. `experts.json` records, besides each global rank's
expert-parallel rank r and expert-data-parallel rank q, its stage and each stage's optimizer groups per r
(`training/checkpoint/experts.py`); a stage's ranks, in global-rank order, are its data-parallel ranks 0 .. D - 1
(DeepSpeed's pipe-data topology: the data axis inner):

  weights          a stage with MoE layers: mp_rank_<s>_model_states.pt "module" (every parameter of the stage but the
                   experts, the tied embedding on the first and last stage) and layer_<m>_expert_<e>_mp_rank_<s>_model_
                   states.pt (expert e, global index, of the stage's m-th MoE layer); a dense stage: one
                   layer_<spec>-model_00-model_states.pt per spec (`moe_weights.stage_weight_file`)
  ZeRO 0, fp32     a stage with MoE layers: expp_rank_<r>_mp_rank_<s>_optim_states.pt "optimizer", torch's state dict
                   over rank r's parameters of the stage by position (`experts.json`'s optimizer_groups_by_stage[s][r]);
                   a dense stage: mp_rank_<s>_model_states.pt "optimizer", the same by position
  ZeRO 1, or bf16  [bf16_]zero_pp_rank_<d>_mp_rank_<s>_optim_states.pt, d the rank's data-parallel rank in the stage:
  (ZeRO 0 too:     flat fp32 partitions and Adam's state of them, `param_slice_mappings` by LOCAL names; a dense
  BF16_Optimizer)  parameter partitioned over the stage's D ranks, an expert of rank r over the ranks of the stage with
                   that r, in q order
  engine state     mp_rank_00_model_states.pt: global_steps, global_samples, skipped_steps, lr_scheduler

The tied embedding is read from the first stage's copy (the last stage's is the same: DeepSpeed all-reduces their
gradients). fp16 without ZeRO (DeepSpeed's FP16_Optimizer) is not read (`deepspeed_source`'s one-line refusal).
"""

from __future__ import annotations

from typing import Any

from megatron_ds.model import naming
from megatron_ds.training.checkpoint import experts, moe_weights
from megatron_ds.training.checkpoint.directory import CheckpointError
from megatron_ds.training.checkpoint.universal import names
from megatron_ds.training.checkpoint.universal.moe_source import MoeSource


class MoePipelineSource(MoeSource):
    """`MoeSource` for a mixture-of-experts checkpoint of DeepSpeed's pipeline engine (P > 1)."""

    def __init__(self, ckpt: Any) -> None:
        super().__init__(ckpt)
        self.flat = self.flat or self.precision == "bf16"  # the pipeline engine's BF16_Optimizer: flat at ZeRO 0
        self.stages, self.groups_by_stage = _stage_record(self.experts, ckpt.directory, self.layout.num_stages)
        first = len(naming.gpt_spec_groups(self.model).pre)
        moe_specs = [first + i for i, n in enumerate(self.model.experts_per_layer) if n > 1]
        self.moe_stages = {self.layout.rank_of_spec(i) for i in moe_specs}
        """The stages holding MoE layers; the others DeepSpeed saved as dense stages."""

    def _stage(self, tensor: names.ModelTensor) -> int:
        return names.source_stage(self.model, self.layout, tensor)[0]

    def _stage_ranks(self, stage: int) -> list[int]:
        return [d for d, s in enumerate(self.stages) if s == stage]

    def _zero_file(self, rank: int) -> str:
        stage = self.stages[rank]
        return self.optim_file(stage, 0, self._stage_ranks(stage).index(rank))

    def _recorded_groups(self, stage: int, rank: int) -> list[list[str]]:
        return self.groups_by_stage[stage][rank]

    def _optimizer_file(self, stage: int, rank: int) -> str:
        return self.expp_file(rank, stage) if stage in self.moe_stages else self.model_states_file(stage, 0)

    def _weight_location(self, tensor: names.ModelTensor) -> tuple[str, str | None, str]:
        return moe_weights.stage_weight_file(self.model, self.layout, tensor)


def _stage_record(record: dict[str, Any], directory: str, num_stages: int) -> tuple[list[int], list[Any]]:
    """(each global rank's stage, each stage's optimizer groups per expert-parallel rank) from `experts.json`; a
    CheckpointError naming what to do when the record has none (or not every stage's)."""
    stages, by_stage = record.get("stages"), record.get("optimizer_groups_by_stage")
    fits = (
        isinstance(stages, list)
        and isinstance(by_stage, list)
        and len(stages) == len(record["ranks"])
        and sorted(set(stages)) == list(range(num_stages))
        and len(by_stage) == num_stages
        and all(isinstance(g, list) and all(r is not None for r in g) for g in by_stage)
    )
    if not fits:
        raise CheckpointError(
            f"{directory}/{experts.EXPERTS_FILE}: records no stage of each rank at pipeline size {num_stages}, so "
            f"its universal form cannot be read; resume it under the layout, sizes, ZeRO stage and precision it was "
            f"saved with"
        )
    return stages, by_stage
