"""Megatron-LM's `--deterministic-mode`: a rerun of the same job gives bit-identical results on GPUs.

Before any process group or kernel (NCCL and cuBLAS read their environment when they start), the environment is
checked and completed as Megatron-LM does: `NCCL_ALGO` Ring (a reduction order that does not depend on the
topology; a launcher's own value must name only the algorithms Megatron-LM accepts) and `CUBLAS_WORKSPACE_CONFIG`
`:4096:8` (one of the two workspace settings NVIDIA documents as deterministic). Then
`torch.use_deterministic_algorithms(True)`: an operation that has no deterministic kernel raises instead of
running. Transformer Engine's switch, which Megatron-LM also sets, has nothing to act on here.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from megatron_ds.errors import ConfigError

NCCL_ALGOS = ("Ring", "CollnetDirect", "CollnetChain", "^NVLS")
"""`NCCL_ALGO` tokens Megatron-LM accepts as deterministic (megatron/training/determinism.py)."""
CUBLAS_WORKSPACES = (":4096:8", ":16:8")
DEFAULTS = {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def check_environment(env: MutableMapping[str, str]) -> None:
    """A one-line ConfigError when the launcher set a non-deterministic NCCL algorithm or cuBLAS workspace."""
    algo = env.get("NCCL_ALGO")
    if algo is not None:
        tokens = [t.strip() for t in algo.split(",") if t.strip()]
        if not tokens or any(t not in NCCL_ALGOS for t in tokens):
            raise ConfigError(
                f"--deterministic-mode with NCCL_ALGO={algo!r}: its reduction order is not fixed; set NCCL_ALGO to "
                f"{' or '.join(NCCL_ALGOS)} (a comma-separated subset), or unset it for Ring"
            )
    workspace = env.get("CUBLAS_WORKSPACE_CONFIG")
    if workspace is not None and workspace not in CUBLAS_WORKSPACES:
        raise ConfigError(
            f"--deterministic-mode with CUBLAS_WORKSPACE_CONFIG={workspace!r}: not a deterministic cuBLAS workspace; "
            f"set {' or '.join(CUBLAS_WORKSPACES)}, or unset it for {DEFAULTS['CUBLAS_WORKSPACE_CONFIG']}"
        )


def apply(env: MutableMapping[str, str] = os.environ) -> None:
    """Check `env`, fill in the defaults it lacks, and make torch choose deterministic kernels only."""
    import torch

    check_environment(env)
    for name, value in DEFAULTS.items():
        env.setdefault(name, value)
    torch.use_deterministic_algorithms(True)
