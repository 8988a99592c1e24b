"""Read a Hugging Face model's weights safely: safetensors, or a `.bin` with weights_only=True.

Only tensor headers are read until a tensor is asked for; safetensors files are memory-mapped.
Pickled `.bin` files are loaded with `torch.load(..., weights_only=True)`, which refuses to run
code, so a downloaded model can never execute anything here.
"""

from __future__ import annotations

import json
import os
import pickle
from typing import Any

import torch

from megatron_ds import files
from megatron_ds.errors import UserError

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


class HFWeightsError(UserError):
    """Missing, damaged or mismatched Hugging Face weight files."""


class HFWeights:
    """Name -> tensor access over one HF directory's weight files (single or sharded)."""

    def __init__(self, hf_dir: str) -> None:
        self.hf_dir = hf_dir
        self.files = self._weight_files()
        self.location: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.stored_name: dict[str, str] = {}
        self._open: dict[str, Any] = {}
        for path in self.files:
            for name, shape in self._header(path).items():
                self.location[name], self.shapes[name], self.stored_name[name] = path, shape, name

    def add_prefix(self, prefix: str) -> None:
        """Address every tensor as `prefix + name` (GPT2Model files lack GPT2LMHeadModel's "transformer.")."""
        for table in (self.location, self.shapes, self.stored_name):
            for name in list(table):
                table[prefix + name] = table.pop(name)

    def _weight_files(self) -> list[str]:
        for index_name, single in ((SAFETENSORS_INDEX, SAFETENSORS), (BIN_INDEX, BIN)):
            index = os.path.join(self.hf_dir, index_name)
            if os.path.isfile(index):
                try:
                    with open(index, encoding="utf-8") as f:
                        weight_map = json.load(f)["weight_map"]
                    return sorted({os.path.join(self.hf_dir, v) for v in weight_map.values()})
                except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as err:
                    raise HFWeightsError(f"{index}: not a valid weight index ({err}); re-download the model") from None
            if os.path.isfile(os.path.join(self.hf_dir, single)):
                return [os.path.join(self.hf_dir, single)]
        raise HFWeightsError(
            f"{self.hf_dir}: no {SAFETENSORS} (or {SAFETENSORS_INDEX}, {BIN}); give a directory saved by "
            f"transformers' save_pretrained"
        )

    def _header(self, path: str) -> dict[str, tuple[int, ...]]:
        if not os.path.isfile(path):
            raise HFWeightsError(f"{path}: missing (named by the weight index); re-download the model")
        try:
            if path.endswith(".safetensors"):
                from safetensors import safe_open

                handle = safe_open(path, framework="pt")
                self._open[path] = handle
                return {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as err:  # noqa: BLE001 - safetensors and torch raise various types on damaged files
            raise HFWeightsError(files.load_failure(path, err)) from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise HFWeightsError(f"{path}: not a state dict of tensors; give a transformers checkpoint")
        self._open[path] = state
        return {k: tuple(v.shape) for k, v in state.items()}

    def get(self, name: str) -> torch.Tensor:
        path, stored = self.location[name], self.stored_name[name]
        handle = self._open[path]
        try:
            tensor = handle[stored] if isinstance(handle, dict) else handle.get_tensor(stored)
        except (RuntimeError, OSError, pickle.UnpicklingError, ValueError) as err:
            raise HFWeightsError(f"{path}: tensor {name} unreadable ({err}); the file is damaged") from None
        if not tensor.is_floating_point():  # cast to the model's dtype, its integers would be the weights
            raise HFWeightsError(
                f"{path}: tensor {name} is {str(tensor.dtype).removeprefix('torch.')}, not floating point (quantized "
                f"weights?); give the model's unquantized weights"
            )
        return tensor
