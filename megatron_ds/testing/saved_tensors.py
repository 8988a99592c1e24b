"""The bytes an autograd graph keeps for backward, walked from its output (what the memory model's
activation terms are checked against)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def graph_bytes(out: torch.Tensor, params: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages `out`'s autograd graph keeps (`params` excluded): every node's saved
    tensors (`_saved_*` of torch's nodes, `saved_tensors` of Python functions) and the inputs DeepSpeed's
    activation checkpointing keeps outside autograd's saved-tensor mechanism (`deepspeed_saved_tensors`),
    which saved-tensor hooks do not see."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    storages: dict[int, int] = {}

    def add(x: Any) -> None:
        if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in param_ptrs:
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()

    seen: set[Any] = set()
    stack = [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                for x in value if isinstance(value, (tuple, list)) else [value]:
                    add(x)
        for x in getattr(node, "deepspeed_saved_tensors", None) or []:
            add(x)
        try:
            for x in node.saved_tensors:
                add(x)
        except (AttributeError, RuntimeError):
            pass
        stack.extend(n for n, _ in node.next_functions)
    return sum(storages.values())
