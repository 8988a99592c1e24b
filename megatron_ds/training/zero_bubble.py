"""ZB-H1 on DeepSpeed's pipeline engine: `ZeroBubbleEngine`, a `PipelineEngine` with two more
instructions, as Megatron-DeepSpeed's `--enable-zbh1-pipeline` extends it (its PR #396).

    BackwardOnlyPass(buffer)  DeepSpeed's own backward of the buffer's micro-batch, run with the
                              engine's `WeightGradStore` deferring: every linear layer returns its
                              input gradient and stores what its weight gradient needs
                              (`model/weight_grad.py`); norms, embeddings and biases get their
                              gradients as usual
    WeightPass                the oldest stored backward's weight gradients, added to `.grad`
                              (under bf16 through DeepSpeed's BF16_Optimizer, as its backward does:
                              low-precision gradients cleared, computed, added to the fp32 ones)
    SendActivation/SendGrad   DeepSpeed's own, with each `p2p.send` posted (`isend`) instead of
                              waited for; the posted sends are waited for when the schedule ends.
                              A blocking send would hold a stage until its peer's backward, which
                              costs ZB-H1 much of its gain (the schedule simulator shows it); the
                              receives stay DeepSpeed's blocking ones.

The schedule is `pipe_schedules.ZeroBubbleH1Schedule` (the registry's `zbh1` stream). Its weight
passes run in backward order, so every weight sees the gradients 1F1B gives it, summed in the
same order, before ReduceTiedGrads, ReduceGrads and the clipped optimizer step: the tied
embedding's all-reduce, ZeRO-1's reduction and the global norm see each gradient exactly once.
`adopt(engine)` turns a built `PipelineEngine` into this class (no attribute of DeepSpeed's changes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from deepspeed import comm as dist
from deepspeed.runtime.pipe import p2p
from deepspeed.runtime.pipe import schedule as ds
from deepspeed.runtime.pipe.engine import PipelineEngine

from megatron_ds.model.weight_grad import WeightGradStore
from megatron_ds.training import pipe_schedules


class PostedSends:
    """Sends posted without waiting (`isend`), each kept with its tensor until `wait_all`."""

    def __init__(self, grid: Any) -> None:
        self.grid = grid
        self.works: list[tuple[Any, torch.Tensor]] = []
        self.tag = 0
        """The tag of the sends posted now (the interleaved engine keeps its two directions apart)."""

    def send(self, tensor: torch.Tensor, dest_stage: int, async_op: bool = False) -> None:
        """`p2p.send`'s signature: post `tensor` to pipeline stage `dest_stage`."""
        self.works = [(w, t) for w, t in self.works if not w.is_completed()]
        tensor = tensor.contiguous()
        self.works.append((dist.isend(tensor, self.grid.stage_to_global(stage_id=dest_stage), tag=self.tag), tensor))

    @contextlib.contextmanager
    def replacing_p2p_send(self) -> Iterator[None]:
        """DeepSpeed's send instructions call `p2p.send`; inside, that posts instead."""
        original = p2p.send
        p2p.send = self.send
        try:
            yield
        finally:
            p2p.send = original

    def wait_all(self) -> None:
        for work, _ in self.works:
            work.wait()
        self.works = []


class ZeroBubbleEngine(PipelineEngine):
    """DeepSpeed's pipeline engine running ZB-H1 (module docstring); build it with `adopt`."""

    weight_grads: WeightGradStore
    posted: PostedSends

    def _train_schedule(self) -> ds.PipeSchedule:
        return pipe_schedules.ZeroBubbleH1Schedule(self.micro_batches, self.num_stages, self.stage_id)

    def _exec_schedule(self, pipe_schedule: ds.PipeSchedule) -> None:
        try:
            super()._exec_schedule(pipe_schedule)
        except BaseException:
            self.weight_grads.clear()
            raise
        finally:
            self.posted.wait_all()
        assert self.weight_grads.pending == 0, "weight passes left over at the end of a step"

    def _exec_backward_only_pass(self, buffer_id: int) -> None:
        # DeepSpeed receives every output gradient into one persistent buffer (`grad_layer`), and the
        # last linear of the stage stores that very tensor as its output gradient (a residual add
        # passes it on as it is): give the backward a copy, so the next receive cannot overwrite it.
        received = self.grad_layer
        if received is not None and not self.is_last_stage():
            self.grad_layer = received.clone() if torch.is_tensor(received) else [t.clone() for t in received]
        try:
            with self.weight_grads.deferring():
                PipelineEngine._exec_backward_pass(self, buffer_id)
        finally:
            self.grad_layer = received

    def _exec_weight_pass(self) -> None:
        bf16 = self.using_bf16_optimizer
        if bf16:  # as DeepSpeed's backward: the low-precision gradients start from zero ...
            self.optimizer.clear_lp_grads()
        self.weight_grads.run_oldest()
        if bf16:  # ... and are added to the fp32 ones after
            self.optimizer.update_hp_grads(clear_lp_grads=False)

    def _exec_send_activations(self, buffer_id: int) -> None:
        with self.posted.replacing_p2p_send():
            PipelineEngine._exec_send_activations(self, buffer_id)

    def _exec_send_grads(self, buffer_id: int) -> None:
        with self.posted.replacing_p2p_send():
            PipelineEngine._exec_send_grads(self, buffer_id)

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        pipe_schedules.BackwardOnlyPass: _exec_backward_only_pass,
        pipe_schedules.WeightPass: _exec_weight_pass,
        ds.SendActivation: _exec_send_activations,
        ds.SendGrad: _exec_send_grads,
    }


def adopt(engine: PipelineEngine) -> ZeroBubbleEngine:
    """Make a built `PipelineEngine` run ZB-H1 (before `stage_timers.install`, which wraps the
    class's instruction map)."""
    assert type(engine) is PipelineEngine, type(engine)
    assert "_INSTRUCTION_MAP" not in vars(engine), "adopt before installing the stage timers"
    engine.__class__ = ZeroBubbleEngine
    engine.weight_grads = WeightGradStore()
    engine.posted = PostedSends(engine.grid)
    return engine
