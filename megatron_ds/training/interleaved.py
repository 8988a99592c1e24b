"""Interleaved 1F1B on DeepSpeed's pipeline engine: `InterleavedEngine`, a `PipelineEngine` whose
rank holds v model chunks (`model/gpt_chunks.py`), run by `pipe_schedules.InterleavedSchedule`
(torch.distributed.pipelining's per-rank order; every instruction names its chunk).

DeepSpeed's engine runs one stage per rank (DeepSpeed issue #4035). Its instructions are reused as
they are, each inside `_chunk(c)`, which makes the engine look like flat stage c x P + r for their
duration, as DeepSpeed's own DualPipeV engine does for its two phases:

  * the module exposes chunk c (`activate_chunk`), `is_first_stage()` / `is_last_stage()` mean flat
    stage 0 / the last flat stage (loads, the loss, the last stage's scaling), and `prev_stage` /
    `next_stage` are the ranks of the neighbouring flat stages (rank P - 1 feeds rank 0's next chunk);
  * DeepSpeed's sends are posted (`isend`, waited for when the schedule ends) and its receives are
    blocking, each with a tag per direction, so activations and gradients between the same two
    ranks (P = 2) never match each other; DeepSpeed's activation meta data goes once per rank pair,
    as each rank sends activations to one rank and receives them from one;
  * per buffer (chunk x M + micro-batch) the last stage keeps its loss and every received gradient
    until its backward, and each buffer is freed after its last use (DeepSpeed relies on reusing
    few slots).

Gradient reductions, the tied embedding's all-reduce, ZeRO, bf16 and the clipped optimizer step are
DeepSpeed's, unchanged: the rank's module holds every chunk's parameters. `adopt(engine)` turns a
built `PipelineEngine` over a `ChunkedGPTModelPipe` into this class.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from deepspeed import comm as dist
from deepspeed.runtime.pipe import p2p
from deepspeed.runtime.pipe import schedule as ds
from deepspeed.runtime.pipe.engine import PipelineEngine

from megatron_ds.estimate import schedule_streams
from megatron_ds.training import pipe_schedules
from megatron_ds.training.zero_bubble import PostedSends

ACTIVATION_TAG, GRADIENT_TAG = 11, 12
"""Point-to-point tags: the two directions between two ranks stay apart."""


class InterleavedEngine(PipelineEngine):
    """DeepSpeed's pipeline engine over v model chunks per rank (module docstring); build with `adopt`."""

    posted: PostedSends
    num_chunks: int
    _active: int | None

    # ---- where the engine is ----------------------------------------------------------------------

    def _flat(self) -> int:
        assert self._active is not None
        return self._active * self.num_stages + self.stage_id

    def is_first_stage(self) -> bool:
        if getattr(self, "_active", None) is None:  # outside instructions: the rank's pipeline place
            return super().is_first_stage()
        return self._flat() == 0

    def is_last_stage(self) -> bool:
        if getattr(self, "_active", None) is None:
            return super().is_last_stage()
        return self._flat() == self.num_chunks * self.num_stages - 1

    @contextlib.contextmanager
    def _chunk(self, chunk: int) -> Iterator[None]:
        p, s = self.num_stages, self.stage_id
        self._active = chunk
        self.module.activate_chunk(chunk)
        self.prev_stage, self.next_stage = (s - 1) % p, (s + 1) % p
        try:
            yield
        finally:
            self._active = None
            self.prev_stage, self.next_stage = s - 1, s + 1

    @contextlib.contextmanager
    def _p2p(self, tag: int) -> Iterator[None]:
        """DeepSpeed's `p2p.send` posted and its `p2p.recv` tagged, for the instruction inside."""
        grid = self.grid

        def recv(tensor: torch.Tensor, src_stage: int, async_op: bool = False) -> None:
            dist.recv(tensor, grid.stage_to_global(stage_id=src_stage), tag=tag)

        original = p2p.send, p2p.recv
        self.posted.tag = tag
        p2p.send, p2p.recv = self.posted.send, recv
        try:
            yield
        finally:
            p2p.send, p2p.recv = original

    # ---- the schedule -----------------------------------------------------------------------------

    def _train_schedule(self) -> ds.PipeSchedule:
        return pipe_schedules.InterleavedSchedule(self.micro_batches, self.num_stages, self.stage_id, self.num_chunks)

    def _inference_schedule(self, micro_batches: int) -> ds.PipeSchedule:
        return _ForwardOnlySchedule(micro_batches, self.num_stages, self.stage_id, self.num_chunks)

    def _exec_schedule(self, pipe_schedule: ds.PipeSchedule) -> None:
        try:
            super()._exec_schedule(pipe_schedule)
        finally:
            self.posted.wait_all()

    def reset_activation_shape(self) -> None:
        super().reset_activation_shape()
        self.first_output_send = True

    # ---- the instructions, per chunk --------------------------------------------------------------

    def _exec_load_micro_batch(self, buffer_id: int, chunk: int) -> None:
        with self._chunk(chunk):
            PipelineEngine._exec_load_micro_batch(self, buffer_id)

    def _exec_forward_pass(self, buffer_id: int, chunk: int) -> None:
        with self._chunk(chunk):
            PipelineEngine._exec_forward_pass(self, buffer_id)
            if self.is_last_stage() and torch.is_grad_enabled():
                self.pipe_buffers["losses"][buffer_id] = self.loss
            last = self.is_last_stage()
        if not torch.is_grad_enabled():  # evaluation: nothing needs the inputs again
            self.pipe_buffers["inputs"][buffer_id] = None
            self.pipe_buffers["labels"][buffer_id] = None
            if last:  # the loss is taken; nothing sends the output
                self.pipe_buffers["outputs"][buffer_id] = None

    def _exec_backward_pass(self, buffer_id: int, chunk: int) -> None:
        with self._chunk(chunk):
            if self.is_last_stage():
                self.loss = self.pipe_buffers["losses"][buffer_id]
            else:
                self.grad_layer = self.pipe_buffers["grads"][buffer_id]
            PipelineEngine._exec_backward_pass(self, buffer_id)
            first = self.is_first_stage()
        for key in ("outputs", "output_tensors", "losses", "grads", "labels"):
            self.pipe_buffers[key][buffer_id] = None
        if first:  # the first stage sends no gradient, which is what frees the inputs elsewhere
            self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_send_activations(self, buffer_id: int, chunk: int) -> None:
        with self._chunk(chunk), self._p2p(ACTIVATION_TAG):
            PipelineEngine._exec_send_activations(self, buffer_id)
        if not torch.is_grad_enabled():
            self.pipe_buffers["outputs"][buffer_id] = None

    def _exec_recv_activations(self, buffer_id: int, chunk: int) -> None:
        with self._chunk(chunk), self._p2p(ACTIVATION_TAG):
            PipelineEngine._exec_recv_activations(self, buffer_id)

    def _exec_send_grads(self, buffer_id: int, chunk: int) -> None:
        with self._chunk(chunk), self._p2p(GRADIENT_TAG):
            PipelineEngine._exec_send_grads(self, buffer_id)

    def _exec_recv_grads(self, buffer_id: int, chunk: int) -> None:
        with self._chunk(chunk), self._p2p(GRADIENT_TAG):
            PipelineEngine._exec_recv_grads(self, buffer_id)
            # DeepSpeed receives into one persistent buffer: a copy waits for the buffer's backward
            received = self.grad_layer
            self.pipe_buffers["grads"][buffer_id] = (
                received.clone() if torch.is_tensor(received) else [t.clone() for t in received]
            )

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        ds.LoadMicroBatch: _exec_load_micro_batch,
        ds.ForwardPass: _exec_forward_pass,
        ds.BackwardPass: _exec_backward_pass,
        ds.SendActivation: _exec_send_activations,
        ds.RecvActivation: _exec_recv_activations,
        ds.SendGrad: _exec_send_grads,
        ds.RecvGrad: _exec_recv_grads,
    }


class _ForwardOnlySchedule(pipe_schedules.InterleavedSchedule):
    """Evaluation: every chunk's forwards in order (chunk 0's micro-batches, then chunk 1's, ...)."""

    def stream(self) -> schedule_streams.Steps:
        m, p, r, v = self.micro_batches, self.stages, self.stage_id, self.entry.virtual_stages
        order = [("F", c, j) for c in range(v) for j in range(m)]
        return schedule_streams.place_interleaved(order, m, p, r, v)[:-1]  # no optimizer step


def adopt(engine: PipelineEngine) -> InterleavedEngine:
    """Make a built `PipelineEngine` over a `ChunkedGPTModelPipe` run interleaved 1F1B (before
    `stage_timers.install`, which wraps the class's instruction map)."""
    assert type(engine) is PipelineEngine, type(engine)
    assert "_INSTRUCTION_MAP" not in vars(engine), "adopt before installing the stage timers"
    assert not (engine.has_attention_mask or engine.has_bool_tensors), "boolean tensors are not sent here"
    engine.__class__ = InterleavedEngine
    engine.num_chunks = engine.module.num_chunks
    engine._active = None
    engine.posted = PostedSends(engine.grid)
    for key in ("losses", "grads"):  # reserved with the others, per buffer
        engine.pipe_buffers[key] = [None] * engine.num_pipe_buffers
    return engine
