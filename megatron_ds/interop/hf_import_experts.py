"""A Hugging Face mixture-of-experts model (Mixtral) imported as a checkpoint that `pretrain_gpt.py --load` trains from.

Our mixture-of-experts checkpoints keep their experts in DeepSpeed's files, which only a DeepSpeed engine writes; so,
as a converted Megatron-DeepSpeed MoE checkpoint (`interop/converted.py`), the import holds its weights in universal
form beside its metadata:

    OUT/latest, OUT/global_step0/megatron_ds.json     the config, iteration 0, weights only (as every import)
    OUT/global_step0.universal/                       every tensor in fp32, each expert by its global index

`--load OUT` takes the weights from there (`save_load._load_weights`) under any world size and expert-parallel size,
with a fresh optimizer and learning-rate schedule; generation, inference and the Hugging Face export read them through
`moe_weights` (a converted checkpoint's universal form).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from megatron_ds import files
from megatron_ds.interop import hf_weights
from megatron_ds.interop.hf_weights_reader import HFWeights
from megatron_ds.model import naming
from megatron_ds.training.checkpoint import reader
from megatron_ds.training.checkpoint.directory import CONVERTED, META, fingerprint
from megatron_ds.training.checkpoint.universal import store
from megatron_ds.training.checkpoint.universal.convert import SUFFIX
from megatron_ds.training.checkpoint.universal.deepspeed_source import FP32
from megatron_ds.training.checkpoint.universal.names import ModelTensor, model_tensors


def converted_section(tag: str, hf_dir: str, vocab_size: int) -> dict[str, Any]:
    """The metadata section that marks a checkpoint whose weights are in its universal form (`<tag>.universal`)."""
    return {CONVERTED: {"upstream": "hf", "source": hf_dir, "vocab_size": vocab_size, "universal": tag + SUFFIX}}


class HFSource:
    """A Hugging Face model's weights as our full fp32 tensors (vocabulary rows zero-padded), in the reader interface
    `universal.store.write` takes: no optimizer state, no step taken, no schedule."""

    def __init__(self, weights: HFWeights, arch: str, ckpt: reader.Checkpoint, hf_dir: str) -> None:
        self.weights, self.arch, self.ckpt, self.hf_dir = weights, arch, ckpt, hf_dir
        self.model = ckpt.config.model
        self.groups = naming.gpt_spec_groups(self.model)

    def state_keys(self) -> list[str]:
        return []

    def step(self, tensor: ModelTensor) -> int | None:
        return None

    def read(self, tensor: ModelTensor, state: str) -> torch.Tensor:
        assert state == FP32, state  # state_keys() is empty
        layer = self.groups.layer_of(tensor.spec_index)
        rows = self.model.vocab_size
        return hf_weights.read_ours(
            self.arch, tensor.spec, tensor.key, layer, tensor.rule, self.weights.get, rows
        ).float()

    def engine_state(self) -> dict[str, Any]:
        return {"global_steps": 0, "global_samples": 0, "skipped_steps": 0, "lr_scheduler": None}

    def loss_scaler(self) -> None:
        return None

    def record(self) -> dict[str, Any]:
        return {
            "format": "hf",
            "directory": self.hf_dir,
            "fingerprint": fingerprint(os.path.join(self.ckpt.directory, META)),
        }


def write_universal(weights: HFWeights, arch: str, ckpt: reader.Checkpoint, hf_dir: str, show_progress: bool) -> None:
    """`ckpt`'s universal form (`<tag>.universal` beside its directory, whose metadata is written) from `weights`."""
    universal = os.path.join(ckpt.root, ckpt.tag + SUFFIX)
    os.makedirs(universal)
    bar = files.progress(len(model_tensors(ckpt.config.model)), "import", show_progress)
    try:
        store.write(HFSource(weights, arch, ckpt, hf_dir), universal, bar)
    finally:
        bar.close()
    store.Universal(universal)  # validated before the output gets its name
