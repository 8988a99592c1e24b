"""Megatron-DeepSpeed flag compatibility: the declarations in megatron_ds/flags are what the parser does,
docs/compatibility.md shows the table drawn from them, and the flags with new meaning here map onto the config tree."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_ds import flags
from megatron_ds.config.tree import SECTIONS
from megatron_ds.flags import compat
from megatron_ds.flags.declare import field_default
from megatron_ds.flags.parser import ConfigError, _Refused, build_parser, parse_config
from megatron_ds.testing.scenario import tiny_config
from megatron_ds.training import deepspeed_config as dsc
from megatron_ds.training import logger

ROOT = Path(__file__).resolve().parents[2]
BASE = [
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--vocab-size",
    "128",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    "10",
    "--lr",
    "1e-3",
]
LLAMA_FLAGS = {
    "--swiglu": [],
    "--use-rotary-position-embeddings": [],
    "--num-key-value-heads": ["2"],
    "--no-position-embedding": [],
    "--disable-bias-linear": [],
    "--normalization": ["rmsnorm"],
    "--untie-embeddings-and-output-weights": [],
}
REFUSED_VALUES = [(f, r.value) for f in flags.FLAGS for r in f.refused_values]


def parse(*argv: str, world_size: int = 1):
    return parse_config([*BASE, *argv], world_size=world_size)[0]


def sample_values(flag: flags.Flag) -> list[str]:
    return [] if flag.nargs == flags.SWITCH else ["1"]


def test_every_declared_flag_is_registered_as_declared() -> None:
    actions = build_parser()._option_string_actions
    for f in flags.FLAGS:
        for name in (f.name, *f.aliases):
            assert name in actions, f"{name} is declared but not in the parser"
            assert isinstance(actions[name], _Refused) == (f.status == flags.REFUSED), name
            assert actions[name].dest == f.attr
    declared = {n for f in flags.FLAGS for n in (f.name, *f.aliases)}
    assert set(actions) - {"-h", "--help"} == declared  # nothing is added to the parser by hand


@pytest.mark.parametrize("flag", [f for f in flags.FLAGS if f.status == flags.NO_OP], ids=lambda f: f.name)
def test_no_op_flags_parse_and_change_nothing(flag: flags.Flag) -> None:
    assert parse(flag.name, *sample_values(flag)) == parse()


@pytest.mark.parametrize("flag", [f for f in flags.FLAGS if f.status == flags.REFUSED], ids=lambda f: f.name)
def test_refused_flags_give_their_reason(flag: flags.Flag) -> None:
    with pytest.raises(ConfigError) as err:
        parse(flag.name, *sample_values(flag))
    assert str(err.value) == compat.refusal_message(flag.name)
    assert str(err.value).startswith(f"{flag.name} is not supported: ") and "\n" not in str(err.value)


def test_several_refused_flags_are_named_together_before_unknown_ones() -> None:
    with pytest.raises(ConfigError) as err:
        parse("--random-ltd", "--foo", "--fp8-format", "hybrid")
    assert str(err.value) == (f"{compat.refusal_message('--random-ltd')} | {compat.refusal_message('--fp8-format')}")
    with pytest.raises(ConfigError, match="unrecognized arguments: --foo"):
        parse("--foo")


@pytest.mark.parametrize("flag,value", REFUSED_VALUES, ids=lambda x: getattr(x, "name", x))
def test_refused_values_give_their_reason(flag: flags.Flag, value: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(flag.name, value)
    assert str(err.value) == compat.refusal_message(flag.name, value)


@pytest.mark.parametrize("name", LLAMA_FLAGS)
def test_llama_options_are_accepted_and_change_the_model(name: str) -> None:
    assert flags.BY_NAME[name].status == flags.ACCEPTED
    assert parse(name, *LLAMA_FLAGS[name]).model != parse().model


@pytest.mark.parametrize(
    "alias, spelling",
    [
        ("--use-flash-attn-v1", "--use-flash-attn"),  # Megatron-DeepSpeed declares both as one flag
        ("--override-opt-param-scheduler", "--override-opt_param-scheduler"),  # Megatron-LM's current spellings
        ("--use-checkpoint-opt-param-scheduler", "--use-checkpoint-opt_param-scheduler"),
    ],
)
def test_upstream_aliases_mean_their_flag(alias: str, spelling: str) -> None:
    assert flags.BY_NAME[alias] is flags.BY_NAME[spelling]
    args = parse_config([*BASE, alias])[1]
    assert getattr(args, flags.BY_NAME[spelling].attr) == getattr(
        parse_config([*BASE, spelling])[1], flags.BY_NAME[spelling].attr
    )
    assert parse(alias) == parse(spelling)


def test_every_megatron_deepspeed_option_is_declared() -> None:
    """README: every Megatron-DeepSpeed flag is accepted, a no-op or refused with the reason, none "unrecognized":
    the options of its arguments.py and DeepSpeed's add_config_arguments (tools/capture_megatron_deepspeed_flags.py)."""
    upstream = json.loads((ROOT / "tests" / "data" / "megatron_deepspeed_flags.json").read_text())
    options = {name for names in upstream["groups"].values() for name in names}
    assert len(options) > 300 and "--train-data-exact-num-epochs" in options and "--deepscale" in options
    missing = sorted(options - set(flags.BY_NAME))
    assert not missing, f"declare these Megatron-DeepSpeed {upstream['commit']} flags in megatron_ds/flags: {missing}"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--train-data-exact-num-epochs", "2"], "--train-data-exact-num-epochs is not supported: makes the training"),
        (["--train-shuffle-idx-path", "x.npy"], "--train-shuffle-idx-path is not supported: reads the training split"),
        (["--use-dataset-only", "True"], "--use-dataset-only is not supported: Megatron-DeepSpeed then builds only"),
    ],
)
def test_megatron_deepspeed_data_and_training_flags_that_change_its_run_are_refused(argv, message) -> None:
    with pytest.raises(ConfigError) as err:
        parse(*argv)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_megatron_deepspeed_flags_its_gpt_never_reads_change_nothing() -> None:
    ignored = ["--return-data-index", "--train-idx-path", "x", "--mask-prob", "0.2", "--force-ds-sequence-parallel"]
    ignored += ["--img-h", "32", "--retro-encoder-layers", "3", "--num-experts-teacher", "4", "8"]
    assert parse(*ignored) == parse()
    assert parse("--profile").logging.profile is True  # Megatron-LM's switch, still bare


def test_aml_data_download_path_joins_each_data_prefix_as_megatron_deepspeed() -> None:
    assert parse("--data-path", "a/b_text_document", "--aml-data-download-path", "/mnt/d").data.data_path == (
        "/mnt/d/a/b_text_document",
    )
    with pytest.raises(ConfigError, match=r"--aml-data-download-path /mnt with the weighted --data-path 0.3 a 0.7 b: "):
        parse("--data-path", "0.3", "a", "0.7", "b", "--aml-data-download-path", "/mnt")


def test_no_flag_is_pending() -> None:
    assert {f.status for f in flags.FLAGS} == {flags.ACCEPTED, flags.NO_OP, flags.REFUSED}
    assert "not yet" not in compat.markdown_table() and not hasattr(compat, "PENDING_MODEL_FIELDS")


def test_docs_table_is_generated_from_the_declarations() -> None:
    doc = (ROOT / "docs" / "compatibility.md").read_text()
    block = re.search(r"<!-- compat-table:begin -->\n(.*?)<!-- compat-table:end -->", doc, re.S)
    assert block, "docs/compatibility.md lacks the compat-table markers"
    assert block.group(1) == compat.markdown_table(), (
        "docs/compatibility.md's table is stale: paste `python -m megatron_ds.flags.compat` between the markers"
    )


def test_table_rows_name_each_megatron_flag_once_with_its_status() -> None:
    rows = compat.markdown_table().splitlines()[2:]
    megatron = [f for f in flags.FLAGS if f.megatron]
    assert len(rows) == len(megatron)
    for f, row in zip(megatron, rows):
        assert f"| `{f.name}` | {f.status} |" in row


def test_every_config_field_is_set_by_a_flag() -> None:
    declared = {path for f in flags.FLAGS if f.status == flags.ACCEPTED for path in f.fields}
    tree = {f"{sec}.{f.name}" for sec, klass in SECTIONS.items() for f in dataclasses.fields(klass)}
    assert declared == tree


def test_copied_flags_default_to_their_config_field() -> None:
    for f in flags.FLAGS:
        if f.fields and not f.derived and f.resolved_default() is not None:
            assert f.resolved_default() == field_default(f.fields[0]), f.name


@pytest.mark.parametrize(
    "flag",
    [f for f in flags.FLAGS if f.status == flags.ACCEPTED and f.is_switch and f.fields and not f.derived],
    ids=lambda f: f.name,
)
def test_copied_switches_set_their_field(flag: flags.Flag) -> None:
    section, name = flag.fields[0].split(".")
    needs = SWITCH_NEEDS.get(flag.name, ())
    assert getattr(getattr(parse(flag.name, *needs), section), name) == flag.const


SWITCH_NEEDS = {
    "--cpu-optimizer": ("--zero-stage", "1"),
    "--use-rope-scaling": ("--use-rotary-position-embeddings",),
    "--add-qkv-bias": ("--disable-bias-linear",),
    "--kd": ("--load-teacher", "teacher"),
    "--mos": ("--load-teacher", "teacher"),
    "--create-moe-param-group": ("--num-experts", "2"),
    "--disable-moe-token-dropping": ("--num-experts", "2"),
    "--disable-moe-top2-2nd-expert-sampling": ("--num-experts", "2"),
}
"""Switches that are an error (CPU Adam runs in ZeRO's offloaded optimizer; --kd needs its teacher) or ignored (RoPE
scaling scales rotary embeddings; a QKV bias alone is implied by the linear biases; the MoE switches in a dense model)
without another flag."""


def test_help_lists_every_partition_method_and_the_config_fields() -> None:
    text = " ".join(build_parser().format_help().split())
    from megatron_ds.pipeline.methods import REGISTRY

    help_text = text.rsplit("--pp-partition-method PP_PARTITION_METHOD", 1)[1].split("[sets", 1)[0]
    syntaxes = [m.syntax for m in REGISTRY.values()]
    assert {"uniform", "parameters", "memory"} <= set(syntaxes)
    for method in (*syntaxes, "auto"):
        assert method in help_text
    assert "--pp-layout PP_LAYOUT" in text and "or auto:" in text
    assert "dropout on attention probabilities (default: 0.1) [sets regularization.attention_dropout]" in text
    assert "--random-ltd" not in text.split("usage:", 1)[1].split("options:", 1)[1]  # refused: hidden


# Flags whose meaning is a mapping onto our config tree.


def test_recompute_flags_map_onto_activation_checkpointing() -> None:
    t = parse(
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"
    ).training
    assert t.checkpoint_activations and t.checkpoint_num_layers == 2
    t = parse("--checkpoint-activations").training
    assert t.checkpoint_activations and t.checkpoint_num_layers == 1
    t = parse("--activations-checkpoint-method", "uniform", "--activations-checkpoint-num-layers", "2").training
    assert t.checkpoint_activations and t.checkpoint_num_layers == 2
    t = parse(
        "--checkpoint-activations",
        "--checkpoint-num-layers",
        "2",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
    ).training
    assert t.checkpoint_num_layers == 2
    assert not parse().training.checkpoint_activations


def test_checkpoint_activations_chunks_by_checkpoint_num_layers_alone(capsys: pytest.CaptureFixture) -> None:
    # Megatron-DeepSpeed's GPTModelPipe: --checkpoint-activations takes --checkpoint-num-layers (default 1) and leaves
    # --recompute-num-layers unused; the chunk was 2 here.
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"]
    assert parse("--checkpoint-activations", *full).training.checkpoint_num_layers == 1
    assert "--recompute-num-layers 2 is not used with --checkpoint-activations" in capsys.readouterr().err
    assert parse("--checkpoint-activations", *full[:-1], "1").training.checkpoint_num_layers == 1
    assert capsys.readouterr().err == ""


def test_a_recompute_interval_that_leaves_layers_unrecomputed_is_a_notice() -> None:
    """Megatron-LM recomputes every layer in groups of --recompute-num-layers; DeepSpeed only chunks of transformer
    layers alone, counted from the stage's first function: 4 layers after the embedding's functions in chunks of 4
    recompute none, with no sign of it but the memory."""
    from megatron_ds.model.naming import gpt_spec_groups
    from megatron_ds.pipeline.layout import build_layout
    from megatron_ds.training.resolve_layout import recompute_notice

    def notice(n: int, p: int) -> str | None:
        cfg = parse(
            "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", str(n)
        )
        return recompute_notice(cfg, build_layout(gpt_spec_groups(cfg.model), p))

    assert notice(1, 1) is None
    text = notice(4, 1)
    assert text is not None and text.startswith(
        "NOTICE: --recompute-num-layers 4 leaves layers unrecomputed (stage 0 recomputes 0 of its 4 layers)"
    )
    assert "--recompute-num-layers 1 recomputes them all" in text
    two = notice(2, 2)  # stage 0: [E E][E t][t]: 1 of 2; stage 1: [t t][L ..]: both
    assert two is not None and "(stage 0 recomputes 1 of its 2 layers)" in two


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--recompute-granularity", "full"], "needs --recompute-method uniform"),
        (["--recompute-method", "uniform"], "need --recompute-granularity full"),
        (
            [
                "--checkpoint-activations",
                "--checkpoint-num-layers",
                "2",
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "3",
            ],
            "disagree",
        ),
        (["--recompute-method", "uniform", "--activations-checkpoint-method", "block"], "block is not supported"),
        (["--checkpoint-activations", "--checkpoint-num-layers", "0"], "must be >= 1"),
    ],
)
def test_recompute_errors(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse(*flags)


def test_deepspeed_activation_checkpointing_alone_warns(capsys: pytest.CaptureFixture) -> None:
    assert not parse("--deepspeed-activation-checkpointing").training.checkpoint_activations
    assert "recomputes nothing by itself" in capsys.readouterr().err
    parse("--deepspeed-activation-checkpointing", "--checkpoint-activations")
    assert capsys.readouterr().err == ""


def test_train_samples_and_tokens_become_iterations() -> None:
    # 8 samples x 16 tokens = 128 tokens per iteration
    assert parse_config([*BASE[:-4], "--train-samples", "20", "--lr", "1"], world_size=1)[0].training.train_iters == 2
    cfg = parse("--train-tokens", str(128 * 4 + 1))
    assert cfg.training.train_iters == 5 and cfg.training.train_tokens == 513  # the smaller limit wins
    assert cfg.optimizer.lr_decay_iters == 10  # the decay still spans --train-iters
    cfg = parse_config([*BASE[:-4], "--train-tokens", str(128 * 6), "--lr", "1"], world_size=1)[0]
    assert cfg.training.train_iters == 6 and cfg.optimizer.lr_decay_tokens == 768
    cfg = parse_config([*BASE[:-4], "--train-samples", "80", "--lr-warmup-samples", "8", "--lr", "1"], world_size=1)[0]
    assert (cfg.optimizer.lr_decay_samples, cfg.optimizer.lr_warmup_samples, cfg.optimizer.lr_decay_iters) == (
        80,
        8,
        None,
    )


def test_gpt2_bpe_is_the_default_with_vocab_and_merge_files(tmp_path: Path) -> None:
    from megatron_ds.data.tokenizer import _bytes_to_unicode

    vocab = {s: i for i, s in enumerate(_bytes_to_unicode().values())}
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    argv = [a for a in BASE if a not in ("--vocab-size", "128")]
    cfg = parse_config(
        [*argv, "--vocab-file", str(tmp_path / "vocab.json"), "--merge-file", str(tmp_path / "merges.txt")],
        world_size=1,
    )[0]
    assert cfg.data.tokenizer_type == "GPT2BPETokenizer" and cfg.model.vocab_size == 384  # 257 padded to 128s
    assert parse("--mock-data").data.tokenizer_type is None


def test_parallel_mappings() -> None:
    cfg = parse("--pipeline-model-parallel-size", "2", "--standalone-embedding-stage", world_size=2)
    assert cfg.parallel.pp_dedicated_embedding_stages == "pre"
    cfg = parse(
        "--pipeline-model-parallel-size",
        "3",
        "--standalone-embedding-stage",
        "--pp-dedicated-embedding-stages",
        "post",
        world_size=3,
    )
    assert cfg.parallel.pp_dedicated_embedding_stages == "both"
    assert parse("--no-pipeline-parallel").parallel.pipeline_model_parallel_size == 1
    with pytest.raises(ConfigError, match=r"--no-pipeline-parallel needs --pipeline-model-parallel-size 1 \(got 2\)"):
        parse("--no-pipeline-parallel", "--pipeline-model-parallel-size", "2", world_size=2)


def test_model_options_that_keep_todays_model() -> None:
    assert (
        parse(
            "--num-key-value-heads",
            "4",
            "--kv-channels",
            "8",
            "--num-experts",
            "1",
            "--vocab-extra-ids",
            "0",
            "--data-impl",
            "mmap",
            "--dataloader-type",
            "single",
        )
        == parse()
        == parse("--data-impl", "infer")  # upstream's default: the header decides (a legacy one fails when read)
    )
    for argv, message in (
        (["--num-key-value-heads", "3"], "--num-key-value-heads 3 must divide"),
        (["--kv-channels", "0"], "--kv-channels 0 must be >= 1"),
        (["--num-experts", "8", "8", "8"], "--num-experts 8 8 8 gives 3 counts"),
        (["--vocab-extra-ids", "100"], "--vocab-extra-ids 100 is not supported"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse(*argv)


def test_new_fields_round_trip_and_default_to_todays_behaviour() -> None:
    from megatron_ds.config import Config

    cfg = parse("--hysteresis", "3", "--lr-warmup-tokens", "64", "--log-timers-to-tensorboard")
    assert Config.from_dict(cfg.to_dict()) == cfg
    m = parse().model
    assert (m.num_key_value_heads, m.kv_heads, m.gated_mlp, m.use_rotary_position_embeddings) == (None, 4, False, False)
    assert (m.activation, m.rotary_base) == ("gelu_tanh", 10000.0)  # Megatron-DeepSpeed's fused bias-GeLU
    assert m.add_position_embedding and m.add_bias_linear


# fp16 loss scaling and the DeepSpeed JSON


def fp16_config(**training):
    return tiny_config(training__precision="fp16", **{f"training__{k}": v for k, v in training.items()})


def test_fp16_flags_land_in_the_deepspeed_json() -> None:
    ds = dsc.generate(
        fp16_config(loss_scale=None, initial_loss_scale=4096.0, min_loss_scale=0.5, loss_scale_window=500, hysteresis=3)
    )
    assert ds["fp16"] == {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 12,
        "loss_scale_window": 500,
        "hysteresis": 3,
        "min_loss_scale": 0.5,
    }
    assert dsc.generate(fp16_config(loss_scale=128.0))["fp16"]["loss_scale"] == 128.0
    assert dsc.generate(fp16_config())["fp16"] == {"enabled": True, **dsc.FP16_DEFAULTS}
    assert "loss_scale" not in dsc.generate(tiny_config(training__hysteresis=3))["fp16"]  # fp32: no fp16 keys


def test_fp16_keys_without_a_flag_may_come_from_the_user_file(tmp_path: Path) -> None:
    user = tmp_path / "ds.json"
    user.write_text(
        json.dumps(
            {
                "fp16": {"enabled": True, "initial_scale_power": 11, "hysteresis": 2},
                "steps_per_print": 10,
                "prescale_gradients": False,
            }
        )
    )
    merged = dsc.build(fp16_config(deepspeed_config=str(user)))
    assert merged["fp16"]["initial_scale_power"] == 11 and merged["steps_per_print"] == 10


def test_the_user_files_fp16_section_rules_loss_scaling(tmp_path: Path) -> None:
    """Megatron-DeepSpeed's optimizer never builds Megatron's scaler under DeepSpeed: a JSON asking for
    dynamic scaling from 2^12 trains so, whatever --loss-scale says; one NOTICE names the ignored flags."""
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12}}))
    config = fp16_config(deepspeed_config=str(user), loss_scale=12.0, hysteresis=3, initial_loss_scale=4096.0)
    merged, notices = dsc.build_with_notices(config)
    assert merged["fp16"] == {**dsc.FP16_DEFAULTS, "enabled": True, "loss_scale": 0, "initial_scale_power": 12}
    scale = [n for n in notices if "fp16 section" in n]
    assert scale == [
        f"NOTICE: --deepspeed_config {user} has an fp16 section: it rules loss scaling (dynamic loss scaling from "
        "2^12), as in Megatron-DeepSpeed, whose optimizer never builds Megatron's scaler under DeepSpeed; "
        "--loss-scale 12, --hysteresis 3 ignored"  # --initial-loss-scale 4096 is the file's 2^12: not named
    ]
    # Without an fp16 section in the file the flags still give the scaling, and without flags nothing is said.
    user.write_text(json.dumps({"steps_per_print": 1}))
    assert dsc.build(config)["fp16"]["loss_scale"] == 12.0
    assert not [n for n in dsc.launch_notices(fp16_config(deepspeed_config=str(user))) if "fp16 section" in n]


def test_activation_checkpointing_options_in_the_user_file_must_agree_with_the_flags(tmp_path: Path) -> None:
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"activation_checkpointing": {"partition_activations": False, "number_checkpoints": 4}}))
    dsc.build(tiny_config(training__deepspeed_config=str(user)))
    user.write_text(json.dumps({"activation_checkpointing": {"cpu_checkpointing": True}}))
    with pytest.raises(dsc.DeepSpeedConfigError, match="activation_checkpointing.cpu_checkpointing true but"):
        dsc.build(tiny_config(training__deepspeed_config=str(user)))


def test_loss_scale_flag_checks_and_warning(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ConfigError, match="--initial-loss-scale 3000.0 must be a power of 2"):
        parse("--initial-loss-scale", "3000")
    with pytest.raises(ConfigError, match="--hysteresis 0 must be > 0"):
        parse("--hysteresis", "0")
    cfg = parse("--hysteresis", "2", "--loss-scale-window", "500")
    assert (cfg.training.hysteresis, cfg.training.loss_scale_window) == (2, 500)
    assert "--loss-scale-window, --hysteresis only apply with --fp16; ignored with fp32" in capsys.readouterr().err


# Logging


class FakeWriter:
    def __init__(self) -> None:
        self.scalars: dict[str, list[tuple[int, float]]] = {}

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.setdefault(tag, []).append((step, float(value)))


def stats() -> logger.StepStats:
    return logger.StepStats(
        iteration=5,
        train_iters=10,
        consumed_samples=40,
        elapsed_ms=12.5,
        learning_rate=1e-3,
        global_batch_size=8,
        loss=2.0,
        grad_norm=1.5,
        loss_scale=None,
        tokens_per_second=100.0,
        eta_s=1.0,
    )


def iteration_stats() -> logger.IterationStats:
    return logger.IterationStats(
        iteration=5, learning_rate=1e-3, global_batch_size=8, loss=2.0, grad_norm=1.5, loss_scale=None
    )


def test_tensorboard_scalars_follow_the_logging_flags(capsys: pytest.CaptureFixture) -> None:
    plain = FakeWriter()
    tb = logger.Scalars(plain, parse("--tensorboard-dir", "x").logging)
    tb.iteration(iteration_stats())
    tb.window(stats())
    tb.eval("validation", 5, 2.0)
    assert set(plain.scalars) == {
        "lm-loss-training/lm loss",
        "throughput/tokens-per-second",
        "grad-norm/grad-norm",
        "learning-rate/learning-rate",
        "lm-loss-validation/lm loss",
    }
    every = FakeWriter()
    cfg = parse(
        "--tensorboard-dir",
        "x",
        "--log-timers-to-tensorboard",
        "--log-batch-size-to-tensorboard",
        "--log-validation-ppl-to-tensorboard",
        "--no-log-learnig-rate-to-tensorboard",
        "--log-world-size-to-tensorboard",
        "--tensorboard-queue-size",
        "1",
    ).logging
    assert cfg.tensorboard_queue_size == 1
    tb = logger.Scalars(every, cfg, world_size=3)
    tb.iteration(iteration_stats())
    tb.window(stats())
    tb.eval("validation", 5, 2.0)
    assert every.scalars["iteration-time/iteration-time-ms"] == [(5, 12.5)]
    assert every.scalars["batch-size/batch-size"] == [(5, 8.0)]
    assert every.scalars["world-size/world-size"] == [(5, 3.0)]  # every --tensorboard-log-interval, as upstream
    assert every.scalars["lm-loss-validation/lm loss ppl"][0][1] == pytest.approx(7.389056)
    assert "learning-rate/learning-rate" not in every.scalars
    assert parse().logging.tensorboard_log_interval == 1  # Megatron's default: every iteration
    assert parse("--tensorboard-log-interval", "10").logging.tensorboard_log_interval == 10
    with pytest.raises(ConfigError, match="--tensorboard-log-interval 0 must be >= 1"):
        parse("--tensorboard-log-interval", "0")
    parse("--log-timers-to-tensorboard")
    assert "--log-timers-to-tensorboard need --tensorboard-dir or --wandb-project; ignored" in capsys.readouterr().err
    parse("--log-timers-to-tensorboard", "--wandb-project", "p")  # the same scalars go to wandb
    assert "--log-timers-to-tensorboard" not in capsys.readouterr().err


class FakeWandb:
    """wandb's module as `scalar_writers` uses it: `init(...)` returns a run with `log` and `finish`."""

    def __init__(self) -> None:
        self.init_kwargs: dict = {}
        self.logged: list[tuple[dict, int]] = []
        self.finished, self.exit_code = False, None

    def init(self, **kwargs: object) -> FakeWandb:
        self.init_kwargs = kwargs
        return self

    def log(self, data: dict, step: int) -> None:
        self.logged.append((data, step))

    def finish(self, exit_code: int | None = None) -> None:
        self.finished, self.exit_code = True, exit_code


def test_wandb_gets_the_tensorboard_scalars_as_megatron_starts_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture
) -> None:
    from megatron_ds.training import scalar_writers

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    flags = ("--wandb-project", "gpt", "--wandb-exp-name", "run1", "--wandb-entity", "team", "--save", str(tmp_path))
    cfg = parse(*flags, "--log-batch-size-to-tensorboard")
    assert scalar_writers.wandb_directory(cfg) == str(tmp_path / "wandb")  # Megatron's <--save>/wandb
    writer = scalar_writers.open_writers(cfg)  # no --tensorboard-dir: wandb alone
    assert [type(w) for w in writer.writers] == [scalar_writers.WandbWriter]
    assert (tmp_path / "wandb").is_dir()
    kwargs = fake.init_kwargs
    assert (kwargs["project"], kwargs["name"], kwargs["entity"], kwargs["dir"]) == (
        "gpt",
        "run1",
        "team",
        str(tmp_path / "wandb"),
    )
    assert kwargs["config"] == cfg.to_dict()
    scalars = logger.Scalars(writer, cfg.logging)
    scalars.iteration(iteration_stats())
    scalars.window(stats())
    scalars.eval("validation", 5, 2.0)
    scalars.close()
    tags = {tag for data, step in fake.logged for tag in data if step == 5}
    assert {"lm-loss-training/lm loss", "batch-size/batch-size", "lm-loss-validation/lm loss"} <= tags
    assert ({"lm-loss-training/lm loss": 2.0}, 5) in fake.logged and fake.finished and fake.exit_code == 0
    logger.Scalars(scalar_writers.open_writers(cfg), cfg.logging).close(failed=True)  # an error stop
    assert fake.exit_code == 1  # shown as failed in wandb
    summary = SimpleNamespace(SummaryWriter=lambda log_dir, max_queue: SimpleNamespace(log_dir=log_dir))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", summary)  # tensorboard is an optional extra
    both = scalar_writers.open_writers(parse(*flags, "--tensorboard-dir", str(tmp_path / "tb"))).writers
    assert both[0].log_dir == str(tmp_path / "tb") and isinstance(both[1], scalar_writers.WandbWriter)
    assert scalar_writers.wandb_directory(parse("--wandb-project", "gpt")) is None  # wandb's ./wandb
    assert scalar_writers.wandb_directory(parse(*flags, "--wandb-save-dir", "w")) == "w"
    assert scalar_writers.open_writers(parse()) is None
    assert parse("--wandb-project", "").logging.wandb_project is None  # Megatron's "" is "not given"
    capsys.readouterr()
    assert parse("--wandb-exp-name", "run1", "--wandb-save-dir", "w").logging.wandb_exp_name == "run1"
    assert "--wandb-exp-name, --wandb-save-dir need --wandb-project; ignored without it" in capsys.readouterr().err


def test_optimizer_state_norms_of_adam() -> None:
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = torch.optim.AdamW([w], lr=0.1)
    w.grad = torch.tensor([0.5, 0.5])
    opt.step()
    engine = SimpleNamespace(optimizer=SimpleNamespace(optimizer=opt))  # as DeepSpeed wraps it
    norms = logger.optimizer_state_norms(engine)
    state = opt.state[w]
    assert norms["momentum_l2"] == pytest.approx(float(state["exp_avg"].norm()))
    assert norms["variance_l1"] == pytest.approx(float(state["exp_avg_sq"].abs().sum()))
    assert norms["variance_sqrt_l2"] == pytest.approx(float(state["exp_avg_sq"].sqrt().norm()))
    assert norms["weight_l2"] == pytest.approx(float(w.detach().norm()))
    writer = FakeWriter()
    tb = logger.Scalars(writer, parse("--tensorboard-dir", "x", "--log-optimizer-states-to-tensorboard").logging)
    tb.optimizer_states(engine, 7)
    assert writer.scalars["optimizer/momentum_l2"] == [(7, pytest.approx(norms["momentum_l2"]))]
    sgd = torch.optim.SGD([w], lr=0.1)
    assert logger.optimizer_state_norms(SimpleNamespace(optimizer=sgd)) == {}
