"""What the merged DeepSpeed JSON may say about ZeRO, checked before any process starts.

The flags (`--zero-stage`, `--offload-optimizer`, `--cpu-optimizer`, `--offload-param`) decide the
optimizer this run builds, the engine it runs on and what the memory model counts, so the JSON a user
file adds may not move them elsewhere: a user file's offload device that the flags do not give is
an error naming the flag that gives it (never silently taken). NVMe offload needs its directory to
exist and be writable.
"""

from __future__ import annotations

import os
from typing import Any

from megatron_ds.config import Config
from megatron_ds.errors import UserError


class ZeroConfigError(UserError):
    """The DeepSpeed JSON's ZeRO section contradicts the flags, or names an unusable NVMe path."""


_FLAGS = {"offload_optimizer": "--offload-optimizer", "offload_param": "--offload-param"}


def check_zero_json(config: Config, ds: dict[str, Any]) -> None:
    """The offload devices of the merged JSON are the config's; the NVMe directory is usable."""
    t = config.training
    zero = ds.get("zero_optimization") or {}
    ours = {"offload_optimizer": t.optimizer_offload, "offload_param": t.offload_param}
    for key, flag in _FLAGS.items():
        device = str((zero.get(key) or {}).get("device", "none"))
        if device != ours[key]:
            raise ZeroConfigError(
                f"the DeepSpeed JSON sets zero_optimization.{key}.device={device!r} but the flags give "
                f"{ours[key]!r}; give {flag} {device} (the flags decide the optimizer and the memory model) or "
                f"remove {key} from --deepspeed_config"
            )
        if device == "nvme":
            _check_nvme_path(str((zero.get(key) or {}).get("nvme_path") or ""), key)


def _check_nvme_path(path: str, key: str) -> None:
    if not os.path.isdir(path):
        raise ZeroConfigError(
            f"--offload-nvme-path {path}: not a directory ({key} to nvme swaps its tensors into files there); "
            f"give a directory on a local NVMe drive"
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise ZeroConfigError(f"--offload-nvme-path {path}: not writable; give a directory this user can write")
