"""Time each spec group once in this process, for `--pp-partition-method profile`.

`calibrate(model, b)` builds one copy of each group of our GPT (the pre group, one transformer
layer, the post group with the loss) in this process, at T = 1, and times one micro-batch's forward
and backward of each, and the optimizer step over its parameters (the gradient-norm clip and the
AdamW/SGD step with the kernel training uses, `model_states.OPTIMIZER_KERNEL`): the median of
`repeats` runs after `warmup` untimed ones. The numbers go down as a
`megatron_ds.estimate.measured_time.Calibration`, whose `stage_time_fn` turns them into stage times.

Clock: on CPU, this process's CPU time (`time.process_time`), the same clock the pipeline's stage
timers use for compute (`training/measure/stage_timers.py`): on a machine shared with other processes
(several ranks on a few cores) wall time counts the time a process waits for a core, CPU time
does not. On CUDA, wall time after `torch.cuda.synchronize()`.

Times are of this process on this device with its thread settings: calibrate where the run will
run (a GPU stage on a GPU, with the run's precision), not on a login node. `cached_calibration`
times once per process and set of inputs; `training/builder.py` has every rank adopt rank 0's
numbers, so all ranks build one layout.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch
from deepspeed.pipe import TiedLayerSpec

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.estimate.compute import ComputeInputs
from megatron_ds.estimate.measured_time import GROUPS, Calibration, GroupTiming, group_flops
from megatron_ds.estimate.model_states import optimizer_kernel_options
from megatron_ds.model import naming
from megatron_ds.model.gpt_pipe import build_layer_specs
from megatron_ds.model.layers import cross_entropy_loss

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

NO_DROPOUT = RegularizationConfig(hidden_dropout=0.0, attention_dropout=0.0)
"""Timing default: the flash kernel on CPU, as training without attention dropout runs."""


def clock(device: str) -> Callable[[], float]:
    """Seconds: process CPU time on CPU, synchronised wall time on CUDA (see the module docstring)."""
    if device == "cuda":

        def synchronized() -> float:
            torch.cuda.synchronize()
            return time.perf_counter()

        return synchronized
    return time.process_time


def _median_seconds(fn: Callable[[], object], repeats: int, warmup: int, now: Callable[[], float]) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = now()
        fn()
        samples.append(now() - start)
    return statistics.median(samples)


def _time_group(
    run: Callable[[], torch.Tensor], repeats: int, warmup: int, now: Callable[[], float]
) -> tuple[float, float]:
    """(forward, backward) seconds of `run` (returns a tensor; backward from a ones gradient)."""

    def backward_once() -> None:
        out = run()
        out.backward(torch.ones_like(out))

    forward = _median_seconds(lambda: run().detach(), repeats, warmup, now)
    both = _median_seconds(backward_once, repeats, warmup, now)
    return forward, max(both - forward, 0.0)


def _time_optimizer(params: list[torch.Tensor], device: str, repeats: int, warmup: int) -> float:
    """Seconds of clipping and stepping `params` (fresh fp32 copies with gradients, as DeepSpeed's
    wrappers step fp32 tensors) with the kernel training uses on `device`."""
    copies = [torch.nn.Parameter(p.detach().float().clone()) for p in params if p.numel()]
    if not copies:
        return 0.0
    for p in copies:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(copies, lr=1e-9, weight_decay=0.1, **optimizer_kernel_options(device))

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(copies, 1.0)
        opt.step()

    return _median_seconds(step, repeats, warmup, clock(device))


def calibrate(
    model: ModelConfig,
    micro_batch_size: int,
    repeats: int = 3,
    warmup: int = 1,
    seed: int = 1234,
    regularization: RegularizationConfig = NO_DROPOUT,
    device: str = "cpu",
    precision: str = "fp32",
) -> Calibration:
    """Time each group once in this process (T = 1) on `device` in `precision`. Pass the run's
    `regularization`: attention dropout changes which SDPA kernel runs (see estimate.compute)."""
    torch.manual_seed(seed)
    dtype, now = DTYPES[precision], clock(device)
    groups = naming.gpt_spec_groups(model)
    specs = build_layer_specs(model, regularization, seed)
    first_layer = len(groups.pre)
    first_post = first_layer + model.num_layers
    timed = set(range(first_layer + 1)) | set(range(first_post, len(specs)))  # one layer of the N
    modules = [_built(spec, device, dtype) if i in timed else None for i, spec in enumerate(specs)]
    embedding = modules[groups.pre.index(naming.WORD_EMBEDDING)]
    b, s, h, v = micro_batch_size, model.seq_length, model.hidden_size, model.vocab_size
    tokens = torch.randint(0, v, (b, s), device=device)
    labels = (torch.randint(0, v, (b, s), device=device), torch.ones(b, s, device=device))
    hidden = torch.randn(b, s, h, device=device, dtype=dtype, requires_grad=True)  # as a received activation

    def run_pre() -> torch.Tensor:
        x = tokens
        for module in modules[:first_layer]:
            x = module(x)
        return x

    def run_post() -> torch.Tensor:
        x = hidden
        for spec, module in zip(specs[first_post:], modules[first_post:]):
            fn = getattr(spec, "forward_fn", None)
            x = fn(embedding, x) if fn else module(x)
        return cross_entropy_loss(x, labels)

    layer = modules[first_layer]
    post = range(first_post, len(specs))
    tied = [i for i in post if isinstance(specs[i], TiedLayerSpec)]  # the head's copy of the embedding
    params = {
        "pre": _parameters(modules[:first_layer]),
        "layer": _parameters([layer]),
        "post": _parameters([modules[i] for i in post if i not in tied]),
    }
    totals = group_flops(ComputeInputs(model, micro_batch_size))
    runs = {"pre": run_pre, "layer": lambda: layer(hidden), "post": run_post}
    timings = []
    for name in GROUPS:
        fwd, bwd = _time_group(runs[name], repeats, warmup, now)
        opt = _time_optimizer(params[name], device, repeats, warmup)
        timings.append(GroupTiming(name, fwd, bwd, totals[name], opt))
    tied_copy = _time_optimizer(_parameters([modules[i] for i in tied]), device, repeats, warmup)
    return Calibration(micro_batch_size, tuple(timings), tied_copy)


def _built(spec: object, device: str, dtype: torch.dtype) -> Callable:
    """A LayerSpec built on `device` in `dtype`, or a plain function (a cast) as it is."""
    built = spec.build() if hasattr(spec, "build") else spec
    return built.to(device=device, dtype=dtype) if isinstance(built, torch.nn.Module) else built


@functools.lru_cache(maxsize=8)
def cached_calibration(
    model: ModelConfig, micro_batch_size: int, regularization: RegularizationConfig, device: str, precision: str
) -> Calibration:
    """`calibrate` once per process and inputs (validating the flags and building the run share it)."""
    return calibrate(
        model, micro_batch_size, repeats=5, warmup=2, regularization=regularization, device=device, precision=precision
    )


def _parameters(modules: list) -> list[torch.Tensor]:
    return [p for m in modules if isinstance(m, torch.nn.Module) for p in m.parameters()]
