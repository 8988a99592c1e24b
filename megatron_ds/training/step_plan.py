"""What each training step runs with: its global batch size (`--rampup-batch-size`,
`--step-batch-size-schedule`) and its sequence length (the `curriculum_learning` section), and the
engine set for them, as Megatron-DeepSpeed's `megatron/training.py` does:

- the batch size of the samples consumed so far goes to DeepSpeed (`set_train_batch_size`: the
  step runs that many micro-batches);
- the curriculum's length for step `iteration + 1` cuts every micro-batch of the step (tokens,
  labels and loss mask, as its `get_batch_pipe`), and the pipeline's activation shapes are reset
  (`reset_activation_shape`) whenever the length the engine last ran changes, evaluations (at
  full length) included;
- the learning-rate schedule is told the step's samples and tokens (`LRSchedule.set_next_step`).

Every rank computes the same from the config and the train state, so the stages agree.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from megatron_ds.config import Config
from megatron_ds.training.state import TrainState


@dataclass(frozen=True)
class StepSize:
    """What one training step consumes."""

    samples: int
    """Its global batch size."""
    seq_length: int
    """Tokens per sample after the curriculum's cut."""

    @property
    def tokens(self) -> int:
        return self.samples * self.seq_length


class StepPlan:
    """Sets `engine` for each step (see the module docstring)."""

    def __init__(self, config: Config, engine: Any) -> None:
        self.training, self.full_length = config.training, config.model.seq_length
        self.engine = engine
        self.length = self.full_length
        """The sequence length the batches are cut to now (full length outside training steps)."""
        self._shape = self.full_length  # what the engine's pipeline buffers were last sized for

    def before_step(self, state: TrainState) -> StepSize:
        size = self.size_of(state.iteration + 1, state.consumed_train_samples)
        if size.samples != self.engine.train_batch_size():
            self.engine.set_train_batch_size(size.samples)
        self._set_length(size.seq_length)
        scheduler = getattr(self.engine, "lr_scheduler", None)
        if hasattr(scheduler, "set_next_step"):
            scheduler.set_next_step(size.samples, size.tokens)
        return size

    def size_of(self, step: int, consumed_samples: int) -> StepSize:
        """The batch size and sequence length of training step `step` (1-based)."""
        return StepSize(
            self.training.batch_size_at(consumed_samples), self.training.seq_length_at(step, self.full_length)
        )

    def before_eval(self) -> None:
        """Evaluations run whole samples."""
        self._set_length(self.full_length)

    def _set_length(self, length: int) -> None:
        self.length = length
        if length != self._shape:
            self.engine.reset_activation_shape()
            self._shape = length

    def cut(self, batches: Iterator[Any] | None) -> Iterator[Any] | None:
        """`batches` with every micro-batch cut to the current length (as each is drawn), and watched
        for masked tokens under `--calculate-per-token-loss`."""
        if batches is not None and self.training.curriculum is not None:
            batches = self._cut(batches)
        if batches is not None and self.training.calculate_per_token_loss:
            batches = self._watch_masks(batches)
        return batches

    def _watch_masks(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Megatron-LM's per-token loss equals the mean of micro-batch means when every micro-batch
        counts all its tokens; say so once if one does not (megatron-core pads a sample it cannot fill)."""
        warned = False
        for batch in batches:
            loss_mask = batch[1][1]
            if not warned and not bool(loss_mask.bool().all()):
                warned = True
                print(
                    f"WARNING: --calculate-per-token-loss: a micro-batch of {loss_mask.numel()} tokens masks "
                    f"{int((loss_mask == 0).sum())} out of the loss; its step averages micro-batch means, not "
                    f"every token as Megatron-LM does (said once)",
                    flush=True,
                )
            yield batch

    def _cut(self, batches: Iterator[Any]) -> Iterator[Any]:
        for inputs, (labels, loss_mask) in batches:
            n = self.length
            if n < labels.shape[1]:  # the tokens, or packed documents' (tokens, position_ids, document_ids)
                inputs = (
                    tuple(t[:, :n].contiguous() for t in inputs)
                    if isinstance(inputs, tuple)
                    else inputs[:, :n].contiguous()
                )
                labels, loss_mask = (t[:, :n].contiguous() for t in (labels, loss_mask))
            yield inputs, (labels, loss_mask)
