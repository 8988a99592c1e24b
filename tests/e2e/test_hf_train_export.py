"""Train -> export -> transformers, and transformers -> import -> train, end to end on CPU.

Four launches: a GPT at P=3 with dedicated embedding stages and a Llama-style model with grouped-query attention
at P=2 x T=2 (each shared by the tests of this module), training at P=3 from a Llama that transformers created, and
at expert-parallel size 2 from its Mixtral. Logits are compared in fp32 (<= 1e-4), weights to the bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from megatron_ds.errors import UserError  # noqa: E402
from megatron_ds.inference import generate, load_model  # noqa: E402
from megatron_ds.interop.hf_export import export_hf  # noqa: E402
from megatron_ds.interop.hf_import import import_hf  # noqa: E402
from megatron_ds.testing.pretrain_runs import run_pretrain_gpt  # noqa: E402
from megatron_ds.testing.script_runs import run_python  # noqa: E402
from megatron_ds.training.checkpoint import reader as checkpoint_reader  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 200  # padded to 256 by --make-vocab-size-divisible-by 128
COMMON = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--max-position-embeddings", "64", "--vocab-size", str(VOCAB), "--micro-batch-size", "2",
    "--global-batch-size", "4", "--mock-data", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
    "--distributed-timeout-minutes", "2",
]  # fmt: skip
LLAMA = [
    "--normalization", "rmsnorm", "--swiglu", "--use-rotary-position-embeddings", "--no-position-embedding",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--num-key-value-heads", "2",
    "--ffn-hidden-size", "48", "--layernorm-epsilon", "1e-6",
]  # fmt: skip


def pretrain(nproc: int, *argv: str) -> str:
    out = run_pretrain_gpt(nproc, argv, timeout=400, cwd=str(ROOT))
    assert out.returncode == 0, out.stdout[-4000:]
    return out.stdout


@pytest.fixture(scope="module")
def gpt_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    save = tmp_path_factory.mktemp("gpt") / "ckpt"
    pretrain(3, *COMMON, "--train-iters", "3", "--lr", "1e-2", "--pipeline-model-parallel-size", "3",
             "--pp-dedicated-embedding-stages", "both", "--save", str(save))  # fmt: skip
    return save


@pytest.fixture(scope="module")
def llama_t2_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    save = tmp_path_factory.mktemp("llama") / "ckpt"
    out = pretrain(4, *COMMON, *LLAMA, "--train-iters", "3", "--lr", "1e-2", "--pipeline-model-parallel-size", "2",
                   "--tensor-model-parallel-size", "2", "--save", str(save))  # fmt: skip
    # DeepSpeed's pipeline engine cuts activations across the tensor ranks between stages with a collective torch
    # 2.13 renamed: its deprecation warning is quieted (tensor_parallel_layers._quiet_collective_renames)
    assert "FutureWarning" not in out
    return save


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(0))


def _compare_with_transformers(ckpt: Path, hf_dir: Path) -> None:
    ours = load_model(str(ckpt), vocab_size=VOCAB)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()  # from the directory only
    with torch.no_grad():
        diff = (ours(_tokens()) - theirs(_tokens()).logits).abs().max().item()
    assert diff <= 1e-4, diff
    prompt = [11, 22, 33]
    hf_greedy = theirs.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, 3:].tolist()
    assert generate(ours, prompt, 20, temperature=0.0) == hf_greedy


def test_gpt_export_through_the_cli_matches_transformers(gpt_ckpt: Path, tmp_path: Path) -> None:
    tool = [str(ROOT / "tools" / "convert_checkpoint.py")]
    out = run_python(
        [*tool, "--to", "hf", str(gpt_ckpt), str(tmp_path / "hf"), "--vocab-size", str(VOCAB)], timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "as Hugging Face gpt2 (28 tensors, vocabulary 200)" in out.stdout
    _compare_with_transformers(gpt_ckpt, tmp_path / "hf")
    gen = run_python(
        [str(ROOT / "tools" / "generate.py"), "--load", str(gpt_ckpt), "--prompt-ids", "11 22 33",
         "--greedy", "--max-new-tokens", "20", "--vocab-size", str(VOCAB)],
        timeout=300,
    )  # fmt: skip
    assert gen.returncode == 0, gen.stderr
    ours = load_model(str(gpt_ckpt), vocab_size=VOCAB)
    assert gen.stdout.split() == [str(i) for i in generate(ours, [11, 22, 33], 20, temperature=0.0)]


def test_generate_refuses_a_tokenizer_larger_than_the_model(gpt_ckpt: Path, tmp_path: Path, capsys) -> None:
    """A --tokenizer-* override with more tokens than the model has rows is one line up front, not a prompt
    error later (or a silent run)."""
    from megatron_ds.data.demo_corpus import _load_tool
    from megatron_ds.data.tokenizer_training import train_sentencepiece

    words = [f"w{i} x{i * 7} y{i * 13} z{i * 31} q{i * 17}" for i in range(1000)]
    model = train_sentencepiece(words, str(tmp_path / "big"), VOCAB + 100, model_type="unigram")
    argv = ["--load", str(gpt_ckpt), "--prompt", "w1", "--max-new-tokens", "2", "--vocab-size", str(VOCAB)]
    argv += ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model]
    assert _load_tool("generate").main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: --tokenizer-type SentencePieceTokenizer --tokenizer-model {model}: the tokenizer has {VOCAB + 100} "
        f"tokens, the model {gpt_ckpt} {VOCAB} vocabulary rows; give the tokenizer the model was trained with"
    ), err


def test_gpt_round_trip_is_bit_identical(gpt_ckpt: Path, tmp_path: Path) -> None:
    export_hf(str(gpt_ckpt), str(tmp_path / "hf"), vocab_size=VOCAB, show_progress=False)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "back"), ["--seq-length", "16"], show_progress=False)
    original = checkpoint_reader.iter_tensors(checkpoint_reader.open_checkpoint(str(gpt_ckpt)))
    back = checkpoint_reader.iter_tensors(checkpoint_reader.open_checkpoint(str(tmp_path / "back")))
    count = 0
    for a, b in zip(original, back, strict=True):
        assert (a.index, a.key) == (b.index, b.key)
        rows = VOCAB if a.rule.vocab else None
        assert torch.equal(a.tensor[:rows], b.tensor[:rows]), (a.spec, a.key)
        if rows:
            assert not b.tensor[VOCAB:].any()  # padding comes back as zero rows
        count += 1
    assert count == 28


def test_llama_gqa_at_tensor_parallel_2_exports_exactly(llama_t2_ckpt: Path, tmp_path: Path) -> None:
    result = export_hf(str(llama_t2_ckpt), str(tmp_path / "hf"), vocab_size=VOCAB, show_progress=False)
    assert result.arch == "llama"
    _compare_with_transformers(llama_t2_ckpt, tmp_path / "hf")
    # Importing at T=2 writes exactly the files, keys and shapes training at T=2 wrote.
    import_hf(str(tmp_path / "hf"), str(tmp_path / "back"), ["--tensor-model-parallel-size", "2"], show_progress=False)
    trained = sorted((llama_t2_ckpt / "global_step3").glob("layer_*"))
    imported = sorted((tmp_path / "back" / "global_step0").glob("layer_*"))
    assert [p.name for p in trained] == [p.name for p in imported]
    for a, b in zip(trained, imported):
        sa, sb = (torch.load(p, weights_only=True) for p in (a, b))
        shapes = [{k: getattr(v, "shape", v) for k, v in s.items()} for s in (sa, sb)]
        assert shapes[0] == shapes[1], a.name


def test_a_mixtral_trains_here_and_exports_back_exactly(tmp_path: Path) -> None:
    """transformers' Mixtral (4 experts on both layers, top-2) imported, trained 2 iterations on 2 ranks at pipeline
    size 2 (each stage's layer taking its experts from the import's universal form; saved in DeepSpeed's per-stage
    expert files) with a learning rate too small to move a weight, and exported: the same tensors to the bit, in the
    Hub's layout, and transformers' logits are our model's. (Expert-parallel checkpoints are read by the same reader:
    tests/dist/test_moe_expert_parallel.py generates from one.)"""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, max_position_embeddings=64, initializer_range=0.05,
    )  # fmt: skip
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path / "hf")
    result = import_hf(str(tmp_path / "hf"), str(tmp_path / "imported"), [], show_progress=False)
    assert result.arch == "mixtral" and "--disable-moe-token-dropping" in result.train_flags
    log = pretrain(2, *result.train_flags, "--load", str(tmp_path / "imported"), "--save", str(tmp_path / "trained"),
                   *COMMON, "--train-iters", "2", "--lr", "1e-30", "--pipeline-model-parallel-size", "2")  # fmt: skip
    assert "holds weights only: optimizer and learning-rate schedule start fresh" in log
    assert "transformer layers per stage: 1 1" in log, log[-3000:]
    assert (tmp_path / "trained" / "global_step2" / "layer_0_expert_3_mp_rank_01_model_states.pt").is_file()
    exported = export_hf(str(tmp_path / "trained"), str(tmp_path / "again"), show_progress=False)
    assert exported.arch == "mixtral" and exported.num_tensors == 3 + 2 * (4 + 2 + 1 + 3 * 4)
    original, again = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "again"))
    assert original.keys() == again.keys()
    assert [k for k in original if not torch.equal(original[k], again[k])] == []
    _, loading = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again", output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    _compare_with_transformers(tmp_path / "trained", tmp_path / "again")


def test_training_continues_from_an_imported_llama(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.05,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    result = import_hf(str(tmp_path / "hf"), str(tmp_path / "imported"), [], show_progress=False)
    # Two steps at P=3 with ZeRO-1 and a learning rate too small to move a weight: the weights the
    # run saves must be the imported ones to the bit (ZeRO's fp32 copy is refreshed on load).
    log = pretrain(3, *result.train_flags, "--load", str(tmp_path / "imported"), "--save", str(tmp_path / "trained"),
                   *COMMON, "--train-iters", "2", "--lr", "1e-30", "--zero-stage", "1", "--pipeline-model-parallel-size",
                   "3", "--pp-dedicated-embedding-stages", "both")  # fmt: skip
    assert "holds weights only: optimizer and learning-rate schedule start fresh" in log
    assert "resumed from" in log and "at iteration 0" in log
    # --mock-data draws ids below --vocab-size: the import's zero padding rows (200-255) are never looked up.
    # Drawn from all 256 rows, RMSNorm of a zero embedding row made the gradient norm about 180 (about 0.75 here).
    norms = [float(x.split("|")[0]) for x in log.split("grad norm: ")[1:]]
    assert len(norms) == 2 and max(norms) < 5, norms
    # The run records its vocabulary (--vocab-size): the export needs no --vocab-size to drop the padding.
    exported = export_hf(str(tmp_path / "trained"), str(tmp_path / "again"), show_progress=False)
    assert exported.vocab_size == VOCAB
    with pytest.raises(
        UserError, match=f"records {VOCAB} tokens, so rows 150 to {VOCAB - 1} are tokens that would be cut"
    ):
        export_hf(str(tmp_path / "trained"), str(tmp_path / "cut"), vocab_size=150, show_progress=False)
    original, again = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(tmp_path / "again" / "model.safetensors"),
    )
    assert original.keys() == again.keys()
    assert [k for k in original if not torch.equal(original[k], again[k])] == []


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_load_refuses_a_damaged_or_pickled_layer_file_in_one_line(tmp_path: Path) -> None:
    """DeepSpeed's loader reads layer files with weights_only=False and asserts on a missing one: each file this rank
    loads is read tensors-only first, so a missing one is named and one holding code is refused before it runs."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    result = import_hf(str(tmp_path / "hf"), str(tmp_path / "ck"), [], show_progress=False)
    layer = tmp_path / "ck" / "global_step0" / "layer_03-model_00-model_states.pt"
    state = torch.load(layer, weights_only=True)
    torch.save({**state, "x": _RunsCode(tmp_path / "ran")}, layer)
    missing = tmp_path / "ck" / "global_step0" / "layer_04-model_00-model_states.pt"
    missing.rename(tmp_path / "aside.pt")
    argv = [*result.train_flags, "--load", str(tmp_path / "ck"), *COMMON, "--train-iters", "1", "--lr", "1e-3"]
    out = run_pretrain_gpt(1, argv, timeout=300, cwd=str(ROOT))
    assert out.returncode != 0 and "Traceback" not in out.stdout, out.stdout[-3000:]
    assert f"error: {layer}: holds a pickled posix.system, which such a file does not hold; refused" in out.stdout
    assert not (tmp_path / "ran").exists()
    torch.save(state, layer)  # clean again: the missing file is named next
    out = run_pretrain_gpt(1, argv, timeout=300, cwd=str(ROOT))
    assert f"error: {missing}: missing; the checkpoint is incomplete" in out.stdout and "Traceback" not in out.stdout
