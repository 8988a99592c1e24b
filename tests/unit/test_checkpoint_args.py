"""Flags from the `--load` checkpoint (`--use-checkpoint-args`, an import's dropout) and the
tokenizer check on resume; a checkpoint directory holding only `megatron_ds.json` is enough here."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megatron_ds.config import Config, DataConfig, ModelConfig, RegularizationConfig
from megatron_ds.flags.parser import parse_config
from megatron_ds.testing.launch_lines import sentencepiece_model
from megatron_ds.training.checkpoint.directory import CheckpointError
from megatron_ds.training.checkpoint.tokenizer_check import tokenizer_notice

TRAIN = ["--lr", "1e-3", "--train-iters", "2", "--mock-data"]
LLAMA = ModelConfig(
    num_layers=3,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    ffn_hidden_size=176,
    seq_length=32,
    max_position_embeddings=64,
    vocab_size=256,
    normalization="rmsnorm",
    activation="swiglu",
    use_rotary_position_embeddings=True,
    rotary_base=500000.0,
    add_position_embedding=False,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)


def checkpoint(root: Path, config: Config, **meta: object) -> str:
    (root / "global_step0").mkdir(parents=True)
    body = {"config": config.to_dict(), "train_state": {}, "layout": "", "world_size": 1, "format": 1, **meta}
    (root / "global_step0" / "megatron_ds.json").write_text(json.dumps(body))
    (root / "latest").write_text("global_step0")
    return str(root)


def imported(root: Path) -> str:
    regularization = RegularizationConfig(hidden_dropout=0.0, attention_dropout=0.0)
    config = Config(model=LLAMA, regularization=regularization)
    return checkpoint(root, config, weights_only=True, hf={"arch": "llama", "vocab_size": 250})


def test_use_checkpoint_args_takes_the_architecture(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    load = imported(tmp_path / "ck")
    config, _ = parse_config(["--use-checkpoint-args", "--load", load, *TRAIN])
    assert config.model == LLAMA
    out = capsys.readouterr().out
    assert out.startswith(f"NOTICE: --use-checkpoint-args: from --load {load} (global_step0): --num-layers 3, ")
    assert "--swiglu" in out and "--normalization rmsnorm" in out and out.count("\n") == 2  # and the dropout's
    # A flag given on the line wins; at --load the architecture check then names the difference.
    assert parse_config(["--use-checkpoint-args", "--load", load, "--num-layers", "4", *TRAIN])[0].model.num_layers == 4
    # T stays this run's, and the stored (padded) vocabulary is kept at T=2.
    config, _ = parse_config(["--use-checkpoint-args", "--load", load, "--tensor-model-parallel-size", "2", *TRAIN])
    assert config.model.vocab_size == 256 and config.parallel.tensor_model_parallel_size == 2
    out = capsys.readouterr().out
    assert "T and P stay this run's (2 and 1; the checkpoint's are 1 and 1" in out
    # The import's 250 tokens stay the tokens (mock data draws below them), padded to the stored 256 rows at T=2.
    assert config.data.unpadded_vocab_size == 250 and out.count("--vocab-size 250, ") == 2
    # 256 / T: at T=1 (the --num-layers 4 line) 256, at T=2 Megatron's default 128, not printed
    assert out.count("--make-vocab-size-divisible-by 256") == 1 and "--make-vocab-size-divisible-by 128" not in out


def test_use_checkpoint_args_takes_a_sliding_window(tmp_path: Path) -> None:
    windowed = dataclasses.replace(LLAMA, window_size=(7, 0), window_attn_skip_freq=(1, 0, 1))
    load = checkpoint(tmp_path / "ck", Config(model=windowed))
    assert parse_config(["--use-checkpoint-args", "--load", load, *TRAIN])[0].model == windowed


def test_use_checkpoint_args_needs_load(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ValueError, match="--use-checkpoint-args takes the architecture from --load's checkpoint"):
        parse_config(["--use-checkpoint-args", *TRAIN])
    with pytest.raises(ValueError, match="missing required flag"):  # nothing to take: the flags must say it
        parse_config(["--use-checkpoint-args", "--load", str(tmp_path / "new"), *TRAIN])
    assert "holds no checkpoint yet; the flags give the model" in capsys.readouterr().out


def test_continuing_an_import_keeps_its_dropout(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    load = imported(tmp_path / "ck")
    arch = ["--use-checkpoint-args", "--load", load, *TRAIN]
    assert parse_config(arch)[0].regularization == RegularizationConfig(hidden_dropout=0.0, attention_dropout=0.0)
    assert (
        f"NOTICE: --load {load} (global_step0) is an imported model: continuing with its dropout (--hidden-dropout 0, "
        "--attention-dropout 0); give the flag to change it"
    ) in capsys.readouterr().out
    assert parse_config([*arch, "--hidden-dropout", "0.2"])[0].regularization.hidden_dropout == 0.2
    # Our own checkpoints resume with the flags' dropout, as Megatron's do.
    ours = checkpoint(tmp_path / "ours", Config(model=LLAMA, regularization=RegularizationConfig(hidden_dropout=0.0)))
    assert parse_config(["--use-checkpoint-args", "--load", ours, *TRAIN])[0].regularization.hidden_dropout == 0.1


def gpt2_files(root: Path, extra: str = "") -> tuple[str, str]:
    root.mkdir(parents=True, exist_ok=True)
    vocab = {chr(c): i for i, c in enumerate(range(ord("a"), ord("z") + 1))}
    vocab["<|endoftext|>"] = len(vocab)
    if extra:
        vocab[extra] = vocab.pop("z")
    (root / "vocab.json").write_text(json.dumps(vocab))
    (root / "merges.txt").write_text("#version: 0.2\n")
    return str(root / "vocab.json"), str(root / "merges.txt")


def with_tokenizer(vocab: str, merges: str) -> Config:
    data = DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    return Config(model=LLAMA, data=data)


def test_another_tokenizer_is_a_notice_or_if_its_vocabulary_differs_an_error(tmp_path: Path) -> None:
    meta = {"config": with_tokenizer(*gpt2_files(tmp_path / "a")).to_dict()}
    assert tokenizer_notice(meta, with_tokenizer(*gpt2_files(tmp_path / "a")), "ck", "global_step0") is None
    assert tokenizer_notice(meta, with_tokenizer(*gpt2_files(tmp_path / "b")), "ck", "global_step0") is None  # a copy
    copy = gpt2_files(tmp_path / "b")
    Path(copy[1]).write_text("#version: 0.2\n\n")  # other bytes, the same vocabulary
    assert tokenizer_notice(meta, with_tokenizer(*copy), "ck", "global_step0") == (
        f"NOTICE: --load ck (global_step0) was trained with tokenizer GPT2BPETokenizer ({tmp_path / 'a' / 'vocab.json'}, "
        f"{tmp_path / 'a' / 'merges.txt'}); this run's GPT2BPETokenizer ({copy[0]}, {copy[1]}) has the same vocabulary"
    )
    other = with_tokenizer(*gpt2_files(tmp_path / "c", extra="@"))
    with pytest.raises(CheckpointError, match=r"has another vocabulary \(id 25 is 'z' vs '@'\); give the checkpoint's"):
        tokenizer_notice(meta, other, "ck", "global_step0")
    assert tokenizer_notice(meta, Config(model=LLAMA), "ck", "global_step0") is None  # --mock-data: nothing to compare


SFT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "megatron_deepspeed_sft"


@pytest.mark.parametrize(
    ("saved", "files"),
    [
        (
            DataConfig(
                tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(SFT / "tok_llama" / "tokenizer.model")
            ),
            "tok_llama",
        ),
        (
            DataConfig(
                tokenizer_type="GPT2BPETokenizer",
                vocab_file=str(SFT / "tok_gpt2" / "vocab.json"),
                merge_file=str(SFT / "tok_gpt2" / "merges.txt"),
            ),
            "tok_gpt2",
        ),
    ],
)
def test_a_hugging_face_directory_of_the_imported_tokenizer_has_its_vocabulary(saved: DataConfig, files: str) -> None:
    """An HF import records the SentencePiece model (or GPT-2 files) it copied; fine-tuning then reads the HF directory
    with HFTokenizer. The pieces are compared, not their decoded text (SentencePiece decodes <unk> as ' ⁇ ' and
    control tokens as '', transformers as '<unk>', '<s>')."""
    pytest.importorskip("transformers")
    meta = {"config": Config(model=LLAMA, data=saved).to_dict()}
    for kind in ("HFTokenizer", "HuggingFaceTokenizer"):
        ours = Config(model=LLAMA, data=DataConfig(tokenizer_type=kind, tokenizer_model=str(SFT / files)))
        notice = tokenizer_notice(meta, ours, "ck", "global_step0")
        assert notice is not None and notice.endswith(f"this run's {kind} ({SFT / files}) has the same vocabulary")


def test_nccl_without_gpus_is_a_one_line_error_before_any_process_group() -> None:
    from megatron_ds.estimate.machine import CPU

    with pytest.raises(ValueError, match="--distributed-backend nccl needs GPUs"):
        parse_config(
            [
                "--num-layers",
                "2",
                "--hidden-size",
                "32",
                "--num-attention-heads",
                "4",
                "--seq-length",
                "16",
                "--vocab-size",
                "128",
                "--distributed-backend",
                "nccl",
                *TRAIN,
            ],
            machine=CPU,
        )


def test_the_tokenizer_comes_from_the_checkpoint_unless_megatron_lms_flag_says_no(tmp_path: Path) -> None:
    """--use-checkpoint-args takes the tokenizer with the architecture when the line names none (moved files are
    found in the checkpoint's tokenizer directory); Megatron-LM's --no-use-tokenizer-model-from-checkpoint-args
    keeps the architecture and leaves the tokenizer to the line."""
    model_file = tmp_path / "tok" / "tokenizer.model"
    model_file.parent.mkdir()
    model_file.write_bytes(sentencepiece_model(200))  # a minimal model file of 200 pieces
    data = DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(model_file))
    load = checkpoint(tmp_path / "ck", Config(model=LLAMA, data=data))
    args = ["--use-checkpoint-args", "--load", load, *TRAIN]
    taken = parse_config(args)[0]
    assert (taken.data.tokenizer_type, taken.data.tokenizer_model) == ("SentencePieceTokenizer", str(model_file))
    kept = parse_config([*args, "--no-use-tokenizer-model-from-checkpoint-args"])[0]
    assert kept.model == LLAMA and kept.data.tokenizer_type is None
