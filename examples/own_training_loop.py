#!/usr/bin/env python
"""Use megatron_ds's GPT pipeline in your own training script, with your own DeepSpeed engine.

    torchrun --nproc_per_node 3 examples/own_training_loop.py

Builds a small GPT whose first and last stages hold only the embedding and the LM head
(layout E|t*4|L on 3 stages), creates the engine with a hand-written DeepSpeed config and ZeRO-1,
and trains a few steps on random tokens. The two lines marked REQUIRED are what keeps a custom
loop from hanging: same optimizer groups on every stage, and the cross-stage structure check.
"""

from __future__ import annotations

import os

import deepspeed
import torch

from megatron_ds.config import Config, ModelConfig, ParallelConfig, RegularizationConfig, TrainingConfig
from megatron_ds.distributed import shutdown_distributed
from megatron_ds.model import GPTModelPipe, gpt_spec_groups
from megatron_ds.pipeline.layout import build_layout
from megatron_ds.training.optimizer import add_group_placeholders, param_groups
from megatron_ds.training.preflight import Watchdog, check_structure


def main() -> None:
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    world = int(os.environ["WORLD_SIZE"])
    model_cfg = ModelConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=256,
        seq_length=32,
        max_position_embeddings=32,
        vocab_size=256,
    )
    config = Config(
        model=model_cfg,
        regularization=RegularizationConfig(hidden_dropout=0.0, attention_dropout=0.0),
        parallel=ParallelConfig(pipeline_model_parallel_size=3, world_size=world),
        training=TrainingConfig(micro_batch_size=2, global_batch_size=4 * (world // 3), seed=7),
    )
    layout = build_layout(gpt_spec_groups(model_cfg), num_stages=3, dedicated="both")
    model = GPTModelPipe(config, layout)
    add_group_placeholders(model)  # REQUIRED: same optimizer groups on every stage
    optimizer = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=1e-3)
    check_structure(model, optimizer, config)  # REQUIRED: mismatches fail here, not as a hang
    ds_config = {
        "train_batch_size": config.training.global_batch_size,
        "train_micro_batch_size_per_gpu": config.training.micro_batch_size,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    watchdog = Watchdog(timeout_s=120, rank=engine.global_rank, stage=engine.stage_id)

    def batches():
        gen = torch.Generator().manual_seed(1234 + engine.grid.get_data_parallel_rank())
        while True:
            rows = torch.randint(0, model_cfg.vocab_size, (2, model_cfg.seq_length + 1), generator=gen)
            yield rows[:, :-1], (rows[:, 1:], torch.ones(2, model_cfg.seq_length))

    data = batches()
    for step in range(1, 6):
        with watchdog.watch(f"step {step}"):
            loss = engine.train_batch(data_iter=data)
        if engine.global_rank == 0:
            print(
                f"step {step} loss {loss.item():.4f} grad norm {float(engine.get_global_grad_norm()):.4f}", flush=True
            )
    shutdown_distributed()  # join gloo's threads before the interpreter exits (see megatron_ds.distributed)


if __name__ == "__main__":
    main()
