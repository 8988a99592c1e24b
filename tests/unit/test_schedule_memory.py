"""The memory model under ZB-H1 and interleaving: what a weight pass waits with is what the layers
store, the schedules' in-flight counts and pipe buffers, and per-rank memory over model chunks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.estimate import activation_memory as act
from megatron_ds.estimate import pipeline_schedules as schedules
from megatron_ds.estimate.memory_inputs import MemoryInputs
from megatron_ds.estimate.memory_model import rank_memory_for, stage_memory, stage_memory_for
from megatron_ds.estimate.spec_memory import spec_memory
from megatron_ds.estimate.transients import (
    logits_counted_twice,
    pipe_buffers,
    refilled_slot_logits,
    weight_store_bytes,
)
from megatron_ds.model import naming
from megatron_ds.model.layers import WordEmbedding, lm_head_logits
from megatron_ds.model.transformer import TransformerLayer
from megatron_ds.model.weight_grad import WeightGradStore
from megatron_ds.pipeline.layout import build_layout

MODEL = ModelConfig(
    num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=32,
    max_position_embeddings=32, vocab_size=128,
)  # fmt: skip
REG = RegularizationConfig(hidden_dropout=0.0, attention_dropout=0.0)


def inputs(schedule: str = "1f1b", **kw) -> MemoryInputs:
    return MemoryInputs(
        model=kw.pop("model", MODEL), micro_batch_size=2, num_micro_batches=kw.pop("m", 8), precision="fp32",
        device="cpu", regularization=REG, schedule=schedule, **kw,
    )  # fmt: skip


def stored_bytes(store: WeightGradStore) -> int:
    """Distinct storages the store keeps for its weight passes (inputs and output gradients)."""
    seen = {}
    for entry in store._queue:
        for x, g, _ in entry:
            for t in (x, g):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("gated", [False, True])
def test_weight_store_is_what_the_layers_store(gated: bool) -> None:
    model = dataclasses.replace(MODEL, activation="swiglu") if gated else MODEL
    layer = TransformerLayer(model, REG, init_seed=3)
    x = torch.randn(2, 32, 64, requires_grad=True)
    store = WeightGradStore()
    with store.deferring():
        layer(x).backward(torch.randn(2, 32, 64))
    assert stored_bytes(store) == weight_store_bytes(inputs("zbh1", model=model), 1, holds_head=False)
    emb = WordEmbedding(model, REG, init_seed=5)
    hidden = torch.randn(2, 32, 64, requires_grad=True)
    head = WeightGradStore()
    with head.deferring():
        lm_head_logits(emb, hidden).backward(torch.randn(2, 32, 128))
    layers = weight_store_bytes(inputs("zbh1", model=model), 0, holds_head=True)
    assert stored_bytes(head) == layers
    assert weight_store_bytes(inputs("1f1b"), 4, holds_head=True) == 0  # 1F1B stores nothing


def test_zbh1_adds_the_weight_store_on_every_stage_after_the_first() -> None:
    """Stage 0 runs whole backwards: 1F1B's memory; later stages hold up to s deferred weight passes."""
    p = 4
    for s in range(p):
        one, zb = stage_memory_for(inputs("1f1b"), s, p, 1), stage_memory_for(inputs("zbh1"), s, p, 1)
        assert zb.in_flight == one.in_flight  # 1F1B's activations in flight
        if s == 0:
            assert zb.total == pytest.approx(one.total)
        else:
            assert zb.weight_store_per_micro_batch > 0 and zb.total > one.total
            assert zb.total - one.total <= s * zb.weight_store_per_micro_batch + 1


def test_interleaved_rank_memory_sums_its_chunks() -> None:
    """A rank's parameters are its chunks'; chunk sizes follow the flat layout; the embedding rank and
    the head rank are the ones whose chunks hold flat stage 0 and the last."""
    groups = naming.gpt_spec_groups(MODEL)
    layout = build_layout(groups, 2, virtual_stages=2)  # 4 flat stages of one layer each
    mem = inputs("interleaved", virtual_stages=2)
    ranks = stage_memory(mem, layout)
    assert [r.num_layers for r in ranks] == [2, 2]
    whole = stage_memory_for(inputs("1f1b"), 0, 1, 4)
    assert sum(r.num_params for r in ranks) == whole.num_params + MODEL.vocab_size * MODEL.hidden_size  # tied copy
    one_chunk = rank_memory_for(mem, 0, 2, (1, 1))
    assert one_chunk.total == ranks[0].total and one_chunk.in_flight > 0
    with pytest.raises(ValueError, match="virtual stages"):
        inputs("interleaved")


def test_interleaved_later_backwards_hold_only_the_gradients_of_chunks_that_ran_backward() -> None:
    """Interleaving runs a rank's last chunk's backwards first: until its first chunk's first backward only
    the last chunk's gradients exist (measured by benchmarks/schedules.py: the 48-layer P = 5 ranks'
    peaks within 1.2% of the model with this, 9% over it when every gradient was counted)."""
    model = dataclasses.replace(MODEL, num_layers=8)
    mem = inputs("interleaved", model=model, virtual_stages=2, m=4)  # M = P: the peak comes before chunk 0's
    middle = rank_memory_for(mem, 1, 4, (1, 1))  # chunks: flat stages 1 and 5, equal parameters
    assert "gradients held (of 50% of the parameters)" in middle.transient_source
    everything = middle.params + middle.grads + middle.optimizer + middle.activations + middle.pipe_buffers
    assert middle.total < everything  # half the gradients are not yet there at the peak


def test_zbh1s_linear_gradients_exist_from_the_first_weight_pass_on() -> None:
    """ZB-H1's last stage runs every backward before its weight passes: its split backwards make only the
    norms', biases' and embeddings' gradients, the first weight pass makes the linears' (no accumulation),
    each later one adds one before accumulating it; a pass frees its store at its end (its own counted)."""
    zb = schedules.find("zbh1")
    _, later = schedules.distinct_moments(zb, 4, 5, 4)
    backwards = [m for m in later if m.kind == schedules.BACKWARD_INPUT]
    weights = [m for m in later if m.kind == schedules.WEIGHT]
    assert [m.pending for m in backwards] == [1, 2, 3] and all(m.weight_grads == () for m in backwards)
    assert all(m.backward_grads == (0,) and m.accumulating for m in backwards)
    assert [(m.pending, m.accumulating, m.weight_grads) for m in weights] == [
        (4, False, (0,)), (3, True, (0,)), (2, True, (0,)), (1, True, (0,)),
    ]  # fmt: skip
    # 1F1B's whole backwards make every gradient: both kinds exist from the second backward on
    _, later = schedules.distinct_moments(schedules.find("1f1b"), 4, 5, 1)
    assert all(m.kind == schedules.BACKWARD and m.backward_grads == m.weight_grads == (0,) for m in later)


def test_zbh1s_last_stage_peaks_in_its_second_weight_pass() -> None:
    """Measured by the allocation trace of benchmarks/schedules.py target (48 layers, P = 5, M = 4): the
    last ZB-H1 rank peaks in its second weight pass with 3 stores, every gradient and the head's weight
    gradient before accumulation; a later backward there holds no linear's gradient yet. As there, the head's
    weight is larger than what a micro-batch stores (else the first pass, with 4 stores, is the peak)."""
    model = dataclasses.replace(MODEL, seq_length=16, max_position_embeddings=16, vocab_size=2048)
    mem = inputs("zbh1", m=4, model=model)
    last = rank_memory_for(mem, 4, 5, (1,))
    held = [sp for sp in spec_memory(mem) if sp.group in ("body", "post")]
    states = last.params + last.grads + last.optimizer
    largest = max(sp.largest_deferrable for sp in held) * 4  # the head's weight (fp32)
    assert largest == model.vocab_size * model.hidden_size * 4
    assert last.transient_source.startswith("a weight pass, 0 micro-batch(es) in flight, 3 weight pass(es)' store")
    assert last.total == pytest.approx(states + 3 * last.weight_store_per_micro_batch + last.pipe_buffers + largest)
    # with every gradient held at its last backward (the model before), it would be one micro-batch more
    old = states + last.activation_per_micro_batch + 3 * last.weight_store_per_micro_batch + last.pipe_buffers
    assert last.total < old + largest


# --- the last stage under megatron-core's vocabulary-parallel loss (T > 1) ------------------------------


def test_the_vocabulary_parallel_loss_works_in_the_logits_themselves(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loss the model uses at T > 1 (megatron-core's `_VocabParallelCrossEntropy`, here on one tensor rank
    holding the whole vocabulary, its collectives no-ops) saves its softmax in the float32 logits' own storage
    and makes their gradient there: the pipe buffer's logits, the saved softmax, the gradient the LM head
    receives (what a ZB-H1 store keeps) are one tensor: the loss's backward needs no b*s*v buffer of its own."""
    from megatron.core.tensor_parallel import cross_entropy as mc

    from megatron_ds.model import tensor_parallel_layers as tpl
    from megatron_ds.model.layers import logits_to_fp32

    monkeypatch.setattr(mc, "get_tensor_model_parallel_group", lambda: None)
    monkeypatch.setattr(mc, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(mc, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: None)
    s, b, h, v = 32, 2, 64, 128
    hidden, weight = torch.randn(s, b, h, requires_grad=True), torch.randn(v, h, requires_grad=True)
    logits = logits_to_fp32(hidden @ weight.t())  # (s, b, v): the stage output DeepSpeed keeps
    address = logits.untyped_storage().data_ptr()
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda x: saved.append(x.untyped_storage().data_ptr()) or x, lambda x: x
    ):
        loss = tpl.sequence_first_cross_entropy_loss(logits, (torch.randint(0, v, (b, s)), torch.ones(b, s)))
    assert address in saved  # the softmax it saved is the logits
    grads: list[int] = []
    logits.register_hook(lambda g: grads.append(g.untyped_storage().data_ptr()))
    loss.backward()
    assert grads == [address]  # the logits' gradient is made in place


def last_stage(schedule: str, precision: str = "fp32", t: int = 2, m: int = 4):
    """The last of 2 stages of 2 layers each, with logits far above the layers (b*s*v/t x 4 bytes = 8 MiB)."""
    model = dataclasses.replace(MODEL, hidden_size=32, ffn_hidden_size=128, seq_length=256,
                                max_position_embeddings=256, vocab_size=4096 * t)  # fmt: skip
    mem = dataclasses.replace(inputs(schedule, model=model, m=m), precision=precision, tensor_parallel_size=t)
    mem = dataclasses.replace(mem, sequence_parallel=t > 1)
    return mem, rank_memory_for(mem, 1, 2, (2,)), 4 * 256 * 2 * 4096


def test_the_last_stage_under_the_vocabulary_parallel_loss_counts_each_logits_tensor_once() -> None:
    """Measured (tests/dist/test_sequence_parallel_memory.py; and P = 2, T = 2, 8 layers, h 256, M = 4, vocabulary
    8192, sequence parallelism: 1F1B's last stage 61.5 MiB against 68.9 predicted before, 60.9 now; ZB-H1's 73.5
    against 79.2 before, 73.2 now). 1F1B peaks in the forward before a backward: the micro-batch's activations
    (its logits among them) and both pipe-buffer slots' earlier logits, and no loss gradient; at its backward
    one slot holds that micro-batch's own logits. ZB-H1 (fp32) peaks in a weight pass whose stores hold the
    logits its one slot keeps. At T = 1 torch's cross entropy keeps both beside the logits."""
    mem, one, logits = last_stage("1f1b")
    slots = pipe_buffers(mem, 1, 2)[0]
    assert act.loss_backward_transient(mem.model, 2, 2) == 0
    assert one.pipe_buffers == slots - logits  # at the first backward its own logits are its softmax
    assert one.transient_source.endswith(
        "the forward before it: its logits made while the pipe-buffer slot it refills holds an earlier one"
    )
    assert one.total == pytest.approx(one.model_states + one.activation_per_micro_batch + slots)
    zb_mem, zb, _ = last_stage("zbh1")
    assert zb.transient_source.startswith("a weight pass, 0 micro-batch(es) in flight, 2 weight pass(es)' store")
    head_grad = mem.model.vocab_size // 2 * mem.model.hidden_size * 4  # before accumulation
    zb_slots = pipe_buffers(zb_mem, 1, 2)[0]
    assert zb.total == pytest.approx(
        zb.model_states + 2 * zb.weight_store_per_micro_batch + zb_slots - logits + head_grad
    )
    # 16-bit: a store keeps the cast's copy of the logits' gradient (made by the loss's backward), so only the
    # micro-batches in flight share the slots' logits, and the slot a forward refills holds logits nothing else keeps
    bf16 = dataclasses.replace(zb_mem, precision="bf16")
    assert logits_counted_twice(zb_mem, 1, 2, 0, 2) == logits and logits_counted_twice(bf16, 1, 2, 0, 2) == 0
    assert refilled_slot_logits(zb_mem, 1, 2, 1, 1) == 0 and refilled_slot_logits(bf16, 1, 2, 1, 1) == logits
    assert act.loss_backward_transient(mem.model, 2, 2, compute_bytes=2) == logits / 2
    # T = 1: the loss's two float32 gradients beside the logits the slots keep
    t1_mem, t1, logits1 = last_stage("1f1b", t=1)
    assert act.loss_backward_transient(t1_mem.model, 2, 1) == 2 * logits1
    assert t1.transient_source.endswith("fp32 loss gradients d(log-probs), d(logits) of one micro-batch")
    assert t1.pipe_buffers == pipe_buffers(t1_mem, 1, 2)[0]
