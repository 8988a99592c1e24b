"""A mixture-of-experts checkpoint's model weights as whole tensors, every expert by its global index, without torch
.distributed: what one-process inference loads (`megatron_ds.inference.load_model`) and the Hugging Face export writes
(both through `weights.iter_model_tensors`), and a `--kd` teacher's rank its own experts of (`training/distillation.py`).

Where they are (T = 1; at P = 1 MoE runs on DeepSpeed's plain engine):

  ours            `mp_rank_00_model_states.pt` "module": every parameter but the experts (the gates, PR-MoE's residual
                  MLP and coefficient included), by its one-process name; `layer_<l>_expert_<e>_mp_rank_00_model_
                  states.pt`: expert e (global index) of the l-th MoE layer. Each expert-parallel rank saved its own
                  experts under their global index, so these names do not depend on the expert-parallel size the run
                  had. The weights are in the training precision.
  ours, P > 1     DeepSpeed's pipeline engine saves each stage on its own (`stage_weight_file`): a stage holding MoE
                  layers as above, under its model-parallel rank (`mp_rank_<stage>`) and with its MoE layers numbered
                  from 0 on the stage; a stage without (the embedding's, a stage of dense layers) as a dense stage, one
                  `layer_<spec index>-model_00-model_states.pt` per spec, by the spec's own parameter names. The
                  stage of a spec is the checkpoint's layout (megatron_ds.json).
  converted       a Megatron-DeepSpeed MoE checkpoint imported by `tools/convert_checkpoint.py --from megatron-deepspeed`
                  holds no DeepSpeed files: its weights are the fp32 masters of its universal form (`<tag>.universal/`).

Files are read with `weights_only=True` (no code from them runs), memory-mapped, each once.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_ds.config import ModelConfig
from megatron_ds.model import naming
from megatron_ds.model.moe import EXPERT_PREFIX
from megatron_ds.pipeline.layout import Layout, build_layout
from megatron_ds.training.checkpoint import experts
from megatron_ds.training.checkpoint.directory import CONVERTED, CheckpointError, converted_from
from megatron_ds.training.checkpoint.opening import Checkpoint
from megatron_ds.training.checkpoint.universal import names

MODEL_STATES = "mp_rank_00_model_states.pt"
"""DeepSpeed's model-state file of a P = T = 1 run: the weights of every parameter but the experts ("module")."""


def expert_file(model: ModelConfig, tensor: names.ModelTensor) -> str | None:
    """DeepSpeed's file of the expert `tensor` belongs to (None when it is no expert's): `layer_<l>_expert_<e>_...`,
    l counting the MoE layers from 0, e the expert's global index."""
    if not tensor.key.startswith(EXPERT_PREFIX):
        return None
    first = len(naming.gpt_spec_groups(model).pre)
    moe_layer = sum(1 for n in model.experts_per_layer[: tensor.spec_index - first] if n > 1)
    expert = int(tensor.key[len(EXPERT_PREFIX) :].split(".", 1)[0])
    return f"layer_{moe_layer}_expert_{expert}_mp_rank_00_model_states.pt"


def weight_file(model: ModelConfig, tensor: names.ModelTensor) -> tuple[str, str | None]:
    """(file, key of the state dict inside it or None for the whole file) that holds `tensor`'s saved weight."""
    found = expert_file(model, tensor)
    return (MODEL_STATES, "module") if found is None else (found, None)


def stage_weight_file(model: ModelConfig, layout: Layout, tensor: names.ModelTensor) -> tuple[str, str | None, str]:
    """(file, key of the state dict inside it or None, the tensor's name there) of `tensor` in a checkpoint saved at
    pipeline size > 1 under `layout` (see the module)."""
    groups = naming.gpt_spec_groups(model)
    stage = next(s for s in range(layout.num_stages) if tensor.spec_index < layout.parts[s + 1])
    first = len(groups.pre)
    moe_specs = [first + i for i, n in enumerate(model.experts_per_layer) if n > 1]
    mine = [i for i in moe_specs if layout.parts[stage] <= i < layout.parts[stage + 1]]
    if not mine:  # a dense stage: the per-spec files
        return f"layer_{tensor.spec_index:02d}-model_00-model_states.pt", None, tensor.key
    saved = names.module_name(model, tensor)
    if not tensor.key.startswith(EXPERT_PREFIX):
        return f"mp_rank_{stage:02d}_model_states.pt", "module", saved
    expert = int(tensor.key[len(EXPERT_PREFIX) :].split(".", 1)[0])
    return f"layer_{mine.index(tensor.spec_index)}_expert_{expert}_mp_rank_{stage:02d}_model_states.pt", None, saved


def _saved_at(ckpt: Checkpoint, tensor: names.ModelTensor) -> tuple[str, str | None, str]:
    """(file, key or None, name inside) of `tensor`'s saved weight in `ckpt`, at any pipeline size."""
    model = ckpt.config.model
    if ckpt.config.parallel.pipeline_model_parallel_size == 1:
        return (*weight_file(model, tensor), names.module_name(model, tensor))
    layout = build_layout(
        naming.gpt_spec_groups(model), ckpt.config.parallel.pipeline_model_parallel_size, layout=ckpt.meta["layout"]
    )
    return stage_weight_file(model, layout, tensor)


Wanted = Callable[[names.ModelTensor], bool]
"""Which tensors to read (an expert-parallel rank: the experts it holds and every other weight)."""


def iter_weights(ckpt: Checkpoint, wanted: Wanted | None = None) -> Iterator[tuple[names.ModelTensor, torch.Tensor]]:
    """Every tensor of the mixture-of-experts checkpoint `ckpt` (`names.model_tensors` order), or those `wanted`
    accepts (a file holding none of them is not opened), whole, as saved; a missing or damaged file, or a tensor
    missing from it or of another shape, is a one-line CheckpointError naming the file."""
    model = ckpt.config.model
    tensors = [t for t in names.model_tensors(model) if wanted is None or wanted(t)]
    if converted_from(ckpt.meta) is not None:
        yield from _converted(ckpt, tensors)
        return
    from megatron_ds.training.checkpoint.universal.state_files import load_file

    experts.check_recorded(ckpt.directory)  # an older checkpoint's experts lack their fc2 bias: named as such
    opened: tuple[str, dict[str, Any]] = ("", {})  # the last file read: an expert's tensors are consecutive
    for tensor in tensors:
        name, key, saved = _saved_at(ckpt, tensor)
        path = os.path.join(ckpt.directory, name)
        if opened[0] != path:
            state = load_file(path)
            opened = (path, state.get(key) if key is not None else state)
            if not isinstance(opened[1], dict):
                raise CheckpointError(f"{path}: no {key!r} state dict; the checkpoint is damaged")
        value = opened[1].get(saved)
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{path}: no tensor {saved!r}; the checkpoint is damaged or of another model")
        if tuple(value.shape) != tensor.rule.shape:
            raise CheckpointError(
                f"{path}: {saved} has shape {tuple(value.shape)}, the config in {ckpt.tag} implies "
                f"{tensor.rule.shape}; the checkpoint is damaged"
            )
        yield tensor, value


def _converted(ckpt: Checkpoint, tensors: list[names.ModelTensor]) -> Iterator[tuple[names.ModelTensor, torch.Tensor]]:
    from megatron_ds.training.checkpoint.universal.deepspeed_source import FP32
    from megatron_ds.training.checkpoint.universal.store import Universal

    found = Universal(os.path.join(ckpt.root, str(ckpt.meta[CONVERTED].get("universal"))))  # the import records it
    for tensor in tensors:
        yield tensor, found.read(tensor.name, FP32)
