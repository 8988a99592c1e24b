"""Where the logging rank's scalars go: TensorBoard (`--tensorboard-dir`) and Weights & Biases (`--wandb-project`).
`logger.Scalars` decides which scalars are written and under which tags; both destinations get the same ones, as
Megatron-DeepSpeed writes each scalar to both (`interop_tool_logger`) and Megatron-LM beside TensorBoard's.

wandb runs as Megatron starts it: `wandb.init` on the last rank with the project, the run's name, its directory
(`--wandb-save-dir`, else `<--save>/wandb`) and the run's configuration (here the config tree), and each scalar
is `log({tag: value}, step=iteration)`. wandb's own settings (`WANDB_MODE=offline`, `WANDB_API_KEY`) apply.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import Any

from megatron_ds.config import Config


class WandbWriter:
    """The SummaryWriter calls `logger.Scalars` makes, as calls on a wandb run."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.run.log({tag: value}, step=step)

    def flush(self) -> None:
        """wandb sends in the background; `close` waits for it."""

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)  # a stopped run shows as failed in wandb


class FanOut:
    """One writer in front of several."""

    def __init__(self, writers: Sequence[Any]) -> None:
        self.writers = list(writers)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        for w in self.writers:
            w.add_scalar(tag, value, step)

    def flush(self) -> None:
        for w in self.writers:
            w.flush()

    def close(self, failed: bool = False) -> None:
        """Close every writer, even if one fails to (the first failure is raised after)."""
        errors: list[BaseException] = []
        for w in self.writers:
            try:
                w.close(failed) if isinstance(w, WandbWriter) else w.close()
            except Exception as exc:  # noqa: BLE001 - raised below, once the others are closed
                errors.append(exc)
        if errors:
            raise errors[0]


def wandb_available() -> bool:
    return importlib.util.find_spec("wandb") is not None


def wandb_directory(config: Config) -> str | None:
    """`--wandb-save-dir`, else `<--save>/wandb` (Megatron's default), else None (wandb's own default)."""
    if config.logging.wandb_save_dir:
        return config.logging.wandb_save_dir
    return os.path.join(config.checkpoint.save, "wandb") if config.checkpoint.save else None


def open_wandb(config: Config) -> WandbWriter:
    import wandb

    directory = wandb_directory(config)
    if directory:
        os.makedirs(directory, exist_ok=True)
    lg = config.logging
    run = wandb.init(
        project=lg.wandb_project, name=lg.wandb_exp_name, entity=lg.wandb_entity, dir=directory, config=config.to_dict()
    )
    return WandbWriter(run)


def asked_for(config: Config) -> bool:
    """Whether the run writes scalars (`--tensorboard-dir` or `--wandb-project`): every rank knows it, so every rank
    joins the collectives of the values the logging rank writes."""
    return bool(config.logging.tensorboard_dir or config.logging.wandb_project)


def open_writers(config: Config) -> FanOut | None:
    """The logging rank's writers for this run's flags, or None when neither is asked for."""
    lg = config.logging
    if not asked_for(config):
        return None
    writers: list[Any] = []
    if lg.tensorboard_dir:
        from torch.utils.tensorboard import SummaryWriter

        writers.append(SummaryWriter(log_dir=lg.tensorboard_dir, max_queue=lg.tensorboard_queue_size))
    if lg.wandb_project:
        writers.append(open_wandb(config))
    return FanOut(writers) if writers else None
