"""Megatron's neutral values are no-ops (`declare.neutral`): the mixture-of-experts flags of the dense
scripts (`--num-experts 1`; `--ds-sequence-parallel-size 1` is Ulysses' default); any other value is one
line."""

from __future__ import annotations

import pytest

from megatron_ds import flags
from megatron_ds.errors import ConfigError
from megatron_ds.flags import compat
from megatron_ds.flags.parser import parse_config

BASE = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 128 --lr 1e-3"
BASE += " --train-iters 2 --mock-data"


def parse(*argv: str):
    return parse_config([*BASE.split(), *argv])[0]


NEUTRAL = [f for f in flags.FLAGS if f.only is not None]
TYPED_NO_OPS = [f for f in flags.FLAGS if f.status == flags.ACCEPTED and f.help.startswith("changes nothing here")]


@pytest.mark.parametrize("flag", NEUTRAL, ids=lambda f: f.name)
def test_neutral_values_change_nothing_and_others_are_refused(flag: flags.Flag) -> None:
    for value in flag.only:
        assert parse(flag.name, str(value)) == parse()
    other = "residual" if flag.type is None else "2"
    with pytest.raises(ConfigError) as err:
        parse(flag.name, other)
    assert str(err.value) == compat.neutral_message(flag, (flag.type or str)(other))
    assert str(err.value).startswith(f"{flag.name} {other} is not supported (only ")


@pytest.mark.parametrize("flag", TYPED_NO_OPS, ids=lambda f: f.name)
def test_typed_no_ops_change_nothing_and_check_their_type(flag: flags.Flag) -> None:
    assert parse(flag.name, "3") == parse()
    with pytest.raises(ConfigError, match=f"argument {flag.name}: invalid"):
        parse(flag.name, "many")


def test_the_dense_mixture_of_experts_flags_of_the_scripts_are_no_ops() -> None:
    line = "--num-experts 1 --moe-expert-parallel-size 1 --topk 1 --mlp-type standard --moe-train-capacity-factor 1.0"
    line += " --moe-eval-capacity-factor 1.0 --moe-min-capacity 4 --create-moe-param-group"
    line += " --disable-moe-token-dropping --ds-sequence-parallel-size 1"
    assert parse(*line.split()) == parse()


def test_load_optional_and_exit_on_missing_checkpoint_contradict() -> None:
    assert parse("--load-optional") == parse()
    with pytest.raises(ConfigError, match="--load-optional and --exit-on-missing-checkpoint were both given"):
        parse("--load-optional", "--exit-on-missing-checkpoint")
