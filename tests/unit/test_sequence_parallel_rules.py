"""Sequence parallelism, selective recomputation and Ulysses without a process group: the flags and config
rules, the DeepSpeed JSON they generate, the dropout of split activations, and the memory model (Korthikanti's
closed forms; what selective recomputation keeps, checked on our real layer)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.errors import ConfigError
from megatron_ds.estimate import activation_memory as act
from megatron_ds.estimate.activation_kernels import SavedWidths, Split, kernels
from megatron_ds.estimate.memory_inputs import MemoryInputs
from megatron_ds.estimate.memory_model import stage_memory_for
from megatron_ds.flags.parser import parse_config
from megatron_ds.model import rng
from megatron_ds.model.tensor_parallel_rank import SequenceShard
from megatron_ds.testing.models import GPT_1_3B
from megatron_ds.testing.saved_tensors import graph_bytes
from megatron_ds.training import deepspeed_config

BASE = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 128 --lr 1e-3"
BASE += " --train-iters 2"


def parse(line: str, world_size: int = 1):
    return parse_config([*BASE.split(), *line.split()], world_size=world_size)[0]


def error(line: str, world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as err:
        parse(line, world_size)
    assert "\n" not in str(err.value)
    return str(err.value)


# --- flags and config --------------------------------------------------------------------------------


def test_sequence_parallel_with_tensor_parallelism(capsys: pytest.CaptureFixture) -> None:
    cfg = parse("--sequence-parallel --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2", 4)
    assert cfg.parallel.sequence_parallel and cfg.engine_kind == "pipeline"
    assert not parse("--sequence-parallel").parallel.sequence_parallel
    assert "changes nothing at --tensor-model-parallel-size 1" in capsys.readouterr().out
    assert "--seq-length 15 is not divisible by 2" in error(
        "--sequence-parallel --tensor-model-parallel-size 2 --seq-length 15 --max-position-embeddings 16", 2
    )


def test_ulysses_is_carved_out_of_data_parallelism() -> None:
    cfg = parse("--ds-sequence-parallel-size 2 --zero-stage 1", 4)
    assert (cfg.parallel.ds_sequence_parallel_size, cfg.parallel.data_parallel_size) == (2, 2)
    assert cfg.engine_kind == "plain" and cfg.grad_accumulation_steps == 1


@pytest.mark.parametrize(
    "line,world,message",
    [
        ("--ds-sequence-parallel-size 2 --tensor-model-parallel-size 2", 4, "needs --tensor-model-parallel-size 1"),
        ("--ds-sequence-parallel-size 2 --pipeline-model-parallel-size 2", 4, "and --pipeline-model-parallel-size 1"),
        ("--ds-sequence-parallel-size 8 --seq-length 32", 8, "--num-attention-heads is 4, not divisible by 8"),
        (
            "--ds-sequence-parallel-size 4 --num-key-value-heads 2",
            4,
            "--num-key-value-heads (--num-query-groups) is 2, not divisible by 4",
        ),
        ("--ds-sequence-parallel-size 3", 3, "--seq-length 16 is not divisible by 3"),
        ("--ds-sequence-parallel-size 2", 3, "launch a multiple of 2 processes"),
        ("--ds-sequence-parallel-size 2 --sequence-parallel --tensor-model-parallel-size 2", 4, "were both given"),
    ],
)
def test_ulysses_refusals_are_one_line(line: str, world: int, message: str) -> None:
    assert message in error(line, world)


def test_selective_recomputation_flags() -> None:
    assert parse("--recompute-activations").training.selective_recompute
    cfg = parse("--recompute-granularity selective")
    assert cfg.training.selective_recompute and not cfg.training.checkpoint_activations
    assert "keep one" in error("--recompute-activations --checkpoint-activations")
    assert "disagree" in error("--recompute-activations --recompute-granularity full --recompute-method uniform")
    assert "need --recompute-granularity full" in error("--recompute-granularity selective --recompute-method uniform")


def test_generated_json_sends_split_messages_whole_and_works_around_zero3s_average() -> None:
    sp = deepspeed_config.generate(
        parse("--sequence-parallel --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2", 4)
    )
    assert sp["pipeline"] == {"pipe_partitioned": False, "grad_partitioned": False}
    assert "pipeline" not in deepspeed_config.generate(parse("--tensor-model-parallel-size 2", 2))
    z3 = deepspeed_config.generate(parse("--ds-sequence-parallel-size 2 --zero-stage 3", 2))["zero_optimization"]
    assert z3["reduce_scatter"] is False and z3["reduce_bucket_size"] >= 128 * 32  # the embedding fits a bucket
    assert "reduce_scatter" not in deepspeed_config.generate(parse("--zero-stage 3", 2))["zero_optimization"]


# --- dropout of split activations --------------------------------------------------------------------


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_dropout_is_the_part_of_the_unsplit_mask(dim: int, dtype: torch.dtype) -> None:
    """Each part's mask is that part of the whole tensor's `F.dropout` mask, bit for bit (sequence-first parts
    of Megatron's sequence parallelism, batch-first parts of Ulysses)."""
    rng.reset_streams()
    stream = rng.Stream("megatron_ds/dropout/test", 7)
    x = torch.randn(3, 8, 5, dtype=dtype)  # (b, s, h)
    rng.seed_streams([stream], 0)
    whole = rng.dropout(x, 0.3, True, stream)
    parts = []
    for rank in range(4):
        rng.seed_streams([stream], 0)
        mine = (x.transpose(0, 1) if dim == 0 else x).chunk(4, dim=dim)[rank]
        out = rng.dropout(mine, 0.3, True, stream, SequenceShard(4, rank, dim))
        assert out.untyped_storage().nbytes() == out.numel() * out.element_size()  # no view of the whole mask
        parts.append(out)
    joined = torch.cat(parts, dim=dim)
    assert torch.equal(joined.transpose(0, 1) if dim == 0 else joined, whole)
    assert not torch.equal(whole, F.dropout(x, 0.0))  # it dropped something


# --- memory model ------------------------------------------------------------------------------------

PAPER = SavedWidths(w=2, mask=1, attention="math", math_bytes=2, attn_mask=1, qkv_copies=False, stat=0)


@pytest.mark.parametrize("t", [2, 4, 8])
@pytest.mark.parametrize("selective", [False, True])
def test_closed_forms_with_sequence_parallelism_and_selective_recompute(t: int, selective: bool) -> None:
    """sbh/t (34 + 5as/h) with sequence parallelism, sbh (10 + 24/t) and sbh 34/t with selective
    recomputation (16-bit, bool masks, no norm statistics: the paper's assumptions)."""
    m, reg = GPT_1_3B, RegularizationConfig()
    s, h, a = m.seq_length, m.hidden_size, m.num_attention_heads
    for sp in (False, True):
        ours = sum(
            act.transformer_layer_terms(m, 1, PAPER, Split(t, sp, selective=selective), regularization=reg).values()
        )
        assert ours == pytest.approx(act.korthikanti_layer_bytes(s, 1, h, a, t, sp, selective))
    assert act.korthikanti_layer_bytes(s, 1, h, a, t, True, True) == pytest.approx(s * h * 34 / t)
    assert act.korthikanti_layer_bytes(s, 1, h, a, t, False, True) == pytest.approx(s * h * (10 + 24 / t))


def test_ulysses_splits_every_tensor_n_ways() -> None:
    m, reg = GPT_1_3B, RegularizationConfig()
    whole = act.transformer_layer_terms(m, 1, PAPER, Split(), regularization=reg)
    four = act.transformer_layer_terms(m, 1, PAPER, Split(ulysses=4), regularization=reg)
    assert sum(four.values()) == pytest.approx(sum(whole.values()) / 4)


@pytest.mark.parametrize("activation", ["gelu_tanh", "swiglu"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_selective_recompute_keeps_what_the_model_says(
    activation: str, dropout: float, precision: str, dtype: torch.dtype
) -> None:
    """Our layer with and without selective recomputation keeps exactly the terms' bytes (CPU kernels: the flash
    path without attention dropout, the math path with it)."""
    from megatron_ds.model.transformer import TransformerLayer

    m = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=32,
                    max_position_embeddings=32, vocab_size=128, activation=activation)  # fmt: skip
    reg = RegularizationConfig(hidden_dropout=dropout, attention_dropout=dropout)
    k = kernels(precision, "cpu", dropout)
    for selective in (False, True):
        layer = TransformerLayer(m, reg, 1, selective_recompute=selective).to(dtype).train()
        y = layer(torch.randn(3, m.seq_length, m.hidden_size, dtype=dtype, requires_grad=True))
        terms = act.transformer_layer_terms(m, 3, k, Split(selective=selective), regularization=reg)
        assert graph_bytes(y, layer.parameters()) == sum(terms.values()), selective


def test_stage_memory_counts_each_option() -> None:
    m = GPT_1_3B
    base = dict(model=m, micro_batch_size=1, num_micro_batches=8, tensor_parallel_size=2, precision="bf16")
    plain, sp = MemoryInputs(**base), MemoryInputs(**base, sequence_parallel=True)
    selective = MemoryInputs(**base, sequence_parallel=True, selective_recompute=True)
    st = {name: stage_memory_for(i, 1, 4, 6) for name, i in (("tp", plain), ("sp", sp), ("sel", selective))}
    assert st["sel"].activations < st["sp"].activations < st["tp"].activations
    assert st["sp"].pipe_buffers < st["tp"].pipe_buffers  # each rank sends its part of the sequence
    assert "core attention" in st["sel"].transient_source or st["sel"].transient > 0
    ulysses = MemoryInputs(model=m, micro_batch_size=1, num_micro_batches=1, ulysses_size=4, engine="plain")
    alone = MemoryInputs(model=m, micro_batch_size=1, num_micro_batches=1, engine="plain")
    # a quarter, plus the flash kernel's own output beside the all-to-all's and the whole loss mask
    quarter = stage_memory_for(alone, 0, 1, 24).activations / 4
    assert quarter < stage_memory_for(ulysses, 0, 1, 24).activations < 1.1 * quarter
    with pytest.raises(ValueError, match="sequence_parallel needs tensor_parallel_size > 1"):
        MemoryInputs(model=m, micro_batch_size=1, num_micro_batches=1, sequence_parallel=True)
    with pytest.raises(ValueError, match="one granularity or the other"):
        MemoryInputs(model=m, micro_batch_size=1, num_micro_batches=1, selective_recompute=True,
                     checkpoint_activations=True)  # fmt: skip


def test_the_layout_table_says_what_its_data_axis_holds_under_ulysses() -> None:
    """Its rank table lists DP x N data ranks ("data parallel 4" for 2 replicas x N = 2): the line under it says so."""
    from megatron_ds.model.naming import gpt_spec_groups
    from megatron_ds.pipeline.layout import build_layout
    from megatron_ds.training.resolve_layout import layout_text

    config = parse("--ds-sequence-parallel-size 2 --micro-batch-size 1 --global-batch-size 2", world_size=4)
    text = layout_text(config, build_layout(gpt_spec_groups(config.model), 1))
    assert "then data parallel 4, then pipeline" in text
    assert (
        "DeepSpeed-Ulysses: the data axis above is 2 data-parallel replica(s) x --ds-sequence-parallel-size 2: data "
        "ranks 2g .. 2g+1 split the sequences of replica g"
    ) in text
