"""Megatron-LM's mixture-of-experts flags (`flags/megatron_lm_moe.py`): its Mixtral line's flags choose Megatron-LM's
top-k router with Megatron-LM's defaults, Megatron-DeepSpeed's lines keep DeepSpeed's gates, a line mixing the two
families or asking for what is not built is one line, and a checkpoint's router comes back through
`--use-checkpoint-args`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megatron_ds.config import Config
from megatron_ds.errors import ConfigError
from megatron_ds.flags import megatron_lm_moe
from megatron_ds.flags.declare import REFUSED
from megatron_ds.flags.parser import parse_config

BASE = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--vocab-size", "128", "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--num-experts", "8",
    "--disable-bias-linear",
]  # fmt: skip
MIXTRAL_EXAMPLE = (
    "--moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm "
    "--moe-token-dispatcher-type alltoall --expert-model-parallel-size 2"
).split()
"""MOE_ARGS of Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh (core_v0.16.1), at EP 2."""


def parse(*argv: str, world_size: int = 2) -> Config:
    return parse_config([*BASE, *argv], world_size=world_size)[0]


def error(*argv: str) -> str:
    with pytest.raises(ConfigError) as err:
        parse(*argv)
    assert "\n" not in str(err.value)
    return str(err.value)


def routing(config: Config) -> tuple:
    m = config.model
    return m.moe_router, m.moe_top_k, m.moe_loss_coeff, m.expert_interval, m.moe_token_dropping


def test_megatron_lms_mixtral_line_is_its_top_k_router_every_token_routed() -> None:
    config = parse(*MIXTRAL_EXAMPLE)
    assert routing(config) == ("megatron", 2, 0.01, 1, False)
    assert config.parallel.expert_parallel_size == 2 and not config.model.moe_top2_2nd_expert_sampling


def test_megatron_lms_defaults_come_with_its_router_and_megatron_deepspeeds_with_its_gates() -> None:
    assert routing(parse("--moe-grouped-gemm")) == ("megatron", 2, 0.0, 1, False)  # Megatron-LM's defaults
    assert routing(parse("--moe-router-topk", "5")) == ("megatron", 5, 0.0, 1, False)
    assert routing(parse("--moe-aux-loss-coeff", "0.1", "--moe-router-load-balancing-type", "none"))[2] == 0.0
    assert routing(parse()) == ("deepspeed", 1, 0.1, 2, True)  # Megatron-DeepSpeed's
    assert routing(parse("--topk", "2", "--expert-interval", "1", "--moe-loss-coeff", "0.01")) == (
        "deepspeed", 2, 0.01, 1, True,
    )  # fmt: skip
    assert parse("--moe-expert-parallel-size", "2").parallel.expert_parallel_size == 2
    assert not parse("--moe-router-topk", "2").model.moe_router_pre_softmax
    pre = parse("--moe-router-pre-softmax").model  # Qwen2-MoE's router: Megatron-LM's, its defaults
    assert (pre.moe_router, pre.moe_top_k, pre.moe_router_pre_softmax) == ("megatron", 2, True)


@pytest.mark.parametrize(
    "theirs",
    ["--topk 2", "--expert-interval 1", "--moe-loss-coeff 0.01", "--moe-train-capacity-factor 2",
     "--moe-eval-capacity-factor 2", "--moe-min-capacity 1", "--disable-moe-token-dropping",
     "--disable-moe-top2-2nd-expert-sampling", "--mlp-type residual"],
)  # fmt: skip
def test_a_line_mixing_the_two_routers_flags_is_refused(theirs: str) -> None:
    assert error("--moe-router-topk", "2", *theirs.split()) == (
        f"{theirs.split()[0]} (Megatron-DeepSpeed's, for DeepSpeed's gates) with --moe-router-topk (Megatron-LM's, "
        "for its top-k router): they route differently; keep one family of flags"
    )


@pytest.mark.parametrize("flag", [f for f in megatron_lm_moe.MIXTURE_OF_EXPERTS if f.status == REFUSED])
def test_what_megatron_lm_computes_that_is_not_built_is_refused_naming_the_flag(flag) -> None:
    argv = [flag.name] + (["1"] if flag.takes_value else [])
    assert error(*argv).startswith(f"{flag.name} is not supported: Megatron-LM's flag: ")


@pytest.mark.parametrize(
    "freq,interval",
    [("1", 1), ("[1]*4", 1), ("([0]+[1])*2", 2), ("[0,0,0,1]", 4)],
)
def test_moe_layer_freq_places_experts_as_an_interval_does(freq: str, interval: int) -> None:
    config = parse("--moe-layer-freq", freq)
    assert config.model.expert_interval == interval
    assert config.model.experts_per_layer == tuple(8 if i % interval == 0 else 1 for i in range(1, 5))


@pytest.mark.parametrize(
    "freq,problem",
    [
        ("2", "--moe-layer-freq 2: Megatron-LM puts experts on layers 1, 3, ... (from 1), which is not built; use 1, "
         "or a pattern that ends each group of layers with experts, e.g. ([0]*1+[1])*2"),
        ("[1,0,1,0]", "--moe-layer-freq [1,0,1,0] gives [1, 0, 1, 0]: only experts on every N-th layer"),
        ("[0,1,1,1]", "--moe-layer-freq [0,1,1,1] gives [0, 1, 1, 1]"),
        ("[1]*3", "--moe-layer-freq [1]*3 gives [1, 1, 1]"),
        ("__import__('os')", "--moe-layer-freq __import__('os') must be an integer or a list pattern"),
        ("[__import__('os')]", "--moe-layer-freq [__import__('os')] is not a list expression"),
    ],
)  # fmt: skip
def test_a_layer_pattern_no_interval_gives_is_one_line(freq: str, problem: str) -> None:
    assert error("--moe-layer-freq", freq).startswith(problem)


def test_sizes_and_kinds_not_built_are_one_line() -> None:
    assert error("--moe-router-load-balancing-type", "sinkhorn").startswith(
        "--moe-router-load-balancing-type sinkhorn is not supported: only the GShard/Switch aux_loss is built"
    )
    assert error("--moe-router-score-function", "sigmoid").startswith("--moe-router-score-function sigmoid is not")
    # experts on every layer: the dense --ffn-hidden-size shapes no tensor, the experts' size is the FFN size
    assert parse("--moe-ffn-hidden-size", "64", "--ffn-hidden-size", "96").model.ffn_hidden_size == 64
    assert error("--moe-ffn-hidden-size", "64", "--ffn-hidden-size", "96", "--moe-layer-freq", "([0]+[1])*2") == (
        "--moe-ffn-hidden-size 64 differs from the FFN size 96: each expert here is the MLP's width; give the experts' "
        "size as --ffn-hidden-size"
    )
    assert parse("--moe-ffn-hidden-size", "128").model.ffn_hidden_size == 128  # 4h, the default: the same
    assert error("--expert-tensor-parallel-size", "2").startswith("--expert-tensor-parallel-size 2 is not supported")
    assert error("--expert-model-parallel-size", "2", "--moe-expert-parallel-size", "4").startswith(
        "--expert-model-parallel-size 2 with --moe-expert-parallel-size 4: the same size by two names"
    )
    assert error("--moe-router-topk", "9").startswith(
        "--moe-router-topk 9 sends each token to 9 experts, but a layer has 8"
    )
    assert error("--moe-aux-loss-coeff", "-1") == "--moe-aux-loss-coeff -1 must be >= 0"


def test_what_differs_from_megatron_lm_is_printed(capsys: pytest.CaptureFixture) -> None:
    parse(*MIXTRAL_EXAMPLE, "--bf16")
    out = capsys.readouterr().out
    assert "Megatron-LM's router computes its logits in bf16 unless --moe-router-dtype fp32" in out
    parse(*MIXTRAL_EXAMPLE, "--bf16", "--moe-router-dtype", "fp32")
    assert "--moe-router-dtype" not in capsys.readouterr().out
    parse("--topk", "2", "--bf16")
    assert "NOTICE" not in capsys.readouterr().out


def test_top_1_without_pre_softmax_trains_with_a_notice_megatron_core_refuses_it(capsys: pytest.CaptureFixture) -> None:
    """megatron-core's TransformerConfig refuses topk 1 without pre-softmax (every weight would be 1); a Hugging Face
    Mixtral at num_experts_per_tok 1 means exactly that, so it trains, with a notice naming the fix."""
    model = parse("--moe-router-topk", "1").model
    assert (model.moe_router, model.moe_top_k, model.moe_router_pre_softmax) == ("megatron", 1, False)
    out = capsys.readouterr().out
    assert "NOTICE: --moe-router-topk 1 without --moe-router-pre-softmax: megatron-core refuses this combination" in out
    assert "add --moe-router-pre-softmax" in out
    for argv in (["--moe-router-topk", "1", "--moe-router-pre-softmax"], ["--moe-router-topk", "2"], ["--topk", "1"]):
        parse(*argv)
        assert "--moe-router-topk 1 without" not in capsys.readouterr().out, argv


@pytest.mark.parametrize(
    "layers,freq", [(4, []), (5, ["--moe-layer-freq", "([0]+[1])*2+[0]"]), (4, ["--moe-router-pre-softmax"])]
)
def test_use_checkpoint_args_takes_the_router_and_its_flags(tmp_path: Path, layers: int, freq: list[str]) -> None:
    base = ["--num-layers", str(layers), *BASE[2:]]
    saved = parse_config([*base, "--moe-router-topk", "3", "--moe-aux-loss-coeff", "0.02", *freq], world_size=1)[0]
    (tmp_path / "global_step0").mkdir()
    body = {"config": saved.to_dict(), "train_state": {}, "layout": "", "world_size": 1, "format": 1}
    (tmp_path / "global_step0" / "megatron_ds.json").write_text(json.dumps(body))
    (tmp_path / "latest").write_text("global_step0")
    train = ["--lr", "1e-3", "--train-iters", "2", "--mock-data"]
    again = parse_config(["--use-checkpoint-args", "--load", str(tmp_path), *train], world_size=1)[0].model
    assert again == saved.model and routing(dataclasses.replace(saved, model=again))[:3] == ("megatron", 3, 0.02)
    ours = parse_config([*base, "--topk", "2"], world_size=1)[0]
    body["config"] = ours.to_dict()
    (tmp_path / "global_step0" / "megatron_ds.json").write_text(json.dumps(body))
    assert parse_config(["--use-checkpoint-args", "--load", str(tmp_path), *train], world_size=1)[0].model == ours.model


def test_megatron_lms_router_with_biases_is_refused_and_a_dense_model_ignores_its_flags() -> None:
    """megatron-core's router learns a bias with --add-bias-linear (Megatron-LM's default); DeepSpeed's gate has none.
    Without --num-experts Megatron-LM ignores its MoE flags, as here."""
    biased = [a for a in BASE if a != "--disable-bias-linear"]
    with pytest.raises(ConfigError, match=r"--moe-router-topk \(Megatron-LM's router\) with biases on: .* add "
                       r"--disable-bias-linear"):  # fmt: skip
        parse_config([*biased, "--moe-router-topk", "2"], world_size=2)
    assert routing(parse_config([*biased, "--topk", "2"], world_size=2)[0])[0] == "deepspeed"  # DeepSpeed's gates
    dense = [a for a in BASE if a not in ("--num-experts", "8")]
    model = parse_config([*dense, "--moe-ffn-hidden-size", "64", "--moe-layer-freq", "2"], world_size=1)[0].model
    assert not model.is_moe


def test_the_load_balancing_lists_take_one_entry_as_megatron_lm_reads_one() -> None:
    """Megatron-LM takes a list of types and one coefficient each (one entry read as the value); several are not built,
    and a refused type is refused inside a list too."""
    config = parse("--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.02")
    assert routing(config)[2] == 0.02
    assert error("--moe-aux-loss-coeff", "0.01", "0.02").startswith(
        "--moe-aux-loss-coeff 0.01 0.02: several load-balancing losses together are not built"
    )
    assert error("--moe-router-load-balancing-type", "aux_loss", "sinkhorn").startswith(
        "--moe-router-load-balancing-type sinkhorn is not supported"
    )


def test_an_error_names_the_expert_parallel_flag_as_given() -> None:
    """Megatron-LM's Mixtral line at 8 ranks (P 4, EP 8: data-parallel size 2) names its own flag."""
    assert error("--expert-model-parallel-size", "4").startswith("--expert-model-parallel-size 4 does not divide")
    assert error("--moe-expert-parallel-size", "4").startswith("--moe-expert-parallel-size 4 does not divide")
