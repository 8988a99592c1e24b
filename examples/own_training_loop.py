#!/usr/bin/env python
"""Train megatron_ds's GPT pipeline from your own loop, with your own optimizer.

    torchrun --nproc_per_node 3 examples/own_training_loop.py

A small GPT on 3 pipeline stages whose first and last hold only the embedding and the LM head
(layout E|t*4|L), ZeRO-1, trained a few steps on random tokens. `megatron_ds.build_pipeline`
generates the DeepSpeed JSON from the config and keeps every invariant that stops a pipeline from
hanging or clipping with a wrong norm (docs/training.md); leaving the `with` block destroys the
process groups, and `run_and_exit` ends the process without finalising the interpreter (DeepSpeed's
engine keeps gloo worker threads alive that would otherwise abort the rank at exit).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

import megatron_ds
from megatron_ds.config import (
    Config,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RegularizationConfig,
    TrainingConfig,
)

STAGES = 3


def make_config(world_size: int) -> Config:
    replicas = world_size // STAGES  # data-parallel copies of the pipeline
    return Config(
        model=ModelConfig(
            num_layers=4,
            hidden_size=64,
            num_attention_heads=4,
            ffn_hidden_size=256,
            seq_length=32,
            max_position_embeddings=32,
            vocab_size=256,
        ),
        regularization=RegularizationConfig(hidden_dropout=0.0, attention_dropout=0.0),
        parallel=ParallelConfig(
            pipeline_model_parallel_size=STAGES,
            world_size=world_size,
            pp_dedicated_embedding_stages="both",
            distributed_timeout_minutes=2,  # the step watchdog's limit too
        ),
        optimizer=OptimizerConfig(weight_decay=0.1, clip_grad=1.0),
        training=TrainingConfig(micro_batch_size=2, global_batch_size=4 * replicas, zero_stage=1, seed=7),
    )


def random_batches(config: Config, data_parallel_rank: int) -> Iterator[tuple]:
    """Micro-batches as the pipeline takes them: (tokens, (labels, loss_mask))."""
    m, mbs = config.model, config.training.micro_batch_size
    gen = torch.Generator().manual_seed(1234 + data_parallel_rank)
    while True:
        rows = torch.randint(0, m.vocab_size, (mbs, m.seq_length + 1), generator=gen)
        yield rows[:, :-1], (rows[:, 1:], torch.ones(mbs, m.seq_length))


def main() -> None:
    config = make_config(int(os.environ.get("WORLD_SIZE", "1")))
    # Any optimizer built from the parameter groups the builder prepares (the same on every stage).
    with megatron_ds.build_pipeline(config, optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-3)) as pipe:
        data = random_batches(config, pipe.engine.grid.get_data_parallel_rank())
        for step in range(1, 6):
            loss = pipe.train_batch(data)
            if pipe.engine.global_rank == 0:
                print(f"step {step} loss {loss.item():.4f} grad norm {pipe.grad_norm():.4f}", flush=True)
        loss = pipe.eval_batch(data)  # forward only, also under the watchdog
        if pipe.engine.global_rank == 0:
            print(f"eval loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    from megatron_ds.distributed import run_and_exit

    run_and_exit(main)
