"""On resume only the architecture must match the checkpoint; dropout and init std may change, with a
notice (the end-to-end run is in tests/e2e/test_pretrain_gpt.py)."""

from __future__ import annotations

import pytest

from megatron_ds.testing.scenario import tiny_config
from megatron_ds.training import checkpoint

SAVED = tiny_config(regularization__hidden_dropout=0.1, regularization__attention_dropout=0.1)


def meta(config) -> dict:
    return {"config": config.to_dict(), "layout": "E|tttt|L", "world_size": 1, "format": 1}


def test_another_dropout_and_init_std_resume_with_a_notice() -> None:
    now = SAVED.replace(regularization__hidden_dropout=0.0, regularization__init_method_std=0.01)
    checkpoint.check_compatible(meta(SAVED), now, "ckpt", "global_step6")  # no error
    assert checkpoint.architecture_mismatch(meta(SAVED), now) == []
    assert checkpoint.regularization_notice(meta(SAVED), now, "ckpt", "global_step6") == (
        "NOTICE: --load ckpt (global_step6): regularization differs from the checkpoint's: "
        "hidden_dropout 0.1 -> 0.0; init_method_std 0.02 -> 0.01"
    )
    assert checkpoint.regularization_notice(meta(SAVED), SAVED, "ckpt", "global_step6") is None


def test_another_hidden_size_is_still_refused() -> None:
    now = SAVED.replace(model__hidden_size=64, regularization__hidden_dropout=0.0)
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.check_compatible(meta(SAVED), now, "ckpt", "global_step6")
    assert "another architecture: hidden_size 32 (checkpoint) vs 64 (now);" in str(err.value)
    assert "dropout" not in str(err.value)


def test_a_checkpoint_from_before_the_split_compares_its_dropout_as_regularization() -> None:
    old = meta(SAVED)
    old["config"]["model"].update(old["config"].pop("regularization"))  # dropout and init std in `model`
    now = SAVED.replace(regularization__attention_dropout=0.0)
    checkpoint.check_compatible(old, now, "ckpt", "t")
    assert "attention_dropout 0.1 -> 0.0" in checkpoint.regularization_notice(old, now, "ckpt", "t")
