"""Sliding-window attention (`--window-size LEFT,0`, Hugging Face's `sliding_window` LEFT + 1): the keys a query
sees are upstream's (megatron-core's mask function and transformers' mask function themselves), the chunked
attention equals SDPA under the whole band mask (with packed documents too), the KV-cached generation equals the
whole sequence's forward, and Mistral, Qwen2, Qwen3 and Phi-3 with windows shorter than the sequence import with
transformers' logits and export back to the same files."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.inference import generate, load_model
from megatron_ds.inference.model import GPTModel, KVCache
from megatron_ds.model import documents, sliding_window
from megatron_ds.model.transformer import TransformerLayer

MODEL = ModelConfig(
    num_layers=3,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    ffn_hidden_size=48,
    seq_length=96,
    max_position_embeddings=96,
    vocab_size=64,
    normalization="rmsnorm",
    activation="swiglu",
    use_rotary_position_embeddings=True,
    add_position_embedding=False,
    add_bias_linear=False,
    window_size=(5, 0),
    window_attn_skip_freq=(1, 0, 1),
)
NO_DROPOUT = RegularizationConfig(hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2)


def _megatron_core_mask(seq: int, left: int) -> torch.Tensor:
    """megatron-core's own mask (True: attend), its torch.ones given the CPU for the CUDA device it names."""
    from megatron.core.transformer.utils import get_sliding_window_causal_mask

    ones = torch.ones
    with mock.patch.object(torch, "ones", lambda *a, device=None, **k: ones(*a, **k)):
        return ~get_sliding_window_causal_mask(seq, seq, (left, 0))


def _transformers_mask(seq: int, sliding_window: int) -> torch.Tensor:
    from transformers.masking_utils import sliding_window_causal_mask_function

    q, k = torch.arange(seq).unsqueeze(1), torch.arange(seq).unsqueeze(0)
    return sliding_window_causal_mask_function(sliding_window)(0, 0, q, k)


@pytest.mark.parametrize("seq, left", [(12, 0), (12, 3), (12, 11), (12, 30), (70, 5)])
def test_the_keys_a_query_sees_are_megatron_cores_and_transformers(seq: int, left: int) -> None:
    """Query q sees keys q - left .. q: megatron-core's window (left, 0) and transformers' sliding_window left + 1
    (q - W < k <= q) hold the same keys; the pair counts are the mask's."""
    ours = sliding_window.visible(0, seq, 0, seq, left, "cpu")
    assert torch.equal(ours, _megatron_core_mask(seq, left))
    assert torch.equal(ours, _transformers_mask(seq, left + 1))
    assert ours.sum(dim=1).tolist() == [min(i, left) + 1 for i in range(seq)]
    assert sliding_window.band_pairs(seq, left) == int(ours.sum())


FLAGS = "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 64 --vocab-size 100 --lr 1e-3 "
FLAGS += "--train-iters 1 --mock-data"


@pytest.mark.parametrize(
    "flags, windows",
    [
        ("--window-size 7,0", (7, 7, 7, 7)),
        ("--window-size (7,0)", (7, 7, 7, 7)),  # Megatron-LM's tuple_type strips the parentheses
        ("--window-size 7,0 --window-attn-skip-freq 2", (7, None, 7, None)),  # layer numbers 2, 4 attend fully
        ("--window-size 7,0 --window-attn-skip-freq ([1]*3+[0])", (7, 7, 7, None)),
        ("--window-size=-1,0", (None,) * 4),  # upstream's infinite window (argparse takes -1,0 for a flag)
        ("--window-attn-skip-freq 2", (None,) * 4),  # without --window-size (upstream ignores it too)
    ],
)
def test_the_flags_mean_megatron_lms(flags: str, windows: tuple) -> None:
    from megatron_ds.flags.parser import parse_config

    config, _ = parse_config([*FLAGS.split(), *flags.split()])
    assert config.model.layer_windows == windows


@pytest.mark.parametrize(
    "flags, error",
    [
        ("--window-size 7,2", "--window-size 7,2: RIGHT lets a token attend 2 later tokens, but a GPT attends"),
        ("--window-size 7", "--window-size 7 must be two integers LEFT,RIGHT, e.g. 4095,0"),
        ("--window-size=-2,0", "--window-size -2,0: LEFT must be >= 0, or -1 for no window"),
        ("--window-size 7,0 --window-attn-skip-freq [1,0]", "must give one 0 (full attention) or 1 (the window) for"),
        ("--window-size 7,0 --window-attn-skip-freq [1,0]*2+__import__", "is not a list expression of digits"),
        ("--window-size 7,0 --window-attn-skip-freq 0", "--window-attn-skip-freq 0 must be an integer >= 1"),
    ],
)
def test_bad_window_flags_are_one_line_errors(flags: str, error: str) -> None:
    from megatron_ds.errors import UserError
    from megatron_ds.flags.parser import parse_config

    with pytest.raises(UserError) as err:
        parse_config([*FLAGS.split(), *flags.split()])
    assert error in str(err.value) and "\n" not in str(err.value)


def _layer(window: int | None) -> TransformerLayer:
    torch.manual_seed(0)
    return TransformerLayer(MODEL, NO_DROPOUT, init_seed=3, window=window).eval()


@pytest.mark.parametrize("left", [0, 5, 40])
def test_chunked_attention_equals_sdpa_under_the_whole_band_mask(left: int) -> None:
    """Queries in chunks (several at s = 96: 32-row chunks for the small windows, 41 for left 40) against the keys
    their rows can see equal one SDPA over the whole sequence under the band mask, alone and with packed documents'
    mask (a document boundary inside the window), GQA included; the gradients too."""
    layer = _layer(left)
    x = torch.randn(2, MODEL.seq_length, MODEL.hidden_size, generator=torch.Generator().manual_seed(1))
    q, k, v = (t.detach().requires_grad_() for t in layer.attention_heads(layer.input_norm(x)))
    ids = torch.tensor([[0] * 50 + [1] * 46, [0] * 7 + [1] * 89])
    band = _megatron_core_mask(MODEL.seq_length, left)
    for mask in (None, documents.attention_mask(ids)):
        ours = layer.core_attention(q, k, v, mask)
        full = band if mask is None else mask & band
        reference = F.scaled_dot_product_attention(q, k, v, attn_mask=full, enable_gqa=True)
        torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)
        grads = torch.autograd.grad(ours.square().sum(), (q, k, v))
        expected = torch.autograd.grad(reference.square().sum(), (q, k, v))
        for a, b in zip(grads, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    counted = sum((e - s) * (e - f) for s, e, f in sliding_window.chunks(MODEL.seq_length, left))
    assert sliding_window.computed_pairs(MODEL.seq_length, left) == counted < MODEL.seq_length**2


@pytest.mark.parametrize("seq, left", [(32768, 4095), (8192, 4095), (131072, 32767), (4096, 255)])
def test_the_chunks_compute_the_band_and_at_most_an_eighth_more(seq: int, left: int) -> None:
    """Mistral-sized windows: the scores the chunks compute are the band (its pairs counted directly: query i sees
    min(i, left) + 1 keys) plus at most 1/8 (each row's chunk of (left + 1) / 8 rows), far below the square."""
    band = sum(min(i, left) + 1 for i in range(seq))
    assert sliding_window.band_pairs(seq, left) == band
    assert band < sliding_window.computed_pairs(seq, left) <= 1.125 * band + seq


def test_kv_cached_generation_attends_as_the_whole_sequence() -> None:
    """Prompt 9 tokens, then 40 single-token steps (49 > the window of 6 keys, layers 1 and 3; layer 2 attends
    fully): every cached step's logits equal the whole sequence's forward at that position (1e-6; in float64, so
    the check is of the keys attended, not of fp32 rounding), and greedy decoding with and without the cache
    agrees."""
    torch.manual_seed(0)
    model = GPTModel(MODEL, NO_DROPOUT).double()
    tokens = torch.randint(0, MODEL.vocab_size, (2, 49), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = model(tokens)
        cache = KVCache()
        steps = [model(tokens[:, :9], cache)] + [model(tokens[:, i : i + 1], cache) for i in range(9, 49)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=0, atol=1e-6)
    prompt = tokens[0, :5].tolist()
    assert generate(model, prompt, 30, temperature=0.0) == generate(model, prompt, 30, temperature=0.0, use_cache=False)


def test_without_the_window_the_model_differs() -> None:
    """The check above can fail: the same weights attending the whole causal sequence give other logits."""
    torch.manual_seed(0)
    windowed = GPTModel(MODEL, NO_DROPOUT)
    torch.manual_seed(0)
    full = GPTModel(dataclasses.replace(MODEL, window_size=None), NO_DROPOUT)
    full.load_state_dict(windowed.state_dict())
    tokens = torch.randint(0, MODEL.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = windowed(tokens), full(tokens)
    assert torch.equal(a[:, :6], b[:, :6]) and (a[:, 6:] - b[:, 6:]).abs().max() > 1e-3


MEMORY_MODEL = ModelConfig(
    num_layers=1,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=128,
    seq_length=128,
    max_position_embeddings=128,
    vocab_size=64,
    window_size=(40, 0),
)
"""128 tokens, 41 keys a query: four chunks of 32 queries (the first against 32 keys, the others against 72)."""


@pytest.mark.parametrize("dropout", [0.0, 0.1])  # CPU: the flash kernel, the math kernel
@pytest.mark.parametrize(("precision", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_the_memory_model_counts_what_the_chunks_save(dropout: float, precision: str, dtype: torch.dtype) -> None:
    """A windowed layer keeps exactly the activation terms' bytes: alone, with packed documents' mask, and under
    selective recomputation; the terms without the window (the whole square's) differ, so the check can fail."""
    from megatron_ds.data.packed_documents import PackedDocuments
    from megatron_ds.estimate import activation_memory as act
    from megatron_ds.estimate.activation_kernels import Split, kernels
    from megatron_ds.testing.saved_tensors import graph_bytes

    m, b, left = MEMORY_MODEL, 3, MEMORY_MODEL.window_size[0]
    assert [c[1:] for c in sliding_window.chunks(m.seq_length, left)] == [(32, 0), (64, 0), (96, 24), (128, 56)]
    reg = RegularizationConfig(hidden_dropout=dropout, attention_dropout=dropout)
    k = kernels(precision, "cpu", dropout)
    tokens = torch.randint(0, 10, (b, m.seq_length), generator=torch.Generator().manual_seed(0))
    tokens[:, 50] = 7
    for selective, packed in [(False, False), (False, True), (True, True)]:
        torch.manual_seed(0)
        layer = TransformerLayer(m, reg, 1, selective_recompute=selective, document_mask=packed, window=left)
        layer = layer.to(dtype).train()
        x = torch.randn(b, m.seq_length, m.hidden_size, dtype=dtype, requires_grad=True)
        y = layer((x, *PackedDocuments(7, True, True).structure(tokens)) if packed else x)
        y = y[0] if packed else y
        kw = {"regularization": reg, "document_mask": packed}
        split = Split(selective=selective)
        terms = act.transformer_layer_terms(m, b, k, split, **kw, window=left)
        assert graph_bytes(y, layer.parameters()) == sum(terms.values()), (selective, packed)
        if not selective:
            assert sum(terms.values()) != sum(act.transformer_layer_terms(m, b, k, split, **kw).values())


def test_the_memory_model_takes_each_layers_window() -> None:
    """A model whose layers attend with and without the window: its layer specs carry each one's terms (on CPU's
    flash path, fp32 without dropout, the windowed layer keeps more: the chunks' outputs and masks, where the whole
    sequence's kernel keeps no score of either)."""
    from megatron_ds.estimate import activation_memory as act
    from megatron_ds.estimate.memory_inputs import MemoryInputs
    from megatron_ds.estimate.spec_memory import spec_memory

    m = dataclasses.replace(MEMORY_MODEL, num_layers=3, window_attn_skip_freq=(1, 0, 1))
    inputs = MemoryInputs(model=m, micro_batch_size=2, num_micro_batches=1, precision="fp32")
    layers = [sp for sp in spec_memory(inputs) if sp.group == "body"]
    reg = inputs.regularization
    expected = [
        sum(act.transformer_layer_terms(m, 2, inputs.kernels, regularization=reg, window=w).values())
        for w in m.layer_windows
    ]
    assert [sp.activations for sp in layers] == expected and expected[0] == expected[2] > expected[1]


# ----- Hugging Face: Mistral, Qwen2, Qwen3, Phi-3 with windows shorter than the sequence --------------------------------

transformers = pytest.importorskip("transformers")
HF_LAYERS = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4}
HF_SMALL = {"vocab_size": 200, "initializer_range": 0.1, "num_key_value_heads": 2, "max_position_embeddings": 64}
HF_CONFIGS = {
    "mistral": (lambda: transformers.MistralConfig(**HF_LAYERS, **HF_SMALL, sliding_window=8), (7, 7, 7)),
    "qwen2": (  # layers from max_window_layers 1 on
        lambda: transformers.Qwen2Config(
            **HF_LAYERS, **HF_SMALL, use_sliding_window=True, sliding_window=6, max_window_layers=1
        ),
        (None, 5, 5),
    ),
    "qwen3": (  # layer_types names them
        lambda: transformers.Qwen3Config(
            **HF_LAYERS,
            **HF_SMALL,
            head_dim=8,
            use_sliding_window=True,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        (4, None, 4),
    ),
    "phi3": (  # every layer; partial rotary, so that it exports as Phi-3 (a whole-head one exports as Mistral)
        lambda: transformers.Phi3Config(
            **HF_LAYERS, **HF_SMALL, sliding_window=7, partial_rotary_factor=0.5, pad_token_id=None
        ),
        (6, 6, 6),
    ),
}
WINDOW_FIELDS = ("sliding_window", "use_sliding_window", "layer_types")
"""What transformers reads the window from (max_window_layers only when layer_types is absent: both written)."""


@pytest.fixture(scope="module")
def windowed_hf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, (make, _) in HF_CONFIGS.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(make())
        with torch.no_grad():  # norms start at 1: move them so a mix-up shows
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        out[name] = tmp_path_factory.mktemp(name) / "hf"
        model.save_pretrained(out[name])
    return out


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_windowed_models_import_with_transformers_logits_and_export_back(
    name: str, windowed_hf: dict[str, Path], tmp_path: Path
) -> None:
    """40 tokens, windows of 5 to 8: the imported model computes transformers' logits (1e-5) and its greedy
    continuation past the window (transformers' sliding-window cache against ours); the export writes the same
    window fields and tensors, and the exported model computes the same logits."""
    from safetensors.torch import load_file

    from megatron_ds.interop.hf_export import export_hf
    from megatron_ds.interop.hf_import import import_hf

    source = windowed_hf[name]
    result = import_hf(str(source), str(tmp_path / "ours"), ["--seq-length", "48"], show_progress=False)
    assert result.config.model.layer_windows == HF_CONFIGS[name][1]
    ours = load_model(str(tmp_path / "ours"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    tokens = torch.randint(0, 200, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
        torch.testing.assert_close(ours(tokens), expected, rtol=0, atol=1e-5)
    prompt = tokens[0, :4].tolist()
    hf_greedy = reference.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert generate(ours, prompt, 20, temperature=0.0) == hf_greedy[0, 4:].tolist()
    export_hf(str(tmp_path / "ours"), str(tmp_path / "back"), show_progress=False)
    original, back = (transformers.AutoConfig.from_pretrained(d) for d in (source, tmp_path / "back"))
    assert [getattr(back, k, None) for k in WINDOW_FIELDS] == [getattr(original, k, None) for k in WINDOW_FIELDS]
    a, b = load_file(source / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert torch.equal(exported(tokens).logits, expected)
