"""One home for fit advice (`estimate/remedies.py`, `estimate/fit_advice.py`): the remedies, when each applies,
what it saves; the one-line advice and the planner's `memory` section read the same ones."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_ds.config import ModelConfig
from megatron_ds.errors import ConfigError
from megatron_ds.estimate import fit_advice, remedies
from megatron_ds.estimate.fit_advice import least_memory, ranked_changes
from megatron_ds.estimate.machine import CPU
from megatron_ds.estimate.memory_inputs import MemoryInputs
from megatron_ds.estimate.memory_model import stage_memory
from megatron_ds.estimate.remedies import HALVE_MICRO_BATCH, ONE_BIT, RECOMPUTE, REMEDIES, ZERO_1
from megatron_ds.estimate.run_layout import memory_inputs
from megatron_ds.flags.parser import parse_config
from megatron_ds.model.naming import gpt_spec_groups
from megatron_ds.pipeline.layout import build_layout
from megatron_ds.plan.__main__ import main
from megatron_ds.units import format_bytes

MODEL = ModelConfig(
    num_layers=8,
    hidden_size=256,
    num_attention_heads=8,
    ffn_hidden_size=1024,
    seq_length=128,
    max_position_embeddings=128,
    vocab_size=1024,
)
INPUTS = MemoryInputs(MODEL, micro_batch_size=4, num_micro_batches=4, zero_stage=0, data_parallel_size=2)


def default_layout(inputs: MemoryInputs, method: str):
    assert method == "none"
    return build_layout(gpt_spec_groups(inputs.model), 2)


def test_when_each_remedy_applies() -> None:
    assert ZERO_1.change(INPUTS).zero_stage == 1
    assert ZERO_1.change(dataclasses.replace(INPUTS, data_parallel_size=1)) is None  # nothing to partition over
    assert ZERO_1.change(dataclasses.replace(INPUTS, zero_stage=1)) is None
    assert RECOMPUTE.change(INPUTS).checkpoint_activations
    assert RECOMPUTE.change(dataclasses.replace(INPUTS, checkpoint_activations=True)) is None
    halved = HALVE_MICRO_BATCH.change(INPUTS)
    assert (halved.micro_batch_size, halved.num_micro_batches) == (2, 8)  # the same samples per step
    assert HALVE_MICRO_BATCH.flags(halved) == "--micro-batch-size 2"
    assert HALVE_MICRO_BATCH.change(dataclasses.replace(INPUTS, micro_batch_size=1)) is None
    five = dataclasses.replace(INPUTS, micro_batch_size=5, num_micro_batches=1)
    assert HALVE_MICRO_BATCH.change(five) is None  # 5 samples per step do not split into micro-batches of 2


def test_ranked_changes_are_cheapest_first_with_the_memory_models_savings() -> None:
    layout = default_layout(INPUTS, "none")
    changes = ranked_changes(INPUTS, layout, "none", default_layout)
    # each applies here but sequence parallelism, which needs tensor parallelism, and the plain engine's
    # changes (Ulysses, ZeRO 2/3, parameter offload: P = 1 only)
    skipped = [remedies.SEQUENCE_PARALLEL, *(r for r in REMEDIES if r.single_stage)]
    assert sorted(c.name for c in changes) == sorted(r.name for r in REMEDIES if r not in skipped)
    assert [(c.cost_rank, -c.saving) for c in changes] == sorted((c.cost_rank, -c.saving) for c in changes)
    base = max(s.total for s in stage_memory(INPUTS, layout))
    recompute = next(c for c in changes if c.name == RECOMPUTE.name)
    want = base - max(s.total for s in stage_memory(RECOMPUTE.change(INPUTS), layout))
    assert recompute.saving == pytest.approx(want) and recompute.saving > 0
    assert next(c for c in changes if c.name == ONE_BIT.name).saving == 0


def test_sequence_parallelism_and_selective_recompute_are_offered_where_they_apply() -> None:
    t2 = dataclasses.replace(INPUTS, model=dataclasses.replace(INPUTS.model), tensor_parallel_size=2)
    changes = {c.name: c for c in ranked_changes(t2, default_layout(t2, "none"), "none", default_layout)}
    sp, selective = remedies.SEQUENCE_PARALLEL, remedies.SELECTIVE_RECOMPUTE
    assert (
        changes[sp.name].saving > 0
        and changes[sp.name].cost_rank == 0
        and changes[sp.name].flags == "--sequence-parallel"
    )
    assert selective.name in changes and changes[selective.name].flags == "--recompute-activations"
    assert sp.change(sp.change(t2)) is None and selective.change(RECOMPUTE.change(t2)) is None


def test_ulysses_is_offered_at_pipeline_size_1_with_the_smallest_degree_that_divides() -> None:
    one_stage = lambda inputs, method: build_layout(gpt_spec_groups(inputs.model), 1)  # noqa: E731
    changes = {c.name: c for c in ranked_changes(INPUTS, one_stage(INPUTS, "none"), "none", one_stage)}
    ulysses = changes[remedies.ULYSSES.name]
    assert ulysses.flags == "--ds-sequence-parallel-size 2" and ulysses.saving > 0
    changed = remedies.ULYSSES.change(INPUTS)
    assert (changed.ulysses_size, changed.engine, changed.data_parallel_size) == (2, "plain", 2)
    assert remedies.ULYSSES.change(dataclasses.replace(INPUTS, data_parallel_size=1)) is None  # no DP to split
    assert remedies.ULYSSES.change(dataclasses.replace(INPUTS, tensor_parallel_size=2)) is None
    three_heads = dataclasses.replace(MODEL, num_attention_heads=3, hidden_size=192)
    assert remedies.ULYSSES.change(dataclasses.replace(INPUTS, model=three_heads)) is None


def test_a_change_keeps_the_rest_of_the_configuration() -> None:
    """With the optimizer offloaded, recomputation still saves activations (the planner used to
    measure it against a configuration without the offload and report that it added memory)."""
    offloaded = dataclasses.replace(INPUTS, zero_stage=1, offload_optimizer="cpu")
    changes = ranked_changes(offloaded, default_layout(offloaded, "none"), "none", default_layout)
    assert next(c for c in changes if c.name == RECOMPUTE.name).saving > 0


def test_the_one_line_advice_names_the_same_remedies() -> None:
    need = least_memory(RECOMPUTE.change(INPUTS), 2)
    advice = fit_advice.fit_advice(INPUTS, 2, need)
    assert RECOMPUTE.flags(INPUTS) in advice and "--pipeline-model-parallel-size 3" in advice
    assert fit_advice.fit_advice(INPUTS, 2, 1.0).startswith("no larger --pipeline-model-parallel-size")


def test_the_memory_section_renders_these_changes(capsys) -> None:
    argv = ["memory", "--model", "2.7b", "--num-gpus", "1", "--gpu", "A10", "--global-batch-size", "16"]
    assert main([*argv, "--format", "json"]) == 0
    out = capsys.readouterr().out
    sec = json.loads(out[out.index("{") :])["sections"][0]  # after DeepSpeed's import-time log line, if any
    changes = {c["name"]: c for c in sec["data"]["changes"]}
    assert changes[RECOMPUTE.name]["saving"] > 0  # the offloaded plan keeps its offload when recomputing
    assert set(changes) <= {r.name for r in REMEDIES}


# ZeRO 2/3 and offload: the changes pretrain_gpt.py runs at pipeline size 1 (DeepSpeed's plain engine).
ZERO_ARGV = [
    *("--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8", "--ffn-hidden-size", "1024"),
    *("--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size", "1024", "--bf16"),
    *("--micro-batch-size", "4", "--global-batch-size", "32", "--pipeline-model-parallel-size", "1"),
    *("--lr", "1e-4", "--train-iters", "10", "--mock-data"),
]
PLAIN_REMEDIES = (
    remedies.ZERO_2,
    remedies.ZERO_3,
    remedies.OFFLOAD_OPTIMIZER,
    remedies.ZERO_2_OFFLOAD,
    remedies.OFFLOAD_PARAM,
)


def _run_inputs(argv: list[str], world_size: int = 2) -> MemoryInputs:
    """The memory model's inputs pretrain_gpt.py derives from `argv` (raises ConfigError if it refuses them)."""
    return memory_inputs(parse_config(argv, world_size=world_size)[0], CPU)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("remedy", PLAIN_REMEDIES, ids=lambda r: r.name)
def test_each_zero_change_is_flags_pretrain_gpt_accepts_with_the_same_meaning(remedy, optimizer) -> None:
    """Appending a change's flags to the run's own gives exactly the configuration the change predicts for."""
    argv = [*ZERO_ARGV, "--optimizer", optimizer]
    changed = remedy.change(_run_inputs(argv))
    assert _run_inputs([*argv, *remedy.flags(changed).split()]) == changed
    if optimizer == "sgd":  # --cpu-optimizer is DeepSpeed's CPU Adam: an SGD run offloads torch's optimizer
        assert "--cpu-optimizer" not in remedy.flags(changed)


def test_zero_2_and_3_apply_where_the_plain_engine_runs_and_partition_something() -> None:
    zero2, zero3 = remedies.ZERO_2.change(INPUTS), remedies.ZERO_3.change(INPUTS)
    assert (zero2.zero_stage, zero2.engine, zero3.zero_stage, zero3.engine) == (2, "plain", 3, "plain")
    single = dataclasses.replace(INPUTS, data_parallel_size=1)
    assert remedies.ZERO_2.change(single) is None and remedies.ZERO_3.change(single) is None
    assert remedies.OFFLOAD_PARAM.change(single).offload_param == "cpu"  # 13B on one GPU: offload, not DP
    zbh1 = dataclasses.replace(INPUTS, schedule="zbh1")  # the plain engine runs the 1F1B schedule only
    assert all(r.change(zbh1) is None for r in (remedies.ZERO_2, remedies.ZERO_3, remedies.OFFLOAD_PARAM))
    assert remedies.ZERO_2.change(zero3) is None and remedies.ZERO_3.change(zero3) is None
    # ZeRO-Offload's 13B on one GPU: ZeRO-2 with CPU Adam at DP = 1 moves the gradients and fp32 states off
    zero2_offload = remedies.ZERO_2_OFFLOAD.change(single)
    assert (zero2_offload.zero_stage, zero2_offload.offload_optimizer, zero2_offload.engine) == (2, "cpu", "plain")
    assert remedies.ZERO_2_OFFLOAD.change(zero2_offload) is None
    offloaded = remedies.OFFLOAD_PARAM.change(INPUTS)
    assert remedies.OFFLOAD_OPTIMIZER.change(offloaded) is None and remedies.OFFLOAD_PARAM.change(offloaded) is None


def _one_stage(inputs: MemoryInputs, method: str):
    return build_layout(gpt_spec_groups(inputs.model), 1)


def test_at_pipeline_size_1_the_memory_section_offers_zero_2_3_and_offload_with_the_memory_models_peaks() -> None:
    layout = _one_stage(INPUTS, "none")
    changes = {c.name: c for c in ranked_changes(INPUTS, layout, "none", _one_stage)}
    base = max(s.total for s in stage_memory(INPUTS, layout))
    states = {}
    for remedy in PLAIN_REMEDIES:
        (stage,) = stage_memory(remedy.change(INPUTS), layout)
        got = changes[remedy.name]
        assert got.peak == pytest.approx(stage.total) and got.saving == pytest.approx(base - stage.total)
        assert got.saving > 0
        states[remedy.name] = stage.model_states
    # ZeRO-3 partitions the parameters besides ZeRO-2's gradients (though its gathered working set, a transient,
    # can outweigh that in a model this small); parameter offload leaves only the persistent small tensors
    assert states["ZeRO-3"] < states["ZeRO-2"] and states[remedies.OFFLOAD_PARAM.name] < states["ZeRO-3"] / 10
    two_stages = ranked_changes(INPUTS, default_layout(INPUTS, "none"), "none", default_layout)
    assert {c.name for c in two_stages}.isdisjoint(r.name for r in REMEDIES if r.single_stage)


def test_the_one_line_advice_names_zero_2_3_and_offload_at_pipeline_size_1_only() -> None:
    """Each change is named, with the memory model's least largest stage, exactly when that fits the limit."""
    limit = least_memory(remedies.ZERO_2.change(INPUTS), 1)
    assert limit < least_memory(INPUTS, 1)
    advice = fit_advice.fit_advice(INPUTS, 1, limit)
    named = []
    for remedy in fit_advice.ONE_LINE:
        changed = remedy.change(INPUTS)
        if changed is None:
            continue
        need = least_memory(changed, 1)
        assert (f"{remedy.flags(changed)} ({format_bytes(need)} per rank)" in advice) == (need <= limit), remedy.name
        named += [remedy.name] if need <= limit else []
    assert {"ZeRO-2", remedies.OFFLOAD_PARAM.name} <= set(named)
    # the same limit at two stages: ZeRO 2/3 would not run there (the pipeline engine), so not named
    at_two = fit_advice.fit_advice(INPUTS, 2, least_memory(remedies.OFFLOAD_OPTIMIZER.change(INPUTS), 2))
    assert "--cpu-optimizer --zero-stage 1 (" in at_two
    assert "--zero-stage 2" not in at_two and "--zero-stage 3" not in at_two and "--offload-param" not in at_two


def test_full_recomputation_from_selective_says_to_drop_the_selective_flag() -> None:
    """pretrain_gpt.py refuses --checkpoint-activations beside --recompute-activations, so the change from a
    selective run names the flag it replaces, and swapping them gives exactly the changed configuration."""
    argv = [*ZERO_ARGV, "--recompute-activations"]
    before = _run_inputs(argv)
    assert before.selective_recompute
    changed = RECOMPUTE.change(before)
    assert RECOMPUTE.ask(before, changed) == "--checkpoint-activations in place of --recompute-activations"
    swapped = [a for a in argv if a != "--recompute-activations"] + ["--checkpoint-activations"]
    assert _run_inputs(swapped) == changed
    with pytest.raises(ConfigError):
        _run_inputs([*argv, "--checkpoint-activations"])
    assert RECOMPUTE.ask(INPUTS, RECOMPUTE.change(INPUTS)) == "--checkpoint-activations"
    layout = default_layout(before, "none")
    listed = next(c for c in ranked_changes(before, layout, "none", default_layout) if c.name == RECOMPUTE.name)
    assert listed.flags == "--checkpoint-activations in place of --recompute-activations"
    advice = fit_advice.fit_advice(before, 2, least_memory(changed, 2))
    assert "--checkpoint-activations in place of --recompute-activations (" in advice


def _peak(inputs: MemoryInputs) -> float:
    return max(s.total for s in stage_memory(inputs, default_layout(inputs, "none")))


def test_changes_together_when_none_fits_alone_cheapest_first() -> None:
    """Between the largest single saving and the peak of two changes together, the combination is the cheapest
    pair that fits, priced by the memory model exactly as the pair's configuration."""
    layout = default_layout(INPUTS, "none")
    singles = ranked_changes(INPUTS, layout, "none", default_layout)
    alone = min(c.peak for c in singles)
    pair = fit_advice.fitting_combination(INPUTS, layout, "none", default_layout, alone * 0.999)
    assert pair is not None and pair.peak <= alone * 0.999 < alone
    names = pair.name.split(" + ")
    remedies = [next(r for r in REMEDIES if r.name == n) for n in names]
    now = INPUTS
    for r in remedies:
        now = r.change(now)
    assert pair.peak == pytest.approx(_peak(now))
    assert pair.flags == " ".join(
        r.flags(after)
        for r, after in zip(remedies, [remedies[0].change(INPUTS), now])  # both steps' flags, in order
    )
    # no pair of a lower largest cost, or of the same and a lower sum, fits
    ranks = [r.cost_rank for r in remedies]
    for a in REMEDIES:
        for b in REMEDIES:
            if a is ONE_BIT or b is ONE_BIT or a.single_stage or b.single_stage:
                continue
            first = a.change(INPUTS)
            both = b.change(first) if first is not None else None
            if both is None or both == first or first == INPUTS:
                continue
            if (max(a.cost_rank, b.cost_rank), a.cost_rank + b.cost_rank) < (max(ranks), sum(ranks)):
                assert _peak(both) > alone * 0.999, (a.name, b.name)
    assert fit_advice.fitting_combination(INPUTS, layout, "none", default_layout, 1.0) is None  # one byte: nothing


def test_the_memory_section_offers_changes_together_when_none_fits_alone(capsys) -> None:
    """A 13B model over 8 A100-40GB stages without data parallelism: its model states alone exceed what
    recomputation leaves room for, so recomputation and the optimizer offloaded go together."""
    argv = ["memory", "--model", "llama2-13b", "--num-gpus", "8", "--gpu", "A100-40GB", "--seq-length", "4096"]
    argv += ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "8", "--micro-batch-size", "4"]
    assert main([*argv, "--zero-stage", "1", "--format", "json"]) == 1  # a failed check: it does not fit
    out = capsys.readouterr().out
    data = json.loads(out[out.index("{") :])["sections"][0]["data"]
    usable = 0.9 * 40 * 2**30
    assert max(data["stages"]) > usable and all(c["peak"] > usable for c in data["changes"])
    together = data["together"]
    assert together is not None and together["peak"] <= usable
    assert together["name"] == f"{RECOMPUTE.name} + {remedies.OFFLOAD_OPTIMIZER.name}"
    assert together["flags"] == "--checkpoint-activations --cpu-optimizer --zero-stage 1"
    assert main([*argv, "--zero-stage", "1"]) == 1
    text = capsys.readouterr().out
    assert "No single change fits in 36.00 GiB; together they do: activation recomputation + offload" in text
    assert main([*argv, "--zero-stage", "1", "--num-layers", "400"]) == 1  # hopeless: says what to do instead
    assert "No single change, nor two together, fits in 36.00 GiB: split the model over more GPUs" in (
        capsys.readouterr().out
    )


def test_of_changes_together_at_equal_cost_the_milder_is_named(capsys) -> None:
    """7B on 2 A100-40GB at pipeline size 1: recomputation with ZeRO-2's optimizer offload fits, and so does
    recomputation with the parameters offloaded too (less memory, more PCIe traffic): the milder is named."""
    argv = ["memory", "--model", "llama2-7b", "--num-gpus", "2", "--gpu", "A100-40GB", "--seq-length", "4096"]
    argv += ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--micro-batch-size", "4"]
    assert main([*argv, "--zero-stage", "1", "--format", "json"]) == 1
    out = capsys.readouterr().out
    together = json.loads(out[out.index("{") :])["sections"][0]["data"]["together"]
    assert together["name"] == f"{RECOMPUTE.name} + {remedies.ZERO_2_OFFLOAD.name}"
    assert together["flags"] == "--checkpoint-activations --zero-stage 2 --cpu-optimizer"
    assert together["peak"] <= 0.9 * 40 * 2**30


def test_the_one_line_advice_names_two_changes_together_when_none_fits_alone() -> None:
    """Two layers over two stages: neither more stages nor one change fits 15 MiB; recomputation with the
    optimizer offloaded does (its least largest stage by the memory model, as the message prints it)."""
    two = dataclasses.replace(INPUTS, model=dataclasses.replace(MODEL, num_layers=2))
    both = remedies.OFFLOAD_OPTIMIZER.change(RECOMPUTE.change(two))
    limit = 15 * 2**20
    assert least_memory(both, 2) <= limit < min(least_memory(two, p) for p in (3, 4))
    advice = fit_advice.fit_advice(two, 2, limit)
    assert advice.startswith("no larger --pipeline-model-parallel-size (up to 4), nor ")
    assert advice.endswith(
        f"alone makes it fit; together --checkpoint-activations --cpu-optimizer --zero-stage 1 "
        f"({format_bytes(least_memory(both, 2))} on its largest stage) would"
    )
    assert fit_advice.fit_advice(two, 2, 1.0).endswith(
        "or two of them together makes it fit; lower --micro-batch-size or raise --pp-memory-limit"
    )
