"""Hugging Face import/export in one process, against models `transformers` itself creates and saves."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from megatron_ds.data.demo_corpus import _load_tool  # noqa: E402
from megatron_ds.errors import UserError  # noqa: E402
from megatron_ds.inference import generate, load_model  # noqa: E402
from megatron_ds.interop.hf_export import export_hf  # noqa: E402
from megatron_ds.interop.hf_import import import_hf  # noqa: E402
from megatron_ds.testing.script_runs import run_python  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"vocab_size": 200, "initializer_range": 0.1}
GPT2_LAYERS = {"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64}
LAYERS = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4}
"""The Llama-layout test models' shape (the rope-scaling one has its own)."""
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(**GPT2_LAYERS, activation_function="gelu", **SMALL),
    "gpt2_gelu_new": lambda: transformers.GPT2Config(**GPT2_LAYERS, **SMALL),
    "gpt2_relu2": lambda: transformers.GPT2Config(  # --squared-relu
        **GPT2_LAYERS, activation_function="relu2", **SMALL
    ),
    "llama_gqa": lambda: transformers.LlamaConfig(
        **LAYERS,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=500000.0,  # Llama-3's base
        **SMALL,
    ),
    "llama32_rope_scaling": lambda: transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,  # head size 32: frequencies in all three of the scaling's bands
        num_key_value_heads=1,
        max_position_embeddings=16384,  # transformers warns below the original 8192
        rope_theta=500000.0,
        rope_scaling={  # Llama 3.2 1B/3B's (--use-rope-scaling --rope-scaling-factor 32)
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        **SMALL,
    ),
    "phi3_partial_rotary": lambda: transformers.Phi3Config(
        **LAYERS,
        num_key_value_heads=2,
        max_position_embeddings=64,
        partial_rotary_factor=0.5,  # --rotary-percent 0.5
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        **SMALL,
    ),
    "qwen2": lambda: transformers.Qwen2Config(  # q/k/v biases: --disable-bias-linear --add-qkv-bias
        **LAYERS,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=1000000.0,  # Qwen2.5's base
        **SMALL,
    ),
    "tied_qwen2": lambda: transformers.Qwen2Config(
        **LAYERS,
        num_key_value_heads=4,  # Qwen2Config's default is 32 whatever the heads
        max_position_embeddings=64,
        tie_word_embeddings=True,
        use_sliding_window=True,  # on layers from max_window_layers 1 on, but no shorter than --seq-length 32
        sliding_window=32,
        max_window_layers=1,
        **SMALL,
    ),
    "qwen3": lambda: transformers.Qwen3Config(  # per-head q/k RMSNorms: --qk-layernorm, no biases
        **LAYERS,
        num_key_value_heads=2,
        head_dim=8,  # hidden_size / heads (Qwen3Config's default is 128)
        max_position_embeddings=64,
        rope_theta=1000000.0,  # Qwen3's base
        **SMALL,
    ),
    "tied_qwen3": lambda: transformers.Qwen3Config(
        **LAYERS,
        num_key_value_heads=4,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=True,  # Qwen3-0.6B's
        **SMALL,
    ),
    "qwen3_head_dim": lambda: transformers.Qwen3Config(  # head_dim 12, not 32 / 4 (as Qwen3-0.6B's 128, not 64)
        **LAYERS,
        num_key_value_heads=2,
        head_dim=12,  # --kv-channels 12: q_proj 32 -> 48, o_proj 48 -> 32, q/k norms and rotary over 12
        max_position_embeddings=64,
        rope_theta=1000000.0,
        **SMALL,
    ),
    "llama_head_dim": lambda: transformers.LlamaConfig(  # a head smaller than hidden / heads
        **LAYERS,
        num_key_value_heads=2,
        head_dim=6,
        max_position_embeddings=64,
        **SMALL,
    ),
    "mistral": lambda: transformers.MistralConfig(
        **LAYERS,
        num_key_value_heads=2,
        max_position_embeddings=64,
        sliding_window=32,  # Mistral 7B v0.1's 4096, scaled: covers --seq-length 32, so the same attention
        bos_token_id=None,
        eos_token_id=None,
        **SMALL,
    ),
    "tied_llama": lambda: transformers.LlamaConfig(
        **LAYERS,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
        **SMALL,
    ),
}


def _hf_model(config: object) -> object:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms and biases start at 1 and 0: move them so a mix-up shows
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


EXPECTED = {
    "gpt2": ("gelu", 10000.0),
    "gpt2_gelu_new": ("gelu_tanh", 10000.0),  # GPT-2's default activation_function
    "gpt2_relu2": ("squared_relu", 10000.0),
    "llama_gqa": ("swiglu", 500000.0),
    "llama32_rope_scaling": ("swiglu", 500000.0),
    "tied_llama": ("swiglu", 10000.0),
    "qwen2": ("swiglu", 1000000.0),
    "tied_qwen2": ("swiglu", 10000.0),
    "qwen3": ("swiglu", 1000000.0),
    "tied_qwen3": ("swiglu", 10000.0),
    "mistral": ("swiglu", 10000.0),
    "qwen3_head_dim": ("swiglu", 1000000.0),
    "llama_head_dim": ("swiglu", 10000.0),
    "phi3_partial_rotary": ("swiglu", 10000.0),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, make in CONFIGS.items():
        out[name] = tmp_path_factory.mktemp(name) / "hf"
        _hf_model(make()).save_pretrained(out[name])
    return out


def _tokens() -> torch.Tensor:
    return torch.randint(0, 200, (3, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_import_equals_transformers_and_exports_back_bit_identical(
    name: str, hf_dirs: dict[str, Path], tmp_path: Path
) -> None:
    hf_dir = hf_dirs[name]
    result = import_hf(str(hf_dir), str(tmp_path / "ours"), ["--seq-length", "32"], show_progress=False)
    assert "--vocab-size" in result.train_flags and result.config.model.vocab_size == 256  # padded to 128
    model = result.config.model
    assert (model.activation, model.rotary_base) == EXPECTED[name]
    assert model.rotary_percent == (0.5 if name.startswith("phi3") else 1.0)
    assert (model.use_rope_scaling, model.rope_scaling_factor) == (
        (True, 32.0) if "rope_scaling" in name else (False, 8.0)
    )
    ours = load_model(str(tmp_path / "ours"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        diff = (ours(_tokens()) - reference(_tokens()).logits).abs().max().item()
    assert diff <= (1e-5 if "qwen3" in name or "head_dim" in name else 1e-4), diff
    if "head_dim" in name:  # --kv-channels other than hidden / heads
        assert model.head_dim == reference.config.head_dim != 32 // 4 and "--kv-channels" in result.train_flags
    prompt = [5, 6, 7]
    hf_greedy = reference.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert generate(ours, prompt, 20, temperature=0.0) == hf_greedy[0, 3:].tolist()
    export_hf(str(tmp_path / "ours"), str(tmp_path / "back"), show_progress=False)
    original, back = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    if not name.startswith("gpt2"):
        assert original.keys() == back.keys()
    assert all(torch.equal(original[k], back[k]) for k in back)  # GPT-2's file also holds attn.bias buffers
    if not name.startswith(("gpt2", "phi3")):
        head_dim = getattr(reference.config, "head_dim", None) or 32 // 4  # Qwen2Config has none by default
        assert json.loads((tmp_path / "back" / "config.json").read_text())["head_dim"] == head_dim


@pytest.mark.parametrize("name", ["llama_gqa", "qwen3", "qwen3_head_dim"])  # Qwen3's q/k norms: one per tensor rank
def test_tensor_parallel_import_gathers_to_the_same_model(name: str, hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    one = import_hf(str(hf_dirs[name]), str(tmp_path / "t1"), [], show_progress=False)
    two = import_hf(
        str(hf_dirs[name]), str(tmp_path / "t2"), ["--tensor-model-parallel-size", "2"], show_progress=False
    )
    assert (one.config.parallel.tensor_model_parallel_size, two.config.parallel.tensor_model_parallel_size) == (1, 2)
    assert two.config.model.vocab_size == 256  # 128 x T
    a, b = load_model(str(tmp_path / "t1")), load_model(str(tmp_path / "t2"))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert len(list((tmp_path / "t2" / "global_step0").glob("layer_03-model_0*-model_states.pt"))) == 2


def _nothing_written(tmp_path: Path, before: set[str]) -> None:
    assert set(os.listdir(tmp_path)) == before, "a failed conversion left files behind"


def _error(fn: object, *args: object) -> str:
    with pytest.raises(UserError) as err:
        fn(*args)  # type: ignore[operator]
    assert "\n" not in str(err.value)
    return str(err.value)


def test_bad_inputs_are_one_line_errors_and_write_nothing(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    before = set(os.listdir(tmp_path))
    out = str(tmp_path / "out")
    assert "config.json: missing" in _error(import_hf, str(broken), out, [])
    (broken / "config.json").write_text("{not json")
    assert "config.json: not valid JSON" in _error(import_hf, str(broken), out, [])
    hf = json.loads((hf_dirs["gpt2"] / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**hf, "activation_function": "quick_gelu"}))
    assert "activation_function 'quick_gelu' is not supported" in _error(import_hf, str(broken), out, [])
    (broken / "config.json").write_text(json.dumps({**hf, "model_type": "gpt_neox"}))
    assert "model_type 'gpt_neox'" in _error(import_hf, str(broken), out, [])
    (broken / "config.json").write_text(json.dumps(hf))
    data = (hf_dirs["gpt2"] / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "model.safetensors: unreadable" in _error(import_hf, str(broken), out, [])
    assert "--num-layers 3 contradicts" in _error(import_hf, str(hf_dirs["gpt2"]), out, ["--num-layers", "3"])
    _nothing_written(tmp_path, before)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("keep")
    assert "already exists" in _error(import_hf, str(hf_dirs["gpt2"]), str(tmp_path / "taken"), [])
    assert (tmp_path / "taken" / "x").read_text() == "keep"


def test_a_hugging_face_directory_given_as_a_checkpoint_says_to_import_it(hf_dirs: dict[str, Path]) -> None:
    from megatron_ds.training.checkpoint.reader import open_checkpoint

    source = hf_dirs["gpt2"]
    assert _error(open_checkpoint, str(source)) == (
        f"{source}: a Hugging Face model directory (config.json), not a checkpoint; import it first with "
        f"python tools/convert_checkpoint.py --from hf {source} OUT"
    )


def test_a_longer_sequence_raises_a_rotary_models_positions_but_not_a_learned_table(
    hf_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """The advice to raise --max-position-embeddings was then refused as contradicting config.json: a rotary model
    has no weight of that size, so the flag is taken (and printed for training); GPT-2's table is refused plainly."""
    flags = ["--seq-length", "128", "--max-position-embeddings", "128"]
    result = import_hf(str(hf_dirs["llama_gqa"]), str(tmp_path / "llama"), flags, show_progress=False)
    assert result.config.model.max_position_embeddings == 128
    assert "--max-position-embeddings 128" in " ".join(result.train_flags)
    source = hf_dirs["gpt2"] / "config.json"
    assert _error(import_hf, str(hf_dirs["gpt2"]), str(tmp_path / "gpt2"), flags[:2]) == (
        f"--seq-length 128 exceeds {source}'s max_position_embeddings 64, the size of its learned position table; "
        "give --seq-length 64 or less"
    )


def test_a_tied_config_with_its_own_head_is_refused(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    """transformers keeps a separate lm_head.weight that differs from the embedding though config.json ties them:
    tying it here would drop the head (a different model). An equal copy is the tied model and imports."""
    from safetensors.torch import save_file

    source = hf_dirs["tied_llama"]
    tensors = load_file(source / "model.safetensors")
    for name, head in (("equal", tensors["model.embed_tokens.weight"]), ("other", torch.randn(200, 32))):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text((source / "config.json").read_text())
        save_file({**tensors, "lm_head.weight": head.clone().contiguous()}, d / "model.safetensors")
    import_hf(str(tmp_path / "equal"), str(tmp_path / "ok"), [], show_progress=False)
    message = _error(import_hf, str(tmp_path / "other"), str(tmp_path / "out"), [])
    assert message == (
        f"{tmp_path / 'other'}: tensor lm_head.weight differs from model.embed_tokens.weight, but config.json ties them "
        '(tie_word_embeddings); transformers then keeps the separate head: set "tie_word_embeddings": false in '
        "config.json to import it as an untied head"
    )
    assert not (tmp_path / "out").exists()


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickled_bin_that_holds_code_is_named_and_never_run(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    source = hf_dirs["gpt2"]
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "config.json").write_text((source / "config.json").read_text())
    torch.save(
        {**load_file(source / "model.safetensors"), "x": _RunsCode(tmp_path / "ran")}, evil / "pytorch_model.bin"
    )
    message = _error(import_hf, str(evil), str(tmp_path / "out"), [])
    assert message == (
        f"{evil / 'pytorch_model.bin'}: holds a pickled posix.system, which such a file does not hold; refused "
        "(nothing in it was run)"
    )
    assert not (tmp_path / "ran").exists() and not (tmp_path / "out").exists()


def _sentencepiece(tmp_path: Path, vocab: int) -> str:
    from megatron_ds.data.demo_corpus import demo_documents
    from megatron_ds.data.tokenizer_training import train_sentencepiece

    lines = [line for doc in demo_documents(max_bytes=60_000) for line in doc.split("\n") if line.strip()]
    return train_sentencepiece(lines, str(tmp_path / f"sp{vocab}"), vocab)


def test_tokenizer_larger_than_the_vocabulary_is_an_error(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    sp = _sentencepiece(tmp_path, 250)
    before = set(os.listdir(tmp_path))
    flags = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp]
    message = _error(import_hf, str(hf_dirs["gpt2"]), str(tmp_path / "out"), flags)
    assert "has 250 tokens but" in message and "vocab_size 200" in message
    _nothing_written(tmp_path, before)


def test_sentencepiece_tokenizer_travels_both_ways(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    from megatron_ds.data.tokenizer import build_tokenizer

    sp = _sentencepiece(tmp_path, 120)
    flags = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp]
    result = import_hf(str(hf_dirs["gpt2"]), str(tmp_path / "ours"), flags, show_progress=False)
    copied = tmp_path / "ours" / "tokenizer" / "sp120.model"
    assert copied.is_file() and f"--tokenizer-model {copied}" in " ".join(result.train_flags)
    exported = export_hf(str(tmp_path / "ours"), str(tmp_path / "hf"), show_progress=False)
    assert exported.vocab_size == 200 and "tokenizer.json" in exported.files
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp)
    for text in ["def add(a, b):\n    return a + b", "Hello world", "numbers 12 and 345!", "a\n\nb  c"]:
        assert hf_tok.encode(text, add_special_tokens=False) == ours.tokenize(text), text
        assert hf_tok.decode(ours.tokenize(text)) == text
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["eos_token_id"], config["bos_token_id"]) == (ours.eod, 1)


def test_cli_reports_user_errors_in_one_line(tmp_path: Path, capsys) -> None:
    tool = ROOT / "tools" / "convert_checkpoint.py"
    proc = run_python([str(tool), "--from", "hf", str(tmp_path / "nothing"), str(tmp_path / "out")], timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'nothing'}: no such directory; give a Hugging Face model directory (config.json + weights)"
    ]
    assert not (tmp_path / "out").exists()
    tool_module = _load_tool("convert_checkpoint")
    for bad in ("0", "-1"):  # was an export of one file per tensor
        argv = ["--to", "hf", "--max-shard-size-mb", bad, str(tmp_path / "nothing"), str(tmp_path / "out")]
        assert tool_module.main(argv) == 2
        assert capsys.readouterr().err == f"error: --max-shard-size-mb {bad} must be >= 1 (default 2048)\n"
    assert not (tmp_path / "out").exists()
    assert (
        tool_module.main(["--from", "hf", "--hf-model-type", "mistral", str(tmp_path / "x"), str(tmp_path / "y")]) == 2
    )
    assert capsys.readouterr().err == "error: --hf-model-type applies to --to hf only; drop it\n"
    source = tmp_path / "src"
    source.mkdir()
    for direction, output in (("--from", source / "sub"), ("--to", source)):  # the source gained a directory
        assert tool_module.main([direction, "hf", str(source), str(output)]) == 2
        assert capsys.readouterr().err == (
            f"error: OUTPUT {output} is SOURCE {source} or inside it; a conversion never writes into its source: "
            "give a directory outside it\n"
        )
    assert os.listdir(source) == []


def test_sharded_safetensors_and_pickled_bin_both_convert(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    import_hf(str(hf_dirs["llama_gqa"]), str(tmp_path / "ours"), [], show_progress=False)
    result = export_hf(str(tmp_path / "ours"), str(tmp_path / "sharded"), max_shard_bytes=20_000, show_progress=False)
    shards = [f for f in result.files if f.endswith(".safetensors")]
    assert len(shards) > 2 and "model.safetensors.index.json" in result.files
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs["llama_gqa"]).eval()
    sharded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sharded").eval()
    with torch.no_grad():
        assert torch.equal(sharded(_tokens()).logits, reference(_tokens()).logits)
    # A directory with only a pickled pytorch_model.bin is read with torch.load(weights_only=True).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "config.json").write_bytes((hf_dirs["llama_gqa"] / "config.json").read_bytes())
    torch.save(load_file(hf_dirs["llama_gqa"] / "model.safetensors"), bin_dir / "pytorch_model.bin")
    for source, name in ((tmp_path / "sharded", "from_shards"), (bin_dir, "from_bin")):
        import_hf(str(source), str(tmp_path / name), [], show_progress=False)
        a, b = load_model(str(tmp_path / "ours")), load_model(str(tmp_path / name))
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters())), name


@pytest.mark.parametrize("flag", [["--use-rotary-position-embeddings"], ["--swiglu"], ["--num-key-value-heads", "2"]])
def test_architecture_flags_that_change_a_gpt2_are_refused(
    hf_dirs: dict[str, Path], tmp_path: Path, flag: list
) -> None:
    message = _error(import_hf, str(hf_dirs["gpt2"]), str(tmp_path / "out"), flag)
    assert message.startswith(f"{flag[0]} ") and "contradicts" in message
    assert not (tmp_path / "out").exists()


def test_an_imported_tokenizer_directory_exports_back_as_it_was(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    # A Llama directory with its own tokenizer files: the import reads tokenizer.model, the export wrote LlamaTokenizer
    # settings of its own (add_bos_token false) where the source said true, and dropped the chat template.
    source = tmp_path / "llama"
    source.mkdir()
    for name in os.listdir(hf_dirs["llama_gqa"]):
        (source / name).write_bytes((hf_dirs["llama_gqa"] / name).read_bytes())
    (source / "tokenizer.model").write_bytes(Path(_sentencepiece(tmp_path, 120)).read_bytes())
    settings = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>"}
    (source / "tokenizer_config.json").write_text(json.dumps(settings))
    (source / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    result = import_hf(str(source), str(tmp_path / "ours"), [], show_progress=False)
    assert result.config.data.tokenizer_model == str(tmp_path / "ours" / "tokenizer" / "tokenizer.model")
    exported = export_hf(str(tmp_path / "ours"), str(tmp_path / "back"), show_progress=False)
    names = ["tokenizer_config.json", "tokenizer.model", "chat_template.jinja"]
    assert exported.files == ["model.safetensors", "config.json", "generation_config.json", *names]
    for name in names:
        assert (tmp_path / "back" / name).read_bytes() == (source / name).read_bytes(), name
    assert "tokenizer.json" not in exported.files and exported.notes == []
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_an_export_without_a_tokenizer_says_what_the_directory_lacks(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    import_hf(str(hf_dirs["llama_gqa"]), str(tmp_path / "ours"), [], show_progress=False)
    exported = export_hf(str(tmp_path / "ours"), str(tmp_path / "back"), show_progress=False)
    assert exported.notes == [
        "no tokenizer (the checkpoint records none): no tokenizer files, and config.json names no bos/eos token, so "
        "generate() stops only at its length limit; give --tokenizer-type and its file flags to add them"
    ]
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (None, None)


def _tokenizer_json_dir(tmp_path: Path, model_dir: Path) -> Path:
    """`model_dir`'s files plus a tokenizer.json-only tokenizer (no tokenizer.model, as a Llama 3's)."""
    from megatron_ds.data.tokenizer import build_tokenizer
    from megatron_ds.interop.hf_tokenizer import export_tokenizer

    source = tmp_path / "tokjson"
    source.mkdir()
    for name in os.listdir(model_dir):
        (source / name).write_bytes((model_dir / name).read_bytes())
    export_tokenizer(
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=_sentencepiece(tmp_path, 120)), source, 64
    )
    (source / "tokenizer.model").unlink()
    return source


def test_a_tokenizer_json_directory_imports_as_hugging_face_tokenizer_and_exports_back(
    hf_dirs: dict[str, Path], tmp_path: Path
) -> None:
    # A Llama 3 style directory (tokenizer.json only) imported without a tokenizer; a directory given with
    # --tokenizer-type HuggingFaceTokenizer failed copying it as a file.
    source = _tokenizer_json_dir(tmp_path, hf_dirs["llama_gqa"])
    runs = {
        "found": (source, []),
        "given": (hf_dirs["gpt2"], ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(source)]),
    }
    for name, (model_dir, flags) in runs.items():
        result = import_hf(str(model_dir), str(tmp_path / name), flags, show_progress=False)
        copied = tmp_path / name / "tokenizer"
        assert (result.config.data.tokenizer_type, result.config.data.tokenizer_model) == (
            "HuggingFaceTokenizer",
            str(copied),
        ), name
        assert sorted(os.listdir(copied)) == ["tokenizer.json", "tokenizer_config.json"], name
        assert f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {copied}" in " ".join(result.train_flags)
        exported = export_hf(str(tmp_path / name), str(tmp_path / f"{name}_hf"), show_progress=False)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            assert (tmp_path / f"{name}_hf" / file).read_bytes() == (source / file).read_bytes(), (name, file)
        assert exported.notes == []
    theirs = transformers.AutoTokenizer.from_pretrained(source)
    ours = transformers.AutoTokenizer.from_pretrained(tmp_path / "found_hf")
    text = "def add(a, b):\n    return a + b"
    assert ours(text).input_ids == theirs(text).input_ids and len(theirs(text).input_ids) > 5


@pytest.mark.parametrize(
    ("name", "model_type", "cls"),
    [
        ("qwen2", None, "Qwen2ForCausalLM"),  # a QKV bias alone is Qwen2's
        ("tied_qwen2", None, "Qwen2ForCausalLM"),
        ("qwen3", None, "Qwen3ForCausalLM"),  # query and key norms are Qwen3's
        ("tied_qwen3", None, "Qwen3ForCausalLM"),
        ("mistral", "mistral", "MistralForCausalLM"),  # by default a bias-free Llama, which computes the same
    ],
)
def test_qwen2_qwen3_and_mistral_export_back_as_themselves(
    name: str, model_type: str | None, cls: str, hf_dirs: dict[str, Path], tmp_path: Path
) -> None:
    result = import_hf(str(hf_dirs[name]), str(tmp_path / "ours"), ["--seq-length", "32"], show_progress=False)
    assert result.arch == name.removeprefix("tied_")
    m = result.config.model
    assert not m.add_bias_linear and m.add_qkv_bias == ("qwen2" in name)
    assert ("--add-qkv-bias" in result.train_flags) == ("qwen2" in name)
    assert m.qk_layernorm == ("--qk-layernorm" in result.train_flags) == ("qwen3" in name)
    assert m.untie_embeddings_and_output_weights == (not name.startswith("tied_"))
    exported = export_hf(str(tmp_path / "ours"), str(tmp_path / "back"), show_progress=False, model_type=model_type)
    assert exported.arch == name.removeprefix("tied_")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[name]).eval()
    assert type(back).__name__ == cls
    with torch.no_grad():
        assert torch.equal(back(_tokens()).logits, reference(_tokens()).logits)


def test_a_window_shorter_than_the_sequence_imports_and_an_inexact_model_type_is_refused(
    hf_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """sliding_window 32 at --seq-length 48 (it was refused before windows were built): Mistral's on every layer,
    Qwen2's from max_window_layers 1 on, as the flags that rebuild the model say."""
    for name, pattern in (("mistral", []), ("tied_qwen2", ["--window-attn-skip-freq", "[0, 1]"])):
        result = import_hf(str(hf_dirs[name]), str(tmp_path / name), ["--seq-length", "48"], show_progress=False)
        assert result.config.model.layer_windows == ((31, 31) if name == "mistral" else (None, 31))
        flags = " ".join(result.train_flags)
        assert " ".join(["--window-size", "31,0", *pattern]) in flags and "--seq-length" not in flags
    import_hf(str(hf_dirs["qwen2"]), str(tmp_path / "q"), ["--seq-length", "32"], show_progress=False)
    message = _error(export_hf, str(tmp_path / "q"), str(tmp_path / "m"), None, None, None, 1 << 30, False, "mistral")
    assert message.startswith("cannot export to Hugging Face mistral: --add-qkv-bias: Mistral has no biases")
    assert not (tmp_path / "m").exists()
