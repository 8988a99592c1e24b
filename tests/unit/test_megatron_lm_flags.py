"""Megatron-LM's flags and the model options they need: each maps onto the config with Megatron-LM's
meaning, changes nothing (and the model is the same), or is a one-line error; partial rotary and the
zero-centred norms compute what Megatron computes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from megatron_ds.errors import ConfigError, UserError
from megatron_ds.flags import compat
from megatron_ds.flags.parser import parse_config
from megatron_ds.model import norms
from megatron_ds.model.rotary import apply_rotary, rotary_angles

BASE = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--vocab-size", "128", "--train-iters", "10", "--lr", "1e-3",
]  # fmt: skip


def parse(*argv: str, world_size: int = 1):
    return parse_config([*BASE, *argv], world_size=world_size)[0]


def error(*argv: str, world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as err:
        parse(*argv, world_size=world_size)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize(
    "argv,name",
    [
        (["--normalization", "LayerNorm"], "layernorm"),
        (["--normalization", "RMSNorm"], "rmsnorm"),
        (["--normalization", "RMSNorm", "--apply-layernorm-1p"], "rmsnorm1p"),
        (["--normalization", "LayerNorm", "--apply-layernorm-1p"], "layernorm1p"),
        (["--apply-layernorm-1p"], "layernorm1p"),  # Megatron-DeepSpeed's LayerNorm1P
        (["--normalization", "rmsnorm1p"], "rmsnorm1p"),
    ],
)
def test_norm_spellings(argv: list[str], name: str) -> None:
    assert parse(*argv).model.normalization == name


def test_megatron_deepspeeds_rmsnorm_ignores_1p_with_a_warning(capsys: pytest.CaptureFixture) -> None:
    assert parse("--normalization", "rmsnorm", "--apply-layernorm-1p").model.normalization == "rmsnorm"
    assert "Megatron-DeepSpeed zero-centres LayerNorm only" in capsys.readouterr().err


@pytest.mark.parametrize("name", [n for n, e in norms.REGISTRY.items() if e.zero_centered_gamma])
def test_zero_centered_norm_is_its_base_with_weight_plus_one(name: str) -> None:
    entry = norms.find(name)
    base = next(n for n in norms.REGISTRY.values() if n.megatron_lm == entry.megatron_lm and not n.zero_centered_gamma)
    ours, theirs = entry.module(32, 1e-5), base.module(32, 1e-5)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(0.1 * torch.randn(p.shape))
        theirs.weight.copy_(ours.weight + 1)
        if "bias" in entry.stored_keys:
            theirs.bias.copy_(ours.bias)
    x = torch.randn(3, 5, 32, requires_grad=True)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-6)
    ours(x).pow(2).sum().backward()
    assert ours.weight.grad is not None and ours.weight.grad.abs().sum() > 0


def test_position_embedding_type() -> None:
    rope = parse("--position-embedding-type", "rope").model
    assert rope.use_rotary_position_embeddings and not rope.add_position_embedding
    assert rope == parse("--use-rotary-position-embeddings").model
    learned = parse("--position-embedding-type", "learned_absolute").model
    assert learned == parse().model and learned.add_position_embedding
    none = parse("--position-embedding-type", "none").model
    assert not none.add_position_embedding and not none.use_rotary_position_embeddings
    assert "disagree" in error("--use-rotary-position-embeddings", "--position-embedding-type", "learned_absolute")
    assert error("--position-embedding-type", "mrope") == compat.refusal_message("--position-embedding-type", "mrope")


def test_group_query_attention() -> None:
    assert parse("--group-query-attention", "--num-query-groups", "2").model.kv_heads == 2
    assert parse("--group-query-attention").model.kv_heads == 1  # megatron-core's default of 1 group
    assert parse("--num-query-groups", "2").model.kv_heads == 4  # ignored without --group-query-attention
    assert "disagree" in error("--group-query-attention", "--num-query-groups", "2", "--num-key-value-heads", "1")


def test_distributed_optimizer_is_zero_1() -> None:
    assert parse("--use-distributed-optimizer").training.zero_stage == 1
    assert parse("--use-distributed-optimizer", "--zero-stage", "1").training.zero_stage == 1
    assert parse().training.zero_stage == 0
    assert "is ZeRO stage 1 here but --zero-stage is 0" in error("--use-distributed-optimizer", "--zero-stage", "0")


def test_modes_that_change_nothing_here(capsys: pytest.CaptureFixture) -> None:
    same = [
        "--use-mcore-models", "--transformer-impl", "local", "--attention-backend", "flash", "--overlap-grad-reduce",
        "--overlap-param-gather", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion", "--log-throughput",
        "--context-parallel-size", "1", "--sequence-parallel",
        "--tiktoken-pattern", "v2", "--no-create-attention-mask-in-dataloader",
    ]  # fmt: skip
    assert parse(*same) == parse()
    assert "--sequence-parallel changes nothing at --tensor-model-parallel-size 1" in capsys.readouterr().out
    assert parse("--transformer-impl", "transformer_engine", "--attention-backend", "unfused") == parse()
    assert "invalid choice" in error("--attention-backend", "cudnn")
    assert parse("--sequence-parallel", "--tensor-model-parallel-size", "2", world_size=2).parallel.sequence_parallel
    assert "--context-parallel-size 2 is not supported" in error("--context-parallel-size", "2")
    assert "--calculate-per-token-loss with --eod-mask-loss" in error("--calculate-per-token-loss", "--eod-mask-loss")
    assert parse("--calculate-per-token-loss").training.calculate_per_token_loss
    assert "ZeRO keeps the reduced gradients" in error("--log-num-zeros-in-grad", "--use-distributed-optimizer")


def test_ckpt_format_says_what_is_written(capsys: pytest.CaptureFixture) -> None:
    assert parse("--ckpt-format", "torch_dist") == parse()
    assert "NOTICE: --ckpt-format torch_dist: checkpoints are written in DeepSpeed's format" in capsys.readouterr().out


def test_fp8_is_refused_in_one_line() -> None:
    message = error("--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-param-gather")
    assert message.count("FP8 training runs on Transformer Engine") == 3 and message.startswith("--fp8-format ")


def test_rotary_percent(capsys: pytest.CaptureFixture) -> None:
    m = parse("--use-rotary-position-embeddings", "--rotary-percent", "0.5").model
    assert (m.rotary_percent, m.rotary_dim) == (0.5, 4)
    assert parse("--rotary-percent", "0.5").model.rotary_percent == 1.0  # no rotary: one spelling
    assert "--rotary-percent 0.5 only applies with --use-rotary-position-embeddings" in capsys.readouterr().err
    rope = ["--use-rotary-position-embeddings", "--rotary-percent"]
    assert "must be in (0, 1]" in error(*rope, "0") and "must be in (0, 1]" in error(*rope, "1.5")
    assert "gives 1 rotary channels" in error(*rope, "0.2")  # head size 8: int(1.6) = 1, not a pair


def test_rope_scaling_flags(capsys: pytest.CaptureFixture) -> None:
    rope = ["--use-rotary-position-embeddings", "--use-rope-scaling"]
    m = parse(*rope).model
    assert (m.use_rope_scaling, m.rope_scaling_factor) == (True, 8.0)  # Megatron-LM's default factor
    assert parse(*rope, "--rope-scaling-factor", "32").model.rope_scaling_factor == 32.0
    assert parse("--position-embedding-type", "rope", "--use-rope-scaling").model.use_rope_scaling
    assert parse("--use-rope-scaling").model == parse().model  # no rotary embeddings: nothing to scale
    assert "--use-rope-scaling only applies with --use-rotary-position-embeddings; ignored" in capsys.readouterr().err
    plain = parse("--use-rotary-position-embeddings").model
    assert parse("--use-rotary-position-embeddings", "--rope-scaling-factor", "4").model == plain
    assert "--rope-scaling-factor 4 only applies with --use-rope-scaling; ignored" in capsys.readouterr().err
    assert "--rope-scaling-factor 0.0 must be > 0" in error(*rope, "--rope-scaling-factor", "0")
    assert parse(*rope).model != plain  # another model: a checkpoint of one does not resume as the other
    for fused in ("--no-rope-fusion", "--no-bias-swiglu-fusion"):
        assert parse(*rope, fused).model == parse(*rope).model


def reference_rotary(x: torch.Tensor, rotary_dim: int, base: float) -> torch.Tensor:
    """Megatron's partial rotary written as complex multiplication: pair (x_i, x_{i+r/2}) of the first r
    channels times exp(i p theta_i), theta_i = base^(-2i/r); channels r.. unchanged."""
    b, h, s, d = x.shape
    half = rotary_dim // 2
    theta = base ** (-torch.arange(half, dtype=torch.float64) * 2 / rotary_dim)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * theta[None, :]  # (s, r/2)
    z = torch.complex(x[..., :half].double(), x[..., half:rotary_dim].double()) * torch.polar(
        torch.ones_like(angle), angle
    )
    return torch.cat((z.real, z.imag, x[..., rotary_dim:].double()), dim=-1)


@pytest.mark.parametrize("rotary_dim", [16, 8, 4])
def test_partial_rotary_is_megatrons(rotary_dim: int) -> None:
    x = torch.randn(2, 3, 5, 16, dtype=torch.float64)
    out = apply_rotary(x, rotary_angles(5, rotary_dim, x.device, 10000.0).double())
    torch.testing.assert_close(out, reference_rotary(x, rotary_dim, 10000.0), rtol=0, atol=1e-6)
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])


def test_null_tokenizer_is_megatron_cores() -> None:
    data = parse("--tokenizer-type", "NullTokenizer", "--vocab-size", "100")
    assert data.model.vocab_size == 128 and data.data.null_tokenizer_vocab_size == 100
    from megatron_ds.data.tokenizer import build_tokenizer

    tok = build_tokenizer("NullTokenizer", vocab_size=data.data.null_tokenizer_vocab_size)
    assert (tok.vocab_size, tok.eod) == (100, 99)  # megatron-core's NullTokenizer: eod the last id
    argv = [a for a in BASE if a not in ("--vocab-size", "128")]
    with pytest.raises(UserError, match="--vocab-size is required with --tokenizer-type NullTokenizer"):
        parse_config([*argv, "--tokenizer-type", "NullTokenizer"], world_size=1)


def test_null_tokenizer_ids_are_megatron_lms_flags() -> None:
    from megatron_ds.data.tokenizer import build_tokenizer

    argv = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    data = parse(*argv, "--null-tokenizer-eod-id", "0", "--null-tokenizer-pad-id", "7").data
    assert (data.null_tokenizer_eod_id, data.null_tokenizer_pad_id, data.data_upstream) == (0, 7, "megatron-lm")
    tok = build_tokenizer("NullTokenizer", vocab_size=100, null_eod_id=0, null_pad_id=7)
    assert (tok.vocab_size, tok.eod, tok.pad) == (100, 0, 7)
    assert dict(tok.unique_identifiers) == {"class": "NullTokenizer", "vocab_size": 100, "eod_id": 0, "pad_id": 7}
    for extra, message in (
        (["--null-tokenizer-eod-id", "100"], "--null-tokenizer-eod-id 100: outside the tokenizer's ids [0, 100)"),
        (["--null-tokenizer-pad-id", "-2"], "--null-tokenizer-pad-id -2 must be >= -1"),
    ):
        with pytest.raises(UserError, match=re.escape(message)):
            parse(*argv, *extra)
    with pytest.raises(UserError, match="--null-tokenizer-pad-id 3: it sets an id of --tokenizer-type NullTokenizer"):
        parse("--null-tokenizer-pad-id", "3")
    from megatron_ds.training.resolve_layout import null_tokenizer_notice

    # Megatron-DeepSpeed's line: its NullTokenizer has one id more, which the launch and --print-layout print
    assert null_tokenizer_notice(parse(*argv)) == (
        "NOTICE: --tokenizer-type NullTokenizer --vocab-size 100: ids 0..99, end-of-document 99, as megatron-core's "
        "NullTokenizer; Megatron-DeepSpeed's has 101 ids, end-of-document 100: give --vocab-size 101 for its model"
    )
    assert null_tokenizer_notice(parse(*argv, "--null-tokenizer-pad-id", "5")) is None  # a Megatron-LM line
    assert null_tokenizer_notice(parse(*argv, "--load", "/ckpt")) is None  # the checkpoint's vocabulary


def test_hugging_face_tokenizer_reads_a_local_directory(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from megatron_ds.data.tokenizer import GPT2BPETokenizer, _bytes_to_unicode, build_tokenizer
    from megatron_ds.interop.hf_tokenizer import export_tokenizer

    vocab = {s: i for i, s in enumerate(_bytes_to_unicode().values())}
    vocab["he"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\nh e\n")
    ours = GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    export_tokenizer(ours, str(hf_dir), 16)
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(hf_dir))
    assert (tok.vocab_size, tok.eod) == (ours.vocab_size, ours.eod)
    assert tok.tokenize("hello there") == ours.tokenize("hello there")
    argv = [a for a in BASE if a not in ("--vocab-size", "128")]
    config = parse_config([*argv, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf_dir)], 1)[0]
    assert config.model.vocab_size == 384  # 258 tokens padded to a multiple of 128
    assert tok.vocab_size == 258
    with pytest.raises(UserError, match="not a directory; HuggingFaceTokenizer reads a local tokenizer directory"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="not a Hugging Face tokenizer"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "empty"))


def test_profile_and_manual_gc_flags() -> None:
    c = parse("--profile", "--profile-step-start", "2", "--profile-step-end", "4", "--profile-ranks", "0", "1")
    assert (c.logging.profile, c.logging.profile_step_start, c.logging.profile_step_end) == (True, 2, 4)
    assert c.logging.profile_ranks == (0, 1) and parse().logging.profile_ranks == ()
    assert "--profile-step-end 3 must be above --profile-step-start 3" in error(
        "--profile", "--profile-step-start", "3", "--profile-step-end", "3"
    )
    t = parse("--manual-gc", "--manual-gc-interval", "5", "--no-manual-gc-eval").training
    assert (t.manual_gc, t.manual_gc_interval, t.manual_gc_eval) == (True, 5, False)
    assert "--manual-gc-interval -1 must be >= 0" in error("--manual-gc-interval", "-1")
    assert parse("--no-mmap-bin-files").data.mmap_bin_files is False
