"""`--deterministic-mode` (`training/determinism.py`): the environment check and what `apply` sets. A run under it:
tests/e2e/test_pretrain_gpt.py."""

from __future__ import annotations

import pytest
import torch

from megatron_ds.errors import ConfigError
from megatron_ds.training import determinism


@pytest.mark.parametrize(
    "env, named",
    [
        ({"NCCL_ALGO": "Tree"}, "NCCL_ALGO='Tree': its reduction order is not fixed"),
        ({"NCCL_ALGO": "Ring,Tree"}, "NCCL_ALGO='Ring,Tree'"),
        ({"NCCL_ALGO": ""}, "NCCL_ALGO=''"),
        ({"CUBLAS_WORKSPACE_CONFIG": ":0:0"}, "CUBLAS_WORKSPACE_CONFIG=':0:0': not a deterministic cuBLAS workspace"),
    ],
)
def test_a_non_deterministic_environment_is_one_line(env: dict, named: str) -> None:
    with pytest.raises(ConfigError) as err:
        determinism.check_environment(env)
    assert str(err.value).startswith(f"--deterministic-mode with {named}") and "\n" not in str(err.value)


def test_apply_keeps_the_launchers_deterministic_values_and_fills_the_rest() -> None:
    before = torch.are_deterministic_algorithms_enabled()
    try:
        env = {"NCCL_ALGO": "CollnetDirect,^NVLS"}
        determinism.apply(env)
        assert env == {"NCCL_ALGO": "CollnetDirect,^NVLS", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
        assert torch.are_deterministic_algorithms_enabled()
        empty: dict = {}
        determinism.apply(empty)
        assert empty == {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # Megatron-LM's values
    finally:
        torch.use_deterministic_algorithms(before)
