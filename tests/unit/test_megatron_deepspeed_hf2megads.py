"""A Hugging Face Llama converted by Megatron-DeepSpeed's `tools/hf2megads_weight_converter.py` -> ours.

Megatron-DeepSpeed's Llama fine-tuning example (examples_deepspeed/finetune_hf_llama/finetune_llama.sh
`convert_hf2mds`) first writes the HF model into a Megatron-DeepSpeed checkpoint with that tool. The
fixture tests/fixtures/megatron_deepspeed_checkpoints/hf2megads_tp2_pp2 is its output at upstream commit
4efb479 (T=2, P=2, fp32; make_hf2megads_fixture.py and COMMANDS.txt say exactly how) for a tiny random
Llama (8 heads, 4 key/value heads: two key/value groups per tensor rank), with the ORIGINAL HF model's
logits (transformers, fp32) on fixed tokens.

The tool writes each rank's fused QKV rows interleaved per key/value group (`refactor._qkv_refactor`:
per group its query heads, its key head, its value head), also at 4efb479, whose own model reads
them blocked. So the checkpoint is the HF model with `--qkv-layout interleaved`; blocked gives another
model (the two coincide only with one key/value head per tensor rank).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_ds.inference.model import load_model
from megatron_ds.interop import megatron_deepspeed_files as mds_files
from megatron_ds.interop.megatron_deepspeed import import_megatron_deepspeed
from megatron_ds.training.checkpoint.directory import META

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_deepspeed_checkpoints" / "hf2megads_tp2_pp2"


@pytest.fixture(scope="module")
def convert(tmp_path_factory: pytest.TempPathFactory):
    """convert(layout) -> (output directory, ImportResult), each layout converted once."""
    done = {}
    base = tmp_path_factory.mktemp("hf2megads")

    def run(layout: str):
        if layout not in done:
            out = base / layout
            done[layout] = (out, import_megatron_deepspeed(str(FIXTURE), str(out), layout, show_progress=False))
        return done[layout]

    return run


def _logits(out: Path) -> tuple[torch.Tensor, torch.Tensor]:
    reference = torch.load(FIXTURE / "reference.pt", weights_only=True)
    model = load_model(str(out))  # padding rows dropped: the tokenizer's 700 of upstream's 768
    with torch.no_grad():
        return model(reference["tokens"]), reference["logits"]


def test_the_fixture_is_the_hf2megads_tools_output() -> None:
    ckpt = mds_files.open_megatron_deepspeed(str(FIXTURE))
    assert ckpt.tag == "global_step0"  # the tool's save_checkpoint(0, ...)
    assert ckpt.args["load_mode"] == "auto" and ckpt.args["hf_ckpt_dir"] and not ckpt.args["to_hf_ckpt"]
    assert (ckpt.tensor_parallel, ckpt.pipeline_parallel, ckpt.zero_stage, ckpt.precision) == (2, 2, 0, "fp32")
    assert ckpt.args["tokenizer_type"] == "HFTokenizer" and ckpt.args["padded_vocab_size"] == 768


def test_converted_logits_equal_the_original_hf_models(convert) -> None:
    out, result = convert("interleaved")
    assert result.iteration == 0 and result.states == []  # the tool saves no optimizer state
    ours, theirs = _logits(out)
    assert ours.shape == theirs.shape == (2, 16, 700)
    assert theirs.abs().max() > 1  # logits of order 1: the tolerance below is tight
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_blocked_rows_give_another_model(convert) -> None:
    # two key/value groups per tensor rank: the blocked reading (current upstream's model) scrambles q, k and v
    ours, theirs = _logits(convert("blocked")[0])
    assert (ours - theirs).abs().max() > 1e-1


def test_the_converted_architecture_is_the_hf_llamas(convert) -> None:
    out, result = convert("interleaved")
    hf = json.loads((FIXTURE / "hf_config.json").read_text())
    meta = json.loads((out / "global_step0" / META).read_text())
    model = meta["config"]["model"]
    assert hf["model_type"] == "llama" and not hf["tie_word_embeddings"]
    assert {k: model[k] for k in ("normalization", "activation", "use_rotary_position_embeddings")} == {
        "normalization": "rmsnorm",
        "activation": "swiglu",
        "use_rotary_position_embeddings": True,
    }
    assert model["untie_embeddings_and_output_weights"] is True
    assert model["add_position_embedding"] is False and model["add_bias_linear"] is False
    assert (model["num_layers"], model["hidden_size"], model["ffn_hidden_size"]) == (
        hf["num_hidden_layers"],
        hf["hidden_size"],
        hf["intermediate_size"],
    )
    assert (model["num_attention_heads"], model["num_key_value_heads"]) == (
        hf["num_attention_heads"],
        hf["num_key_value_heads"],
    )
    assert model["layernorm_epsilon"] == hf["rms_norm_eps"]
    rope_theta = hf.get("rope_theta") or hf["rope_parameters"]["rope_theta"]
    assert model["rotary_base"] == rope_theta and model["rotary_percent"] == 1.0
    assert model["vocab_size"] == 768 and meta["megatron_deepspeed"]["vocab_size"] == hf["vocab_size"] == 700
    assert meta["megatron_deepspeed"]["qkv_layout"] == "interleaved"
    flags = " ".join(result.train_flags)
    for flag in (
        "--normalization rmsnorm",
        "--swiglu",
        "--use-rotary-position-embeddings",
        "--no-position-embedding",
        "--untie-embeddings-and-output-weights",
        "--disable-bias-linear",
        "--num-key-value-heads 4",
        "--vocab-size 700",
    ):
        assert flag in flags, flag


def test_the_converter_reads_hf2megads_output_interleaved_by_default(tmp_path: Path) -> None:
    """Without --qkv-layout the tool's output is recognised by its saved --hf-ckpt-dir and read as it was written,
    with a notice; a trained checkpoint keeps the current release's blocked reading."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, str(root / "tools" / "convert_checkpoint.py"), "--from", "megatron-deepspeed", str(FIXTURE),
         str(tmp_path / "out"), "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "QKV rows interleaved)" in out.stdout
    assert "NOTICE: " + str(
        FIXTURE / "global_step0"
    ) + " was written by Megatron-DeepSpeed's tools/hf2megads_weight_converter.py" in (out.stdout)
    ours, theirs = _logits(tmp_path / "out")
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    trained = FIXTURE.parent / "tp2_pp2_tied"
    assert mds_files.open_megatron_deepspeed(str(trained)).args.get("hf_ckpt_dir") is None
    assert import_megatron_deepspeed(str(trained), str(tmp_path / "t"), show_progress=False).qkv_layout == "blocked"
