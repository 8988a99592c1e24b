"""Megatron-style training lines and optional TensorBoard scalars."""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_ds.config import LoggingConfig


@dataclass
class StepStats:
    """What one log line reports (averaged over the log interval where that makes sense)."""

    iteration: int
    train_iters: int
    consumed_samples: int
    elapsed_ms: float
    learning_rate: float
    global_batch_size: int
    loss: float | None
    """Mean lm loss of the interval's iterations that updated the weights (Megatron's: skipped fp16 steps left
    out); None when every one was skipped (Megatron then prints no loss)."""
    grad_norm: float | None
    loss_scale: float | None
    tokens_per_second: float
    eta_s: float
    tflops_per_gpu: float | None = None
    """Model FLOPs per iteration / (iteration time x world size), in TFLOP/s (Megatron-LM's throughput)."""
    mfu: float | None = None
    """tflops_per_gpu / the device's peak, when the peak is known."""
    params_norm: float | None = None
    """L2 norm of all parameters (`--log-params-norm`)."""
    num_zeros: int | None = None
    """Zero elements of the last step's reduced gradients (`--log-num-zeros-in-grad`)."""
    curriculum_seq_length: int | None = None
    """The curriculum's sequence length of the last step (`curriculum_learning`)."""
    skipped_iterations: int = 0
    """Iterations of the interval whose update fp16's loss scaler skipped (an overflow)."""
    nan_iterations: int = 0
    """Of those, the ones whose loss was NaN or Inf (Megatron's count)."""
    other_losses: dict[str, float] = field(default_factory=dict)
    """Mean losses beside the lm loss over the same iterations (`moe loss` with experts, `kd loss` under --kd); with
    `kd loss` the line also gives their sum with the lm loss as `total loss` first, as Megatron-DeepSpeed's loss dict
    under --kd."""


@dataclass
class IterationStats:
    """One iteration's own values, which TensorBoard and wandb get every `--tensorboard-log-interval` iterations
    (Megatron's `training_log`: that iteration's loss, not the log window's mean)."""

    iteration: int
    learning_rate: float
    global_batch_size: int
    loss: float
    """The iteration's lm loss, written whether or not fp16's loss scaler skipped the update, as upstream."""
    grad_norm: float | None
    loss_scale: float | None
    params_norm: float | None = None
    num_zeros: int | None = None
    curriculum_seq_length: int | None = None
    other_losses: dict[str, float] = field(default_factory=dict)
    """The iteration's losses beside the lm loss (`moe loss`, `kd loss`), written as `lm-loss-training/<name>`."""


def throughput(
    model_flops: float, seconds_per_iteration: float, world_size: int, peak_tflops: float | None
) -> tuple[float, float | None]:
    """(TFLOP/s per GPU, MFU or None) as Megatron-LM's log line computes the first: the model's FLOPs
    of one iteration (`estimate.compute.model_flops_per_iteration`, no recomputation) over the
    iteration time and the number of GPUs."""
    tflops = model_flops / (seconds_per_iteration * world_size) / 1e12
    return tflops, (tflops / peak_tflops if peak_tflops else None)


def format_line(s: StepStats) -> str:
    """One line as Megatron prints it, plus MFU, tokens per second and an ETA."""
    parts = [
        f" iteration {s.iteration:8d}/{s.train_iters:8d}",
        f"consumed samples: {s.consumed_samples:12d}",
        f"elapsed time per iteration (ms): {s.elapsed_ms:.1f}",
    ]
    if s.tflops_per_gpu is not None:
        value = f"{s.tflops_per_gpu:.1f}" if s.tflops_per_gpu >= 10 else f"{s.tflops_per_gpu:.3g}"  # CPU runs: < 1
        parts.append(f"throughput per GPU (TFLOP/s/GPU): {value}")
    if s.mfu is not None:
        parts.append(f"MFU: {100 * s.mfu:.1f}%")
    parts += [
        f"learning rate: {s.learning_rate:.6E}",
        f"global batch size: {s.global_batch_size:5d}",
        *([] if s.loss is None else losses_text(s.loss, s.other_losses)),
        f"grad norm: {s.grad_norm:.6f}" if s.grad_norm is not None else "grad norm: n/a",
    ]
    if s.num_zeros is not None:
        parts.append(f"num zeros: {float(s.num_zeros):.1f}")
    if s.params_norm is not None:
        parts.append(f"params norm: {s.params_norm:.3f}")
    if s.curriculum_seq_length is not None:
        parts.append(f"curriculum seqlen: {s.curriculum_seq_length:5d}")
    if s.loss_scale is not None:
        parts.append(f"loss scale: {s.loss_scale:.1f}")
    parts.append(f"number of skipped iterations: {s.skipped_iterations:3d}")
    parts.append(f"number of nan iterations: {s.nan_iterations:3d}")
    parts.append(f"tokens per second: {s.tokens_per_second:.1f}")
    parts.append(f"ETA: {datetime.timedelta(seconds=int(max(0.0, s.eta_s)))}")
    return " | ".join(parts) + " |"


def losses_text(lm: float, others: dict[str, float]) -> list[str]:
    """`lm loss: ...` and each other loss (`moe loss`), as Megatron-DeepSpeed's loss dict; under --kd its `total loss`
    (the sum of them all) first."""
    total = [f"total loss: {lm + sum(others.values()):.6E}"] if {"kd loss", "mos loss"} & others.keys() else []
    return [*total, f"lm loss: {lm:.6E}", *(f"{k}: {v:.6E}" for k, v in others.items())]


def format_eval(name: str, iteration: int, loss: float) -> str:
    ppl = math.exp(min(20.0, loss))
    return f" {name} loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |"


class Scalars:
    """The scalars Megatron writes to TensorBoard, written by the last rank to `writer` (a SummaryWriter, or
    `scalar_writers.FanOut` in front of TensorBoard and wandb).

    As Megatron's `training_log`: each iteration's own values every `--tensorboard-log-interval` iterations
    (`iteration`; loss and grad norm always, learning rate and loss scale unless turned off, batch size and world
    size when asked for), the throughput and iteration time of the log window with the log line (`window`);
    validation perplexity, optimizer-state norms and memory when asked for.
    """

    def __init__(self, writer: Any, cfg: LoggingConfig, world_size: int = 1) -> None:
        self.cfg = cfg
        self.writer = writer
        self.world_size = world_size

    def iteration(self, s: IterationStats) -> None:
        w, i, c = self.writer, s.iteration, self.cfg
        w.add_scalar("lm-loss-training/lm loss", s.loss, i)
        for name, value in s.other_losses.items():
            w.add_scalar(f"lm-loss-training/{name}", value, i)
        if c.log_learning_rate_to_tensorboard:
            w.add_scalar("learning-rate/learning-rate", s.learning_rate, i)
        if c.log_batch_size_to_tensorboard:
            w.add_scalar("batch-size/batch-size", s.global_batch_size, i)
        if s.grad_norm is not None:
            w.add_scalar("grad-norm/grad-norm", s.grad_norm, i)
        if s.loss_scale is not None and c.log_loss_scale_to_tensorboard:
            w.add_scalar("loss-scale/loss-scale", s.loss_scale, i)
        if c.log_world_size_to_tensorboard:
            w.add_scalar("world-size/world-size", self.world_size, i)
        if s.num_zeros is not None:
            w.add_scalar("num-zeros/num-zeros", s.num_zeros, i)
        if s.params_norm is not None:
            w.add_scalar("params-norm/params-norm", s.params_norm, i)
        if s.curriculum_seq_length is not None:
            w.add_scalar("seqlen/curriculum_seqlen", s.curriculum_seq_length, i)

    def window(self, s: StepStats) -> None:
        """The log window's throughput and time per iteration, written with the log line (Megatron writes them
        every --log-interval)."""
        w, i = self.writer, s.iteration
        w.add_scalar("throughput/tokens-per-second", s.tokens_per_second, i)
        if s.tflops_per_gpu is not None:
            w.add_scalar("throughput/tflops-per-gpu", s.tflops_per_gpu, i)
        if self.cfg.log_timers_to_tensorboard:
            w.add_scalar("iteration-time/iteration-time-ms", s.elapsed_ms, i)

    def optimizer_states(self, engine: Any, iteration: int) -> None:
        """Norms of this rank's Adam moments and weights (`--log-optimizer-states-to-tensorboard`)."""
        if not self.cfg.log_optimizer_states_to_tensorboard:
            return
        for name, value in optimizer_state_norms(engine).items():
            self.writer.add_scalar(f"optimizer/{name}", value, iteration)

    def memory(self, mem: Any, iteration: int) -> None:
        """This rank's measured memory in MB (`--log-memory-to-tensorboard`)."""
        if not self.cfg.log_memory_to_tensorboard:
            return
        for name in ("params", "grads", "optimizer", "activations", "total"):
            value = getattr(mem, name, None)
            if value is not None:
                self.writer.add_scalar(f"memory/{name}-MB", value / 2**20, iteration)

    def eval(self, name: str, iteration: int, loss: float) -> None:
        self.writer.add_scalar(f"lm-loss-{name}/lm loss", loss, iteration)
        if self.cfg.log_validation_ppl_to_tensorboard:
            self.writer.add_scalar(f"lm-loss-{name}/lm loss ppl", math.exp(min(20.0, loss)), iteration)

    def close(self, failed: bool = False) -> None:
        """Flush and close; `failed` (training stopped on an error) marks a wandb run failed."""
        from megatron_ds.training.scalar_writers import FanOut

        self.writer.flush()
        if isinstance(self.writer, FanOut):
            self.writer.close(failed)
        else:
            self.writer.close()


def _innermost_optimizer(engine: Any) -> Any:
    """The torch optimizer under DeepSpeed's wrappers (ZeRO, bf16), which holds the Adam state."""
    opt = engine.optimizer
    while hasattr(opt, "optimizer") and not isinstance(opt, torch.optim.Optimizer):
        opt = opt.optimizer
    return opt


@torch.no_grad()
def optimizer_state_norms(engine: Any) -> dict[str, float]:
    """L2 and L1 norms of the Adam moments (momentum = exp_avg, variance = exp_avg_sq, and its
    square root) and of the weights they belong to, over what this rank's optimizer holds (its
    stage; its partition under ZeRO). Empty for optimizers without Adam moments (SGD)."""
    opt = _innermost_optimizer(engine)
    sums = {
        k: 0.0
        for k in (
            "momentum_l2",
            "momentum_l1",
            "variance_l2",
            "variance_l1",
            "variance_sqrt_l2",
            "variance_sqrt_l1",
            "weight_l2",
            "weight_l1",
        )
    }
    found = False
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p, {})
            if "exp_avg" not in state:
                continue
            found = True
            for name, t in (
                ("momentum", state["exp_avg"]),
                ("variance", state["exp_avg_sq"]),
                ("variance_sqrt", state["exp_avg_sq"].sqrt()),
                ("weight", p),
            ):
                t = t.detach().float()
                sums[f"{name}_l2"] += float(t.pow(2).sum())
                sums[f"{name}_l1"] += float(t.abs().sum())
    if not found:
        return {}
    return {k: math.sqrt(v) if k.endswith("_l2") else v for k, v in sums.items()}


def tensorboard_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


def loss_scale(engine: Any) -> float | None:
    """The dynamic loss scale under fp16 (None otherwise)."""
    if not engine.fp16_enabled():
        return None
    opt = engine.optimizer
    scale = getattr(opt, "cur_scale", None) or getattr(getattr(opt, "loss_scaler", None), "cur_scale", None)
    return float(scale) if scale is not None else None
