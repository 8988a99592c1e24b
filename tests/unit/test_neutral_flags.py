"""Settings that change nothing: the mixture-of-experts flags of the dense scripts (`--num-experts 1`;
`--ds-sequence-parallel-size 1` is Ulysses' default) give the dense config."""

from __future__ import annotations

import pytest

from megatron_ds.errors import ConfigError
from megatron_ds.flags.parser import parse_config

BASE = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 128 --lr 1e-3"
BASE += " --train-iters 2 --mock-data"


def parse(*argv: str):
    return parse_config([*BASE.split(), *argv])[0]


def test_the_dense_mixture_of_experts_flags_of_the_scripts_are_no_ops() -> None:
    line = "--num-experts 1 --moe-expert-parallel-size 1 --topk 1 --mlp-type standard --moe-train-capacity-factor 1.0"
    line += " --moe-eval-capacity-factor 1.0 --moe-min-capacity 4 --create-moe-param-group"
    line += " --disable-moe-token-dropping --ds-sequence-parallel-size 1"
    assert parse(*line.split()) == parse()


def test_load_optional_and_exit_on_missing_checkpoint_contradict() -> None:
    assert parse("--load-optional") == parse()
    with pytest.raises(ConfigError, match="--load-optional and --exit-on-missing-checkpoint were both given"):
        parse("--load-optional", "--exit-on-missing-checkpoint")
