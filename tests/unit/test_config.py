"""The config tree validates itself: a Config built in Python gets the checks the flags get, with
the same one-line messages naming the flag; derived values cannot be set inconsistently; old
checkpoint configs still load."""

from __future__ import annotations

import dataclasses
import math

import pytest

import pretrain_gpt
from megatron_ds.config import (
    Config,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RegularizationConfig,
    TrainingConfig,
    padded_vocab_size,
)
from megatron_ds.errors import ConfigError
from megatron_ds.flags.parser import parse_config
from megatron_ds.testing.scenario import tiny_config

MODEL = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    seq_length=16,
    max_position_embeddings=16,
    vocab_size=128,
)
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
FLAGS += ["--vocab-size", "128", "--train-iters", "1", "--lr", "1e-3"]
NAN, INF = math.nan, math.inf


def raises(make, message: str) -> str:
    with pytest.raises(ConfigError) as err:
        make()
    text = str(err.value)
    assert message in text and "\n" not in text, text
    return text


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: ModelConfig(**{**MODEL, "hidden_size": 30}), "--hidden-size 30 is not divisible by --num-attention-"),
        (lambda: ModelConfig(**{**MODEL, "num_key_value_heads": 3}), "--num-key-value-heads 3 must divide"),
        (lambda: ModelConfig(**{**MODEL, "kv_channels": 0}), "--kv-channels 0 must be >= 1"),
        (lambda: ModelConfig(**{**MODEL, "seq_length": 32}), "--seq-length 32 exceeds --max-position-embeddings 16"),
        (lambda: ModelConfig(**{**MODEL, "num_layers": 0}), "--num-layers 0 must be >= 1"),
        (lambda: ModelConfig(**{**MODEL, "normalization": "batchnorm"}), "--normalization 'batchnorm' is not one of"),
        (lambda: ModelConfig(**{**MODEL, "layernorm_epsilon": NAN}), "--layernorm-epsilon nan is not a finite"),
        (lambda: RegularizationConfig(hidden_dropout=1.0), "--hidden-dropout 1.0 must be in [0, 1)"),
        (lambda: RegularizationConfig(attention_dropout=NAN), "--attention-dropout nan must be in [0, 1)"),
        (lambda: RegularizationConfig(init_method_std=0.0), "--init-method-std 0.0 must be > 0"),
        (lambda: RegularizationConfig(init_method_std=INF), "--init-method-std inf is not a finite number"),
        (lambda: OptimizerConfig(lr=NAN), "--lr nan is not a finite number"),
        (lambda: OptimizerConfig(lr=INF), "--lr inf is not a finite number"),
        (lambda: OptimizerConfig(lr=-1.0), "--lr -1.0 must be >= 0"),
        (lambda: OptimizerConfig(min_lr=NAN), "--min-lr nan is not a finite number"),
        (lambda: OptimizerConfig(lr=1e-4, min_lr=1e-3), "--min-lr 0.001 is above --lr 0.0001"),
        (lambda: OptimizerConfig(adam_beta1=1.0), "--adam-beta1 1.0 must be in [0, 1)"),
        (lambda: OptimizerConfig(adam_beta2=NAN), "--adam-beta2 nan must be in [0, 1)"),
        (lambda: OptimizerConfig(adam_eps=-1e-8), "--adam-eps -1e-08 must be >= 0"),
        (lambda: OptimizerConfig(weight_decay=INF), "--weight-decay inf is not a finite number"),
        (lambda: OptimizerConfig(clip_grad=NAN), "--clip-grad nan is not a finite number"),
        (lambda: OptimizerConfig(clip_grad=-1.0), "--clip-grad -1.0 must be >= 0 (0 disables clipping)"),
        (lambda: OptimizerConfig(lr_decay_style="step"), "--lr-decay-style 'step' is not one of"),
        (lambda: ParallelConfig(pipeline_model_parallel_size=2, world_size=5), "world size 5 is not divisible by"),
        (lambda: ParallelConfig(distributed_timeout_minutes=0), "--distributed-timeout-minutes 0 must be > 0"),
        (lambda: TrainingConfig(micro_batch_size=0), "--micro-batch-size 0 must be >= 1"),
        (lambda: TrainingConfig(global_batch_size=0), "--global-batch-size 0 must be >= 1"),
        (lambda: TrainingConfig(seed=0), "--seed 0 must be >= 1; give a positive seed, as Megatron-DeepSpeed"),
        (lambda: TrainingConfig(initial_loss_scale=3000.0), "--initial-loss-scale 3000.0 must be a power of 2"),
        (lambda: TrainingConfig(checkpoint_num_layers=0), "it must be >= 1"),
        (lambda: DataConfig(mock_data=True, data_path=["x"]), "--mock-data and --data-path were both given"),
        (lambda: DataConfig(mock_data=True, split="a,b,c"), "--split a,b,c: expected up to three"),  # mock data too
        (lambda: DataConfig(split="1,2,3,4"), "--split 1,2,3,4: expected up to three"),
    ],
)
def test_sections_refuse_bad_values(make, message: str) -> None:
    raises(make, message)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"parallel__tensor_model_parallel_size": 3}, "--num-attention-heads 4 is not divisible by --tensor-model-"),
        ({"parallel__world_size": 3, "training__global_batch_size": 8}, "--global-batch-size 8 is not divisible"),
        ({"training__micro_batch_size": 3}, "--global-batch-size 8 is not divisible by --micro-batch-size 3"),
    ],
)
def test_config_checks_cross_section_rules(overrides: dict, message: str) -> None:
    raises(lambda: tiny_config(**overrides), message)


def test_python_and_flags_give_the_same_message() -> None:
    flags = raises(lambda: parse_config([*FLAGS, "--hidden-size", "30"]), "--hidden-size 30")
    assert flags == raises(lambda: ModelConfig(**{**MODEL, "hidden_size": 30}), "--hidden-size 30")
    flags = raises(lambda: parse_config([*FLAGS, "--adam-beta2", "1.5"]), "--adam-beta2")
    assert flags == raises(lambda: OptimizerConfig(adam_beta2=1.5), "--adam-beta2")


def test_lr_nan_is_a_one_line_error_exit_2(capsys: pytest.CaptureFixture) -> None:
    assert pretrain_gpt.main([*FLAGS, "--lr", "nan", "--mock-data"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --lr nan is not a finite number; give a value >= 0\n"


def test_data_parallel_size_is_derived_from_the_world_size() -> None:
    par = ParallelConfig(pipeline_model_parallel_size=2, tensor_model_parallel_size=2, world_size=12)
    assert par.data_parallel_size == 3 and ParallelConfig().data_parallel_size == 1
    with pytest.raises(TypeError):
        ParallelConfig(data_parallel_size=2)  # not a field: nothing to disagree with the world size
    cfg = parse_config([*FLAGS, "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1"], world_size=6)[0]
    assert cfg.parallel.world_size == 6 and cfg.parallel.data_parallel_size == 3
    assert cfg.training.global_batch_size == 3 and cfg.grad_accumulation_steps == 1


def test_kv_heads_equal_to_heads_is_the_same_model() -> None:
    assert ModelConfig(**MODEL, num_key_value_heads=4) == ModelConfig(**MODEL)
    gqa = ModelConfig(**MODEL, num_key_value_heads=2)
    assert (gqa.kv_heads, gqa.head_dim, gqa.qkv_rows) == (2, 8, (4 + 2 * 2) * 8)
    assert dataclasses.replace(gqa, activation="swiglu").fc1_rows == 2 * 64


def test_kv_channels_set_the_head_size_and_its_default_is_one_spelling() -> None:
    assert ModelConfig(**MODEL, kv_channels=8) == ModelConfig(**MODEL)  # 32 / 4: stored as None
    wide = ModelConfig(**MODEL, num_key_value_heads=2, kv_channels=12)
    assert (wide.head_dim, wide.query_size, wide.qkv_rows) == (12, 4 * 12, (4 + 2 * 2) * 12)
    # Megatron-LM asks hidden / heads to be an integer only when it is the head size
    odd = ModelConfig(**{**MODEL, "hidden_size": 30}, kv_channels=8)
    assert (odd.head_dim, odd.query_size, odd.kv_channels) == (8, 32, 8)
    parsed = parse_config([*FLAGS, "--kv-channels", "12"], world_size=1)[0].model
    assert (parsed.kv_channels, parsed.head_dim) == (12, 12)
    stored = tiny_config().to_dict()
    del stored["model"]["kv_channels"]  # a checkpoint saved before the field existed
    assert Config.from_dict(stored) == tiny_config()


def test_padded_vocabulary_is_one_function() -> None:
    assert padded_vocab_size(50257, 128, 1) == 50304 and padded_vocab_size(50257, 128, 8) == 51200
    cfg = parse_config([*FLAGS[:-6], "--vocab-size", "50257", "--tensor-model-parallel-size", "4", *FLAGS[-4:]], 4)
    assert cfg[0].model.vocab_size == padded_vocab_size(50257, 128, 4)
    raises(lambda: padded_vocab_size(100, 0, 1), "--make-vocab-size-divisible-by 0 must be >= 1")


def test_the_json_form_round_trips_and_ignores_the_derived_size() -> None:
    """`to_dict` adds the derived data-parallel size for readers; `from_dict` ignores it (the world
    size is what is stored), and a field the dict lacks takes its default."""
    new = tiny_config(parallel__pipeline_model_parallel_size=2, parallel__world_size=4)
    stored = new.to_dict()
    assert stored["parallel"]["data_parallel_size"] == 2
    assert Config.from_dict(stored) == new
    stored["parallel"]["data_parallel_size"] = 99  # never read back
    assert Config.from_dict(stored) == new
    del stored["regularization"]
    assert Config.from_dict(stored).regularization == RegularizationConfig()
