"""Weights-only checkpoints (Hugging Face imports) load without flags; only weight-shaping fields must match."""

from __future__ import annotations

import pytest

from megatron_ds.flags.parser import parse_config
from megatron_ds.training.checkpoint.directory import CheckpointError
from megatron_ds.training.checkpoint.rules import architecture_mismatch, check_compatible, deepspeed_cannot_restore

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", "128"]
RUN = ["--train-iters", "1", "--lr", "1e-3", "--world-size", "1"]


def _meta(argv: list[str], weights_only: bool) -> dict:
    config, _ = parse_config([*BASE, *RUN, *argv])
    return {"config": config.to_dict(), "weights_only": weights_only}


def test_fields_that_shape_no_weight_may_change() -> None:
    now, _ = parse_config([*BASE, *RUN, "--seq-length", "16", "--hidden-dropout", "0.0"])
    saved = ["--seq-length", "64", "--max-position-embeddings", "64", "--hidden-dropout", "0.1"]
    assert architecture_mismatch(_meta(saved, weights_only=True), now) == [
        "max_position_embeddings 64 (checkpoint) vs 16 (now)"
    ]
    full = architecture_mismatch(_meta(saved, weights_only=False), now)
    assert {m.split()[0] for m in full} == {"max_position_embeddings"}  # a learned table; dropout: not architecture


def test_bf16_without_zero_loads_weights_only_and_whole_checkpoints() -> None:
    """DeepSpeed's BF16_Optimizer cannot read its own state back: a whole-state resume goes through
    the universal form instead of being refused."""
    now, _ = parse_config([*BASE, *RUN, "--seq-length", "16", "--bf16"])
    check_compatible(_meta(["--seq-length", "16", "--bf16"], weights_only=True), now, "d", "global_step0")
    check_compatible(_meta(["--seq-length", "16", "--bf16"], weights_only=False), now, "d", "global_step1")
    assert deepspeed_cannot_restore(now)
    with pytest.raises(CheckpointError, match="another architecture"):
        check_compatible(_meta(["--seq-length", "32", "--bf16"], weights_only=False), now, "d", "global_step1")
