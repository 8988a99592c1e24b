"""On resume only the architecture (and, for the whole state, the global batch and the optimizer) must
match the checkpoint; dropout and init std may change with a notice, the parallel layout freely
(the end-to-end runs are in tests/e2e/test_pretrain_gpt.py and tests/dist/test_universal_resume.py)."""

from __future__ import annotations

import pytest

from megatron_ds.testing.scenario import tiny_config
from megatron_ds.training.checkpoint import rules
from megatron_ds.training.checkpoint.directory import CheckpointError

SAVED = tiny_config(regularization__hidden_dropout=0.1, regularization__attention_dropout=0.1)


def meta(config) -> dict:
    return {"config": config.to_dict(), "layout": "E|tttt|L", "world_size": 1, "format": 1}


def test_another_dropout_and_init_std_resume_with_a_notice() -> None:
    now = SAVED.replace(regularization__hidden_dropout=0.0, regularization__init_method_std=0.01)
    rules.check_compatible(meta(SAVED), now, "ckpt", "global_step6")  # no error
    assert rules.architecture_mismatch(meta(SAVED), now) == []
    assert rules.regularization_notice(meta(SAVED), now, "ckpt", "global_step6") == (
        "NOTICE: --load ckpt (global_step6): regularization differs from the checkpoint's: "
        "hidden_dropout 0.1 -> 0.0; init_method_std 0.02 -> 0.01"
    )
    assert rules.regularization_notice(meta(SAVED), SAVED, "ckpt", "global_step6") is None


def test_fields_that_shape_no_weight_change_with_a_notice() -> None:
    # Megatron does not compare them: fine-tuning (or resuming) at another context length or rope base was refused as
    # "another architecture", also under --finetune
    rotary = SAVED.replace(
        model__use_rotary_position_embeddings=True,
        model__add_position_embedding=False,
        model__max_position_embeddings=32,
    )
    now = rotary.replace(model__seq_length=8, model__rotary_base=500000.0, model__max_position_embeddings=64)
    for run in (now, now.replace(checkpoint__finetune=True)):
        rules.check_compatible(meta(rotary), run, "ckpt", "global_step6")  # no error
    assert rules.weight_free_notice(meta(rotary), now, "ckpt", "global_step6") == (
        "NOTICE: --load ckpt (global_step6): seq_length 16 -> 8; rotary_base 10000.0 -> 500000.0; "
        "max_position_embeddings 32 -> 64: these shape no weight, so the checkpoint loads and trains on with the new values (Megatron does not "
        "compare them)"
    )
    assert rules.weight_free_notice(meta(rotary), rotary, "ckpt", "global_step6") is None
    learned = SAVED.replace(model__max_position_embeddings=64)  # a position table of another size: a weight's shape
    assert rules.architecture_mismatch(meta(SAVED), learned) == ["max_position_embeddings 16 (checkpoint) vs 64 (now)"]


def test_another_hidden_size_is_still_refused() -> None:
    now = SAVED.replace(model__hidden_size=64, regularization__hidden_dropout=0.0)
    with pytest.raises(CheckpointError) as err:
        rules.check_compatible(meta(SAVED), now, "ckpt", "global_step6")
    assert "another architecture: hidden_size 32 (checkpoint) vs 64 (now);" in str(err.value)
    assert "dropout" not in str(err.value)


def test_another_parallel_layout_is_a_topology_change_not_an_error() -> None:
    from megatron_ds.estimate.machine import CPU
    from megatron_ds.estimate.run_layout import build_run_layout

    now = SAVED.replace(parallel__tensor_model_parallel_size=2, parallel__world_size=2, training__zero_stage=1)
    rules.check_compatible(meta(SAVED), now, "ckpt", "t")  # no error: resharded on load
    changes = rules.topology_changes(meta(SAVED), now, build_run_layout(now, CPU), 2)
    assert changes == [
        "layout E|tttt|L vs Et*4L",
        "world size 1 vs 2",
        "tensor_model_parallel_size 1 vs 2",
        "zero stage 0 vs 1",
    ]


def test_another_global_batch_or_optimizer_is_refused_for_the_whole_state_only() -> None:
    bigger = SAVED.replace(training__global_batch_size=16)
    with pytest.raises(CheckpointError) as err:
        rules.check_compatible(meta(SAVED), bigger, "ckpt", "t")
    assert "trained with --global-batch-size 8, this run uses 16" in str(err.value) and "\n" not in str(err.value)
    rules.check_compatible(meta(SAVED), bigger.replace(checkpoint__finetune=True), "ckpt", "t")
    sgd = SAVED.replace(optimizer__optimizer="sgd")
    with pytest.raises(CheckpointError, match="holds adam's optimizer state, this run uses --optimizer sgd"):
        rules.check_compatible(meta(SAVED), sgd, "ckpt", "t")
    rules.check_compatible(meta(SAVED), sgd.replace(checkpoint__no_load_optim=True), "ckpt", "t")


def test_a_padded_vocabulary_that_moves_with_t_names_the_fix() -> None:
    at_t2 = SAVED.replace(model__vocab_size=256, parallel__tensor_model_parallel_size=2, parallel__world_size=2)
    with pytest.raises(CheckpointError) as err:
        rules.check_compatible(meta(at_t2), SAVED, "ckpt", "t")
    assert "vocab_size 256 (checkpoint) vs 128 (now)" in str(err.value)
    assert "choose --make-vocab-size-divisible-by so that the padded size stays 256" in str(err.value)


def test_a_vocabulary_change_inside_the_padding_is_a_notice() -> None:
    # 128 tokens trained, this run calls 8 of those rows padding: same 128 rows, so it resumed without a word
    saved = SAVED.replace(data__unpadded_vocab_size=128)
    now = SAVED.replace(data__unpadded_vocab_size=120)
    rules.check_compatible(meta(saved), now, "ckpt", "t")  # no error: the same rows
    assert rules.vocabulary_notice(meta(saved), now, "ckpt", "t") == (
        f"NOTICE: --load ckpt (t) recorded a vocabulary of 128 tokens, this run 120 (both padded to {now.model.vocab_size} "
        "rows): rows 120-127 change between token and padding, and later exports keep 120"
    )
    assert rules.vocabulary_notice(meta(saved), saved, "ckpt", "t") is None
