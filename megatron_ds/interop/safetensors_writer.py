"""Write Hugging Face safetensors weights: one file, or numbered shards plus the index."""

from __future__ import annotations

import os

import torch

from megatron_ds.files import write_json
from megatron_ds.interop.hf_weights_reader import SAFETENSORS_INDEX


class ShardWriter:
    """Write tensors to `model.safetensors`, or to numbered shards of at most `max_bytes` plus
    the HF index; memory holds at most one shard's tensors."""

    def __init__(self, directory: str, max_bytes: int) -> None:
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(
            self.pending, os.path.join(self.directory, f"shard-{len(self.shards)}.tmp"), metadata={"format": "pt"}
        )
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Finish; returns the file names written."""
        if self.pending or not self.shards:
            self._flush()
        n = len(self.shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, name in enumerate(names):
            os.replace(os.path.join(self.directory, f"shard-{i}.tmp"), os.path.join(self.directory, name))
        if n > 1:
            weight_map = {t: names[i] for i, shard in enumerate(self.shards) for t in shard}
            write_json(
                os.path.join(self.directory, SAFETENSORS_INDEX),
                {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map},
            )
            names.append(SAFETENSORS_INDEX)
        return names
