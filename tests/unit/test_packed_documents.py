"""Packed documents (`--reset-position-ids`, `--reset-attention-mask`): the position ids and attention mask equal
upstream's own functions (megatron-core's, imported; Megatron-DeepSpeed's, recorded by
tools/record_ltor_masks.py from its own code), and a packed sample's logits equal each document's run alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.data.packed_documents import PackedDocuments, document_structure
from megatron_ds.model import documents, naming
from megatron_ds.model.gpt_pipe import build_layer_specs

FIXTURE = Path(__file__).parent / "fixtures" / "megatron_deepspeed_ltor_masks.json"
EOD = 7
FLAGS = [(True, False), (False, True), (True, True)]


def random_rows(seed: int, rows: int = 4, seq: int = 24) -> torch.Tensor:
    """Token rows over 10 ids, so that EOD (7) occurs several times per row; one row ends with EOD, one starts."""
    tokens = torch.randint(0, 10, (rows, seq), generator=torch.Generator().manual_seed(seed))
    tokens[:, seq // 3] = EOD  # at least one in every row
    tokens[0, -1] = EOD
    tokens[1, 0] = EOD
    return tokens


def our_mask(tokens: torch.Tensor, reset_position_ids: bool, reset_attention_mask: bool) -> torch.Tensor:
    """Ours as upstream's convention: True where attention is masked out, (b, 1, s, s); causal without the flag."""
    _, doc = document_structure(tokens, EOD, reset_position_ids, reset_attention_mask)
    return ~documents.attention_mask(doc)


@pytest.mark.parametrize(("reset_position_ids", "reset_attention_mask"), FLAGS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equals_megatron_core(seed: int, reset_position_ids: bool, reset_attention_mask: bool) -> None:
    tokens = random_rows(seed)
    assert int((tokens == EOD).sum(1).min()) >= 1 and int((tokens == EOD).sum()) > 2 * tokens.shape[0]
    positions, _ = document_structure(tokens, EOD, reset_position_ids, reset_attention_mask)
    mask = our_mask(tokens, reset_position_ids, reset_attention_mask)
    for row in range(tokens.shape[0]):  # megatron-core's works on one sample
        ref_mask, _, ref_positions = _get_ltor_masks_and_position_ids(
            tokens[row].clone(), EOD, reset_position_ids, reset_attention_mask, False, True
        )
        assert torch.equal(positions[row], ref_positions)
        assert torch.equal(mask[row], ref_mask)


def as_text(mask: torch.Tensor) -> list[list[str]]:
    """A (b, 1, s, s) boolean mask as the fixture stores it: per row, per query, "1" where a key is masked out."""
    return [["".join("1" if m else "0" for m in query) for query in row[0].tolist()] for row in mask]


CASES = json.loads(FIXTURE.read_text())["cases"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_equals_megatron_deepspeed(case: dict) -> None:
    tokens = torch.tensor(case["tokens"])
    assert int((tokens == case["eod"]).sum()) > 2 * tokens.shape[0]  # several documents per row
    rp, ram = case["reset_position_ids"], case["reset_attention_mask"]
    positions, doc = document_structure(tokens, case["eod"], rp, ram)
    assert positions.tolist() == case["position_ids"]
    assert as_text(~documents.attention_mask(doc)) == case["attention_mask"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_upstreams_agree(case: dict) -> None:
    """megatron-core's function (one sample) gives Megatron-DeepSpeed's recorded rows: the two upstreams agree on
    positions and mask, including an EOD at the last index (so --data-upstream changes nothing here)."""
    for row, tokens in enumerate(torch.tensor(case["tokens"])):
        mask, _, positions = _get_ltor_masks_and_position_ids(
            tokens, case["eod"], case["reset_position_ids"], case["reset_attention_mask"], False, True
        )
        assert positions.tolist() == case["position_ids"][row]
        assert as_text(mask.unsqueeze(0))[0] == case["attention_mask"][row]


def test_without_flags_positions_run_and_one_document() -> None:
    tokens = random_rows(0)
    positions, doc = PackedDocuments(EOD, False, False).structure(tokens)
    assert torch.equal(positions, torch.arange(tokens.shape[1]).expand_as(tokens))
    assert not doc.any()


def test_batches_carry_the_ids() -> None:
    tokens = random_rows(3)
    labels = (tokens.roll(-1, 1), torch.ones(tokens.shape))
    packed = PackedDocuments(EOD, True, True)
    ((t, pos, doc), lab) = next(packed.batches(iter([((tokens,), labels)])))
    assert t is tokens and lab is labels
    assert torch.equal(pos, packed.structure(tokens)[0]) and torch.equal(doc, packed.structure(tokens)[1])


MODELS = {
    "learned": ModelConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16,
        max_position_embeddings=16, vocab_size=64,
    ),
    "llama": ModelConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=64,
        seq_length=16, max_position_embeddings=16, vocab_size=64, activation="swiglu",
        use_rotary_position_embeddings=True, add_position_embedding=False, normalization="rmsnorm",
        add_bias_linear=False,
    ),
}  # fmt: skip


def logits(model: ModelConfig, x: object, document_mask: bool) -> torch.Tensor:
    """The spec list run in one process (as one pipeline stage runs it) on `x`."""
    torch.manual_seed(0)
    specs = build_layer_specs(model, RegularizationConfig(hidden_dropout=0.0, attention_dropout=0.0), 1234,
                              document_mask=document_mask)  # fmt: skip
    modules = [s.build() if hasattr(s, "build") else s for s in specs]
    embedding = modules[naming.gpt_spec_groups(model).pre.index(naming.WORD_EMBEDDING)]
    with torch.no_grad():
        for spec, module in zip(specs, modules):
            fn = getattr(spec, "forward_fn", None)
            x = fn(embedding, x) if fn else module(x)
    return x


@pytest.mark.parametrize("name", list(MODELS))
def test_packed_sample_equals_each_document_alone(name: str) -> None:
    """Two documents packed in one sample with both flags: each document's logits equal its own run from
    position 0 (within 1e-6 in fp32); without --reset-attention-mask the second document's differ."""
    model = MODELS[name]
    gen = torch.Generator().manual_seed(5)
    first = torch.randint(0, EOD, (1, 6), generator=gen)
    first[0, -1] = EOD  # the first document ends with its EOD
    second = torch.randint(0, EOD, (1, 10), generator=gen)
    packed = torch.cat([first, second], dim=1)
    both = PackedDocuments(EOD, True, True)
    out = logits(model, (packed, *both.structure(packed)), True)
    alone = [logits(model, doc, False) for doc in (first, second)]
    torch.testing.assert_close(out[:, :6], alone[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(out[:, 6:], alone[1], rtol=0, atol=1e-6)
    positions_only = PackedDocuments(EOD, True, False)
    mixed = logits(model, (packed, *positions_only.structure(packed)), False)
    assert (mixed[:, 6:] - alone[1]).abs().max() > 1e-3


def test_no_flags_keep_the_causal_path() -> None:
    """Without packed documents a layer takes and returns a tensor, and SDPA gets is_causal (no mask)."""
    from unittest import mock

    model = MODELS["llama"]
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs)
        return real(*args, **kwargs)

    tokens = torch.randint(0, EOD, (2, 16), generator=torch.Generator().manual_seed(1))
    with mock.patch("torch.nn.functional.scaled_dot_product_attention", spy):
        out = logits(model, tokens, False)
        assert isinstance(out, torch.Tensor)
        assert calls and all(c.get("is_causal") is True and "attn_mask" not in c for c in calls)
        calls.clear()
        logits(model, (tokens, *PackedDocuments(EOD, True, True).structure(tokens)), True)
        assert calls and all("is_causal" not in c and c["attn_mask"].dtype == torch.bool for c in calls)


ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--vocab-size", "1000", "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "10",
        "--lr", "1e-3"]  # fmt: skip


def test_flags_map_onto_the_config() -> None:
    from megatron_ds.flags.parser import parse_config

    data = parse_config(ARGS, world_size=1)[0].data
    assert (data.reset_position_ids, data.reset_attention_mask) == (False, False)
    data = parse_config([*ARGS, "--reset-position-ids", "--reset-attention-mask"], world_size=1)[0].data
    assert (data.reset_position_ids, data.reset_attention_mask) == (True, True)
    data = parse_config([*ARGS, "--reset-attention-mask"], world_size=1)[0].data
    assert (data.reset_position_ids, data.reset_attention_mask) == (False, True)


@pytest.mark.parametrize(
    ("extra", "world", "message"),
    [
        (["--reset-attention-mask", "--ds-sequence-parallel-size", "2", "--zero-stage", "2"], 2,
         "--reset-attention-mask with --ds-sequence-parallel-size 2: DeepSpeed-Ulysses splits"),
        (["--reset-position-ids", "--reset-attention-mask", "--ds-sequence-parallel-size", "2", "--zero-stage", "2"], 2,
         "--reset-position-ids and --reset-attention-mask with --ds-sequence-parallel-size 2"),
    ],
)  # fmt: skip
def test_refusals_are_one_line(extra: list[str], world: int, message: str) -> None:
    from megatron_ds.flags.parser import ConfigError, parse_config

    with pytest.raises(ConfigError) as error:
        parse_config([*ARGS, *extra], world_size=world)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    without = [a for a in extra if not a.startswith("--reset-")]
    parse_config([*ARGS, *without], world_size=world)  # the same line without the flags is accepted


def test_megatron_lm_without_dataloader_masks_is_refused() -> None:
    """Megatron-LM's --no-create-attention-mask-in-dataloader makes it ignore --reset-attention-mask: named, not
    silently run with a meaning it would not have there."""
    from megatron_ds.flags.parser import ConfigError, parse_config

    flag = "--no-create-attention-mask-in-dataloader"
    with pytest.raises(ConfigError, match=f"^--reset-attention-mask with {flag}: [^\\n]*; drop one of them$"):
        parse_config([*ARGS, "--reset-attention-mask", flag], world_size=1)
    assert parse_config([*ARGS, "--reset-position-ids", flag], world_size=1)[0].data.reset_position_ids


@pytest.mark.parametrize("field", ["reset_position_ids", "reset_attention_mask"])
def test_prompt_data_refuses_them(field: str) -> None:
    from megatron_ds.config import DataConfig
    from megatron_ds.errors import ConfigError

    flag = "--" + field.replace("_", "-")
    with pytest.raises(ConfigError, match=f"^{flag} with finetune_llama.py's examples .--prompt-data.: [^\\n]*; drop"):
        DataConfig(prompt_data=True, data_path=("x.json",), **{field: True})
    DataConfig(prompt_data=True, data_path=("x.json",))


def test_megatron_sequence_parallelism_is_accepted() -> None:
    """Megatron's sequence parallelism gathers the sequence for attention: the whole sample's ids serve
    (tests/dist/test_packed_documents_training.py trains it)."""
    from megatron_ds.flags.parser import parse_config

    argv = [*ARGS, "--reset-position-ids", "--reset-attention-mask", "--tensor-model-parallel-size", "2",
            "--sequence-parallel"]  # fmt: skip
    assert parse_config(argv, world_size=2)[0].parallel.sequence_parallel


def test_run_data_takes_the_eod_from_the_tokenizer() -> None:
    from megatron_ds.data.tokenizer import NullTokenizer
    from megatron_ds.flags.parser import parse_config
    from megatron_ds.training.run_data import packed_documents

    cfg = parse_config([*ARGS, "--reset-attention-mask"], world_size=1)[0]
    assert packed_documents(cfg, NullTokenizer(1000, eod_id=5)) == PackedDocuments(5, False, True)
    assert packed_documents(cfg, None).eod == NullTokenizer(1000).eod == 999  # mock data's default tokenizer
    assert packed_documents(parse_config(ARGS, world_size=1)[0], None) is None


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize(("precision", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_memory_model_counts_the_document_mask(dropout: float, precision: str, dtype: torch.dtype) -> None:
    """A layer attending under --reset-attention-mask's mask keeps exactly the terms' bytes, the mask's included
    (CPU: the flash path without attention dropout, the math path with it; and selective recomputation)."""
    from megatron_ds.estimate import activation_memory as act
    from megatron_ds.estimate.activation_kernels import Split, kernels
    from megatron_ds.model.transformer import TransformerLayer
    from megatron_ds.testing.saved_tensors import graph_bytes

    m = MODELS["learned"]
    reg = RegularizationConfig(hidden_dropout=dropout, attention_dropout=dropout)
    k = kernels(precision, "cpu", dropout)
    tokens = random_rows(4, rows=3, seq=m.seq_length)
    ids = PackedDocuments(EOD, True, True).structure(tokens)
    for selective in (False, True):
        layer = TransformerLayer(m, reg, 1, selective_recompute=selective, document_mask=True).to(dtype).train()
        x = torch.randn(3, m.seq_length, m.hidden_size, dtype=dtype, requires_grad=True)
        y = layer((x, *ids))[0]
        terms = act.transformer_layer_terms(m, 3, k, Split(selective=selective), regularization=reg, document_mask=True)
        assert graph_bytes(y, layer.parameters()) == sum(terms.values()), selective
        assert terms["document mask"] == (3 * 16 * 16 * (1 if selective else k.w if k.attention == "flash" else 0))


def test_memory_model_counts_the_ids_between_stages() -> None:
    from megatron_ds.estimate.activation_kernels import DOCUMENT_ID_BYTES
    from megatron_ds.estimate.memory_inputs import MemoryInputs
    from megatron_ds.estimate.transients import pipe_buffers

    base = MemoryInputs(model=MODELS["learned"], micro_batch_size=2, num_micro_batches=4, precision="fp32")
    packed = MemoryInputs(**{**base.__dict__, "document_ids": True})
    ids = 2 * 16 * DOCUMENT_ID_BYTES
    for stage in range(3):  # the first stage's inputs, a middle stage's received and sent activations, the last's
        more = [a - b for a, b in zip(pipe_buffers(packed, stage, 3), pipe_buffers(base, stage, 3))]
        assert all(x > 0 and x % ids == 0 for x in more), (stage, more)  # whole buffers of ids, none forgotten
        assert more[0] >= more[1]


def test_flop_costs_count_the_whole_square_under_the_mask() -> None:
    """A kernel given an explicit mask computes every block: the layout's FLOP costs drop the causal triangle."""
    from megatron_ds.estimate.layout_costs import compute_inputs
    from megatron_ds.estimate.memory_inputs import MemoryInputs

    base = MemoryInputs(model=MODELS["learned"], micro_batch_size=2, num_micro_batches=4, device="cuda")
    assert compute_inputs(base).causal_attention
    assert compute_inputs(MemoryInputs(**{**base.__dict__, "document_ids": True})).causal_attention
    assert not compute_inputs(
        MemoryInputs(**{**base.__dict__, "document_ids": True, "document_mask": True})
    ).causal_attention


def test_curriculum_cut_keeps_each_prefix_its_ids(tmp_path: Path) -> None:
    """The legacy curriculum cuts (tokens, position_ids, document_ids) together, and what it leaves equals the ids
    of the cut tokens themselves (both are causal in the tokens), as upstream cuts its full sample's ids."""
    from megatron_ds.flags.parser import parse_config
    from megatron_ds.training.step_plan import StepPlan

    schedule = {"difficulty": [8, 24], "max_step": [2]}
    curriculum = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 24,
                  "schedule_type": "fixed_discrete", "schedule_config": schedule}  # fmt: skip
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"curriculum_learning": curriculum}))
    argv = [*ARGS[:6], "--seq-length", "24", *ARGS[8:], "--deepspeed_config", str(path), "--reset-position-ids",
            "--reset-attention-mask"]  # fmt: skip
    config = parse_config(argv, world_size=1)[0]

    class Engine:
        def train_batch_size(self) -> int:
            return 8

        def reset_activation_shape(self) -> None:
            pass

    plan = StepPlan(config, Engine())
    packed = PackedDocuments(EOD, True, True)
    tokens = random_rows(6, rows=2, seq=24)
    labels = (tokens.roll(-1, 1), torch.ones(2, 24))
    batches = plan.cut(packed.batches(iter([(tokens, labels)] * 3)))
    state = type("S", (), {"iteration": 0, "consumed_train_samples": 0})()
    plan.before_step(state)
    (cut, positions, doc), (cut_labels, mask) = next(batches)
    assert cut.shape == positions.shape == doc.shape == cut_labels.shape == mask.shape == (2, 8)
    expected = packed.structure(tokens[:, :8])
    assert torch.equal(positions, expected[0]) and torch.equal(doc, expected[1])


def test_batch_reader_gives_every_split_the_ids() -> None:
    """The loop's reader (train, validation and test all read through it) hands the engine packed inputs."""
    from megatron_ds.data.mock_data import MockGPTData
    from megatron_ds.training.run_data import BatchReader

    data = MockGPTData(num_samples=8, seq_length=16, vocab_size=8, seed=3, split_index=0)
    packed = PackedDocuments(7, True, True)
    plain = BatchReader(micro_batch_size=2, data_parallel_rank=0, data_parallel_size=1, seed=3, reads_data=True)
    reader = BatchReader(**{**plain.__dict__, "documents": packed})
    for (tokens, labels), ((same, positions, doc), same_labels) in zip(
        plain.batches(data, 0, 0), reader.batches(data, 0, 0)
    ):
        assert torch.equal(tokens, same) and torch.equal(labels[0], same_labels[0])
        assert (tokens == 7).any() and torch.equal(positions, packed.structure(tokens)[0])
        assert torch.equal(doc, packed.structure(tokens)[1])
