"""Megatron-style training lines and optional TensorBoard scalars."""
from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class StepStats:
    """What one log line reports (averaged over the log interval where that makes sense)."""

    iteration: int
    train_iters: int
    consumed_samples: int
    elapsed_ms: float
    learning_rate: float
    global_batch_size: int
    loss: float
    grad_norm: Optional[float]
    loss_scale: Optional[float]
    tokens_per_second: float
    eta_s: float


def format_line(s: StepStats) -> str:
    """One line as Megatron prints it, plus tokens per second and an ETA."""
    parts = [
        f" iteration {s.iteration:8d}/{s.train_iters:8d}",
        f"consumed samples: {s.consumed_samples:12d}",
        f"elapsed time per iteration (ms): {s.elapsed_ms:.1f}",
        f"learning rate: {s.learning_rate:.6E}",
        f"global batch size: {s.global_batch_size:5d}",
        f"lm loss: {s.loss:.6E}",
        f"grad norm: {s.grad_norm:.6f}" if s.grad_norm is not None else "grad norm: n/a",
    ]
    if s.loss_scale is not None:
        parts.append(f"loss scale: {s.loss_scale:.1f}")
    parts.append(f"tokens per second: {s.tokens_per_second:.1f}")
    parts.append(f"ETA: {datetime.timedelta(seconds=int(max(0.0, s.eta_s)))}")
    return " | ".join(parts) + " |"


def format_eval(name: str, iteration: int, loss: float) -> str:
    ppl = math.exp(min(20.0, loss))
    return f" {name} loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |"


class TensorBoard:
    """Scalars to `--tensorboard-dir` (one writer, on the last rank, as Megatron does)."""

    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir)

    def step(self, s: StepStats) -> None:
        w, i = self.writer, s.iteration
        w.add_scalar("lm-loss-training/lm loss", s.loss, i)
        w.add_scalar("learning-rate/learning-rate", s.learning_rate, i)
        w.add_scalar("batch-size/batch-size", s.global_batch_size, i)
        w.add_scalar("throughput/tokens-per-second", s.tokens_per_second, i)
        if s.grad_norm is not None:
            w.add_scalar("grad-norm/grad-norm", s.grad_norm, i)
        if s.loss_scale is not None:
            w.add_scalar("loss-scale/loss-scale", s.loss_scale, i)

    def eval(self, name: str, iteration: int, loss: float) -> None:
        self.writer.add_scalar(f"lm-loss-{name}/lm loss", loss, iteration)
        self.writer.add_scalar(f"lm-loss-{name}/lm loss ppl", math.exp(min(20.0, loss)), iteration)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


def tensorboard_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


def loss_scale(engine: Any) -> Optional[float]:
    """The dynamic loss scale under fp16 (None otherwise)."""
    if not engine.fp16_enabled():
        return None
    opt = engine.optimizer
    scale = getattr(opt, "cur_scale", None) or getattr(getattr(opt, "loss_scaler", None), "cur_scale", None)
    return float(scale) if scale is not None else None
