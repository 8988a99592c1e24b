"""Every weight of one of our checkpoints, whole (T = 1), one tensor at a time, whatever the model: what the
Hugging Face export (`interop/hf_export.py`) and one-process inference (`inference/model.py`) read.

A dense model's weights are its per-spec files (`reader.iter_tensors`); a mixture-of-experts model's are DeepSpeed's
model-state and per-expert files, or a converted one's universal form (`moe_weights`), every expert by its global
index whatever expert-parallel size saved it.
"""

from __future__ import annotations

from collections.abc import Iterator

from megatron_ds.model import naming
from megatron_ds.training.checkpoint.reader import Checkpoint, SpecTensor, iter_tensors, refuse_universal


def iter_model_tensors(ckpt: Checkpoint) -> Iterator[SpecTensor]:
    """Every tensor of the model as its full T=1 tensor, in spec order (tied head: no entry). Open `ckpt` with
    `reader.open_checkpoint(path, moe=True)`."""
    if not ckpt.config.model.is_moe:
        yield from iter_tensors(ckpt)
        return
    from megatron_ds.training.checkpoint import moe_weights  # reads DeepSpeed's files: dense models import no DeepSpeed

    refuse_universal(ckpt)
    groups = naming.gpt_spec_groups(ckpt.config.model)
    for t, tensor in moe_weights.iter_weights(ckpt):
        yield SpecTensor(t.spec_index, t.spec, groups.layer_of(t.spec_index), t.key, t.rule, tensor)
