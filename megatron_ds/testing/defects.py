"""Stock DeepSpeed's defects, brought back from test code: `build_pipeline` with some of its fixes off.

Production code has no switch for these; the tests that show each defect (and that the guards
catch it) build the unfixed variant here by replacing one step of the builder while it runs:

    with unfixed(["group_placeholders", "norm_marking", "counted_fp32_clip", "preflight"]):
        pipe = build_pipeline(config, layout=layout)

The scenario runner takes the names from a scenario's "unfixed" list.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any


def install_stock_fp32_grad_norm(engine: Any) -> None:
    """DeepSpeed's own no-ZeRO fp32 clip (`deepspeed.runtime.utils.clip_grad_norm_`, which counts a
    parameter on model-parallel rank 0, i.e. stage 0, or when it is flagged model-parallel), keeping
    the norm it computes so the tests can compare it (DeepSpeed's engine discards it)."""
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_fp32_gradients() -> None:
        params = engine.module.parameters()
        engine._global_grad_norm = clip_grad_norm_(
            parameters=params, max_norm=engine.gradient_clipping(), mpu=engine.mpu
        )

    engine.clip_fp32_gradients = clip_fp32_gradients


def _build_with_pipe_partitioning(config: Any, user: Any = None) -> dict[str, Any]:
    """The generated DeepSpeed JSON without our `pipeline` section: DeepSpeed's defaults (`pipe_partitioned`,
    `grad_partitioned` on at T > 1) partition sequence-parallel messages a second time."""
    from megatron_ds.training import deepspeed_config

    ds = deepspeed_config.build(config, user)
    ds.pop("pipeline", None)
    return ds


UNFIXED: dict[str, tuple[str, str, Any]] = {
    # An embedding-only stage leaves its no-decay group empty, DeepSpeed drops it, and under ZeRO
    # that stage issues one gradient-norm all-reduce fewer: the seed's hang.
    "group_placeholders": (
        "megatron_ds.training.builder",
        "add_group_placeholders",
        lambda module, decoupled=False, expert_group=None: [],
    ),
    # No parameter says "count me": DeepSpeed's norm paths fall back to model-parallel rank 0 (stage 0).
    "norm_marking": ("megatron_ds.model.gpt_pipe", "mark_norm_counting", lambda module, tp_rank: None),
    # DeepSpeed's fp32 clip rule (stage 0 only without marking; the tied shard twice at T > 1).
    "counted_fp32_clip": ("megatron_ds.training.builder", "install_fp32_grad_norm", install_stock_fp32_grad_norm),
    # No structure check before the first step, so a mismatch shows as the hang itself.
    "preflight": ("megatron_ds.training.builder", "check_structure", lambda module, optimizer: None),
    # No agreement check: ranks launched with another schedule or other virtual stages run into each other.
    "run_agreement": ("megatron_ds.training.builder", "check_run_agreement", lambda config, layout=None: None),
    # Sequence parallelism: norm and row-parallel bias gradients left as each rank's partial sums
    # (Megatron-DeepSpeed #170).
    "partial_gradients": ("megatron_ds.model.gpt_pipe", "reduce_partial_gradients", lambda module, tp: 0),
    # Sequence parallelism with DeepSpeed's pipe-message partitioning (DeepSpeed #4196, Megatron-DeepSpeed #227).
    "pipe_partitioning": (
        "megatron_ds.training.builder",
        "deepspeed_config",
        type("StockPipeline", (), {"build": staticmethod(_build_with_pipe_partitioning)}),
    ),
}
"""Fix name -> (module, function the builder calls, its stock replacement)."""

FIXES = ("group_placeholders", "norm_marking", "counted_fp32_clip")
"""The three structural fixes (what `fixes: false` meant before; the preflight guard is separate)."""


@contextmanager
def unfixed(names: Iterable[str]) -> Iterator[None]:
    """Replace the named fixes' functions with their stock behaviour for the duration of the block."""
    saved = []
    try:
        for name in names:
            module_name, attr, replacement = UNFIXED[name]
            module = importlib.import_module(module_name)
            assert hasattr(module, attr), f"{module_name}.{attr} is gone; update megatron_ds.testing.defects"
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, replacement)
        yield
    finally:
        for module, attr, original in reversed(saved):
            setattr(module, attr, original)
