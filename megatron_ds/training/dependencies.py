"""Dependency releases a run refuses, checked before any process group exists.

setup.py bounds what pip installs (docs/training.md lists the releases tested); this catches an
environment that already holds a release known to train wrongly. The version is read from the
installed package's metadata (no import of DeepSpeed itself), or from `deepspeed.__version__`
when there is none (a source checkout on the path).
"""

from __future__ import annotations

import importlib.metadata
import re

from megatron_ds.config import Config
from megatron_ds.errors import ConfigError

PIPELINE_ACCUMULATION_BUG = ((0, 18, 3), (0, 19, 2))
"""DeepSpeed releases whose PipelineEngine divides by the gradient accumulation steps at every
stage's output hook, so each earlier stage's gradients are divided once more per stage behind it
(DeepSpeed issue #8152; fixed by PR #8154, released in 0.19.3)."""
FIXED_SPEC = "deepspeed>=0.19.8,<0.20"
"""What to install instead: setup.py's bounds (0.19.3-0.19.7 have the fix but fail activation
checkpointing on DeepSpeed's CPU accelerator; docs/training.md "Dependencies")."""


def deepspeed_version() -> str:
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        import deepspeed

        return deepspeed.__version__


def release(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a version string such as `0.19.2` or `0.19.2+8e2c9d0`; None if unreadable."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def check_deepspeed(config: Config, version: str | None = None) -> None:
    """Refuse a DeepSpeed release with the pipeline accumulation bug for a run it affects: more than
    one stage and more than one micro-batch per step (with one stage, or one micro-batch, the
    scaling is right in every release)."""
    version = version or deepspeed_version()
    found = release(version)
    low, high = PIPELINE_ACCUMULATION_BUG
    stages, micro_batches = config.parallel.pipeline_model_parallel_size, config.grad_accumulation_steps
    if found is None or not low <= found <= high or stages == 1 or micro_batches == 1:
        return
    raise ConfigError(
        f"DeepSpeed {version} scales pipeline gradients wrongly under gradient accumulation (every stage but "
        f"the last gets them divided by {micro_batches} once more per later stage; DeepSpeed issue #8152, fixed "
        f"by PR #8154 in 0.19.3), and this run has {stages} stages and {micro_batches} micro-batches per step: "
        f"pip install '{FIXED_SPEC}'"
    )
