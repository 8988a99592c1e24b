"""Megatron-DeepSpeed checkpoints -> ours (`tools/convert_checkpoint.py --from megatron-deepspeed`).

The fixtures in tests/fixtures/megatron_deepspeed_checkpoints/ were written by Megatron-DeepSpeed's own code
(GPTModelPipe on DeepSpeed's CPU accelerator; make_fixture.py and COMMANDS.txt there say exactly
how), each with the logits upstream's model computes on fixed tokens (`reference.pt`). Checked
here: the converted model's logits equal upstream's; the QKV row layout is what the flag says;
the optimizer state is Adam's (the step between two saved checkpoints is the update its converted
moments give); the schedule, counters and vocabulary carry over; pickled metadata runs no code.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from megatron_ds.inference.model import load_model
from megatron_ds.interop import megatron_deepspeed_args as saved_args
from megatron_ds.interop import megatron_deepspeed_files as mds_files
from megatron_ds.interop import restricted_pickle
from megatron_ds.interop.megatron_deepspeed import import_megatron_deepspeed
from megatron_ds.training.checkpoint.directory import META, CheckpointError, latest_tag
from megatron_ds.training.checkpoint.universal.store import Universal

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_deepspeed_checkpoints"
CASES = {
    "tp1_pp2_tied": "blocked",  # current upstream, T=1 P=2, tied, no ZeRO (torch Adam state per stage)
    "tp2_pp1_untied_swiglu": "blocked",  # untied, SwiGLU, RMSNorm, no biases, ZeRO-1
    "tp2_pp2_tied": "blocked",  # T=2 P=2, tied, ZeRO-1
    "tp2_pp1_interleaved_llama": "interleaved",  # older release: rotary, GQA (2 kv groups per rank)
    "tp1_pp2_dp2_bf16": "blocked",  # bf16, ZeRO-1 over 2 data-parallel replicas: masters and moments split
    "tp2_nopp": "blocked",  # --no-pipeline-parallel: GPTModel on the plain engine, T=2, ZeRO-1, no layer files
    "tp1_nopp_zero0_untied": "blocked",  # the same without ZeRO (torch Adam state), untied output layer
    "tp1_nopp_bf16": "blocked",  # the same in bf16 with ZeRO-1
}
BF16 = {"tp1_pp2_dp2_bf16", "tp1_nopp_bf16"}
"""Cases upstream ran in bf16: its logits are bf16 computations, the converted model's fp32."""


@pytest.fixture(scope="module")
def convert(tmp_path_factory: pytest.TempPathFactory):
    """convert(case, layout=its own, path=the case root) -> output directory (each conversion once)."""
    done: dict[tuple[str, str, str], Path] = {}
    base = tmp_path_factory.mktemp("converted")

    def run(case: str, layout: str | None = None, sub: str = "") -> Path:
        key = (case, layout or CASES[case], sub)
        if key not in done:
            out = base / "-".join(k for k in key if k)
            import_megatron_deepspeed(str(FIXTURES / case / sub), str(out), key[1], show_progress=False)
            done[key] = out
        return done[key]

    return run


def _without_optimizer_files(case: str, copy: Path) -> Path:
    """A copy of the case's global_step2 without its flat optimizer files (as saved with --no-save-optim)."""
    shutil.copytree(FIXTURES / case / "global_step2", copy)
    for name in os.listdir(copy):
        if name.endswith("_optim_states.pt"):
            os.remove(copy / name)
    return copy


def _logits(out: Path, case: str) -> tuple[torch.Tensor, torch.Tensor]:
    reference = torch.load(FIXTURES / case / "reference.pt", weights_only=True)
    model = load_model(str(out), vocab_size=reference["logits"].shape[-1])  # upstream's padded columns too
    with torch.no_grad():
        return model(reference["tokens"]), reference["logits"]


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_megatron_deepspeeds(convert, case: str) -> None:
    ours, theirs = _logits(convert(case), case)
    assert ours.shape == theirs.shape
    # fp32 on both sides; upstream's bf16 model: within 4 bf16 steps (2^-8 relative) of the largest logit
    atol = 2**-6 * theirs.abs().max().item() if case in BF16 else 1e-5
    torch.testing.assert_close(ours, theirs, rtol=0, atol=atol)


@pytest.mark.parametrize(("case", "wrong"), [("tp2_pp1_interleaved_llama", "blocked"), ("tp2_pp2_tied", "interleaved")])
def test_the_qkv_layout_flag_decides_the_model(convert, case: str, wrong: str) -> None:
    # Nothing in a checkpoint says which layout it has: the other choice gives another model.
    ours, theirs = _logits(convert(case, wrong), case)
    assert (ours - theirs).abs().max() > 1e-2


@pytest.mark.parametrize(
    "case", ["tp1_pp2_tied", "tp2_pp2_tied", "tp1_pp2_dp2_bf16", "tp2_nopp", "tp1_nopp_zero0_untied"]
)
def test_optimizer_state_is_the_runs_adam_state(convert, case: str) -> None:
    """Upstream's second step, w2 = w1 - lr/(1-b1^2) m / (sqrt(v)/sqrt(1-b2^2) + eps), holds for every
    tensor with the converted step-2 moments: each moment sits on its own tensor."""
    first = Universal(str(convert(case, sub="global_step1") / "global_step1.universal"))
    second = Universal(str(convert(case) / "global_step2.universal"))
    assert second.states == ["exp_avg", "exp_avg_sq"]
    lr, b1, b2, eps = 1e-3, 0.9, 0.999, 1e-8  # make_fixture.py's flags
    for name, entry in second.tensors.items():
        assert entry["step"] == 2
        m, v = second.read(name, "exp_avg"), second.read(name, "exp_avg_sq")
        predicted = first.read(name, "fp32") - (lr / (1 - b1**2)) * m / (v.sqrt() / math.sqrt(1 - b2**2) + eps)
        torch.testing.assert_close(second.read(name, "fp32"), predicted, rtol=0, atol=1e-7, msg=name)


@pytest.mark.parametrize("case", sorted(BF16))
def test_bf16_masters_round_to_the_models_weights(convert, tmp_path: Path, case: str) -> None:
    """The fp32 masters (with DP=2, split between two replicas by ZeRO-1 and joined) each round to the bf16
    weight upstream's model holds (read from its layer or mp_rank files by a conversion without the optimizer
    files)."""
    source = _without_optimizer_files(case, tmp_path / "weights_only" / "global_step2")
    import_megatron_deepspeed(str(source), str(tmp_path / "out"), show_progress=False)
    weights = Universal(str(tmp_path / "out" / "global_step2.universal"))
    masters = Universal(str(convert(case) / "global_step2.universal"))
    assert sorted(weights.tensors) == sorted(masters.tensors) and len(masters.tensors) > 10
    for name in masters.tensors:
        master, weight = masters.read(name, "fp32"), weights.read(name, "fp32")
        assert torch.equal(master.to(torch.bfloat16).float(), weight), name
        assert not torch.equal(master, weight), name  # the masters are fp32, not the weights again


def test_training_state_and_provenance_are_recorded(convert) -> None:
    out = convert("tp2_pp2_tied")
    meta = json.loads((out / "global_step2" / META).read_text())
    assert meta["train_state"] == {
        "iteration": 2,
        "consumed_train_samples": 8,
        "consumed_valid_samples": 0,
        "consumed_train_tokens": 128,  # upstream's `tokens`: 8 samples of 16 tokens
    }
    assert meta["megatron_deepspeed"]["qkv_layout"] == "blocked"
    assert meta["megatron_deepspeed"]["vocab_size"] == 100  # the tokenizer's rows; 128 with T=2 padding
    assert meta["config"]["model"]["vocab_size"] == 128
    # --tokenizer-type NullTokenizer --vocab-size 99 upstream: 100 ids, end-of-document 99; ours, recorded, is the same
    data = meta["config"]["data"]
    assert (data["tokenizer_type"], data["null_tokenizer_vocab_size"], data["null_tokenizer_eod_id"]) == (
        "NullTokenizer",
        100,
        None,
    )
    universal = json.loads((out / "global_step2.universal" / META).read_text())
    assert universal["engine"] == {"global_steps": 2, "global_samples": 8, "skipped_steps": 0}
    assert universal["lr_scheduler"] == {
        "num_steps": 2,
        "max_lr": 1e-3,
        "min_lr": 0.0,
        "decay_style": "constant",
        "unit": "samples",
        "warmup": 0,
        "decay": 8,
    }
    assert universal["source"]["stage_parts"] == [0, 4, 7]  # DeepSpeed's type:transformer split of 3 layers
    assert universal["vocabulary"] == {"rows": 128, "unpadded": 100}


def test_a_weights_only_source_converts_without_optimizer_state(convert, tmp_path: Path) -> None:
    source = _without_optimizer_files("tp2_pp2_tied", tmp_path / "no_optim")
    result = import_megatron_deepspeed(str(source), str(tmp_path / "out"), show_progress=False)
    assert result.states == [] and any("optimizer" in n for n in result.notes)
    ours, theirs = _logits(tmp_path / "out", "tp2_pp2_tied")
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_saved_values_we_do_not_build_are_refused_by_name() -> None:
    ckpt = mds_files.open_megatron_deepspeed(str(FIXTURES / "tp1_pp2_tied"))
    for change, flag in (
        ({"num_experts": [4]}, "--num-experts"),
        ({"apply_residual_connection_post_layernorm": True}, "--apply-residual-connection-post-layernorm"),
    ):
        changed = dataclasses.replace(ckpt, args={**ckpt.args, **change})
        with pytest.raises(CheckpointError, match=flag) as err:
            saved_args.config_from_args(changed, [])
        assert "\n" not in str(err.value)
    wide = dataclasses.replace(ckpt, args={**ckpt.args, "kv_channels": 16})  # built since --kv-channels is
    assert saved_args.config_from_args(wide, []).model.head_dim == 16
    relu2 = dataclasses.replace(ckpt, args={**ckpt.args, "squared_relu": True})  # built since --squared-relu is
    assert saved_args.config_from_args(relu2, []).model.activation == "squared_relu"
    zero3 = dataclasses.replace(ckpt, args={**ckpt.args, "deepspeed_config_dict": {"zero_optimization": {"stage": 3}}})
    with pytest.raises(CheckpointError, match="ZeRO-3"):
        saved_args.config_from_args(zero3, [])


def test_neutral_values_render_no_flag() -> None:
    args = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_channels": 8}
    args |= {"num_experts": [1], "rope_theta": 500000, "rotary_percent": 1.0, "add_bias_linear": True}
    assert saved_args.render(args, saved_args.MODEL_ARGS) == ["--hidden-size", "32", "--num-attention-heads", "4"]
    rotary = {**args, "use_rotary_position_embeddings": True}
    assert "--rotary-position-embeddings-theta" in saved_args.render(rotary, saved_args.MODEL_ARGS)


def test_pickled_metadata_runs_no_code(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path, layer = tmp_path / "mp_rank_00_model_states.pt", tmp_path / "layer_01-model_00-model_states.pt"
    torch.save({"args": Payload()}, path)
    torch.save({"weight": Payload()}, layer)
    for load, where in ((mds_files.load_model_states, path), (mds_files.load_layer, layer)):
        with pytest.raises(CheckpointError) as err:
            load(str(where))
        # named as a refusal, not in torch's words (which advise weights_only=False)
        assert str(err.value) == (
            f"{where}: holds a pickled posix.system, which such a file does not hold; refused (nothing in it was run)"
        )
    assert not marker.exists()


def test_upstream_values_stay_inert_records() -> None:
    ckpt = mds_files.open_megatron_deepspeed(str(FIXTURES / "tp1_pp2_tied"))
    assert isinstance(ckpt.args["model_type"], restricted_pickle.Inert)  # megatron.core.enums.ModelType, not imported
    assert ckpt.args["params_dtype"] is torch.float32


@pytest.mark.parametrize("sub", ["", "global_step2"])
def test_load_names_a_megatron_deepspeed_checkpoint_and_the_command(sub: str) -> None:
    path = str(FIXTURES / "tp1_pp2_tied" / sub)
    with pytest.raises(CheckpointError) as err:
        latest_tag(path)
    message = str(err.value)
    assert "a Megatron-DeepSpeed checkpoint" in message and "\n" not in message
    assert f"python tools/convert_checkpoint.py --from megatron-deepspeed {path} OUT" in message


def test_load_finds_one_by_megatrons_tracker_file_too(tmp_path: Path) -> None:
    root = tmp_path / "run"
    shutil.copytree(FIXTURES / "tp2_pp1_untied_swiglu", root)
    os.remove(root / "latest")  # DeepSpeed's pointer gone: latest_checkpointed_iteration.txt names the step
    with pytest.raises(CheckpointError, match="a Megatron-DeepSpeed checkpoint .global_step2"):
        latest_tag(str(root))


def test_cli_converts_and_refuses_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "convert_tool", Path(__file__).parents[2] / "tools" / "convert_checkpoint.py"
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    source, out = str(FIXTURES / "tp2_pp1_interleaved_llama"), str(tmp_path / "out")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert tool.main(["--from", "megatron-deepspeed", source, out, "--qkv-layout", "interleaved", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "QKV rows interleaved" in printed and "optimizer state (exp_avg, exp_avg_sq)" in printed
    assert f"pretrain_gpt.py --load {out} --num-layers 3" in printed
    for argv, expected in (
        (["--from", "megatron-deepspeed", source, out], "already exists"),
        (["--from", "megatron-deepspeed", source, out + "2", "--qkv-layout", "rows"], "invalid choice"),
        (["--from", "megatron-deepspeed", source, out + "2", "--num-layers", "4"], "drop --num-layers 4"),
        (["--from", "megatron-deepspeed", str(empty), out + "2"], "not a Megatron-DeepSpeed checkpoint"),
        (["--from", "megatron-deepspeed", str(tmp_path), out + "2"], "or inside it; a conversion never writes into"),
        (["--from", "hf", source, out + "2", "--qkv-layout", "blocked"], "--qkv-layout applies to"),
        (["--to", "universal", out, out + "2"], "converted from Megatron-DeepSpeed"),
    ):
        assert tool.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1, (argv, err)
    assert not os.path.exists(out + "2")


def test_load_names_what_an_upstream_directory_holds() -> None:
    """`--load` of an upstream directory says which files it found (no layer files without the pipeline)."""
    from megatron_ds.training.checkpoint.directory import foreign_checkpoint

    assert foreign_checkpoint(str(FIXTURES / "tp2_pp2_tied")) == (
        "a Megatron-DeepSpeed checkpoint (global_step2: DeepSpeed's layer and mp_rank files, no megatron_ds.json)"
    )
    assert foreign_checkpoint(str(FIXTURES / "tp2_nopp" / "global_step2")).endswith(
        "(global_step2: DeepSpeed's mp_rank files, no megatron_ds.json)"
    )


def test_a_megatron_deepspeed_checkpoint_given_as_megatron_lm_is_named() -> None:
    """Both write latest_checkpointed_iteration.txt; the global_stepN beside it says which tool wrote it."""
    from megatron_ds.interop.megatron_lm_files import open_megatron_lm

    source = FIXTURES / "tp1_nopp_bf16"
    with pytest.raises(CheckpointError) as err:
        open_megatron_lm(str(source))
    assert str(err.value) == (
        f"{source}: a Megatron-DeepSpeed checkpoint (global_step2), not a Megatron-LM one; convert it with "
        f"--from megatron-deepspeed"
    )


def test_every_checkpoint_reader_names_a_refused_pickle(tmp_path: Path) -> None:
    from megatron_ds.interop import megatron_lm_files
    from megatron_ds.training.checkpoint.universal import state_files

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "model_optim_rng.pt"
    torch.save({"args": Payload()}, path)
    for load in (megatron_lm_files.load_pickled_state, state_files.load_file):
        with pytest.raises(CheckpointError) as err:
            load(str(path))
        assert str(err.value) == (
            f"{path}: holds a pickled posix.system, which such a file does not hold; refused (nothing in it was run)"
        )
    assert not marker.exists()


def test_a_sentencepiece_tokenizer_is_recorded_with_a_note_on_its_ids_and_end_of_document() -> None:
    from types import SimpleNamespace

    from megatron_ds.interop.megatron_deepspeed_args import tokenizer_flags

    model = str(Path(__file__).resolve().parents[1] / "fixtures" / "megatron_deepspeed" / "sp.model")
    ckpt = SimpleNamespace(args={"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": model})
    flags, note = tokenizer_flags(ckpt, {})
    assert flags == ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model]
    assert note == (
        "tokenizer SentencePieceTokenizer recorded as ours, Megatron-DeepSpeed's GPTSentencePieceTokenizer: 120 ids, "
        "end-of-document 2; the run's had 124 (<CLS>, <SEP>, <EOD>, <MASK> added, end-of-document <EOD> 122): the "
        "embedding keeps every row, but ids from 120 are never produced here; data Megatron-DeepSpeed preprocessed "
        "ends documents with 122, so preprocess it again with tools/preprocess_data.py"
    )
    gpt = SimpleNamespace(args={"tokenizer_type": "GPTSentencePieceTokenizer", "tokenizer_model": model})
    assert tokenizer_flags(gpt, {})[1] is None  # ours exactly: nothing to say
