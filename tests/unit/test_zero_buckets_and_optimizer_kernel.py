"""ZeRO-1's bucket size (generated JSON and memory model agree) and the optimizer kernel (stated once).

The measured side of both is in docs/compute.md (`Memory of ZeRO-1's buckets`): a 2-stage ZeRO-1
run peaked at 3.8 GB with DeepSpeed's default bucket and at what the memory model predicts (0.3%)
with ours.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_ds.estimate.memory_inputs import MemoryInputs
from megatron_ds.estimate.memory_model import stage_memory_for
from megatron_ds.estimate.model_states import (
    MEGATRON_BUCKET_ELEMENTS,
    OPTIMIZER_KERNEL,
    optimizer_kernel_options,
    zero_bucket_elements,
)
from megatron_ds.estimate.transients import zero_bucket_elements_for
from megatron_ds.model.shapes import gpt_spec_params
from megatron_ds.testing.scenario import tiny_config
from megatron_ds.training import deepspeed_config
from megatron_ds.training.optimizer import add_group_placeholders, build_optimizer


def test_bucket_is_an_average_stage_capped_at_megatrons_default() -> None:
    assert zero_bucket_elements(1000, 4, 1) == 250
    assert zero_bucket_elements(1001, 4, 1) == 252  # ceil, then even
    assert zero_bucket_elements(10**12, 8, 1) == MEGATRON_BUCKET_ELEMENTS
    assert zero_bucket_elements(10**12, 8, 64) == 64_000_000  # Megatron-LM: 1M per data-parallel rank


def test_generated_zero1_json_sets_the_bucket_the_memory_model_counts() -> None:
    cfg = tiny_config(parallel__pipeline_model_parallel_size=2, parallel__world_size=4, training__zero_stage=1)
    zero = deepspeed_config.generate(cfg)["zero_optimization"]
    bucket = zero_bucket_elements_for(cfg.model, 2, 2)
    params = sum(sp.num_params for sp in gpt_spec_params(cfg.model))
    assert zero == {"stage": 1, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    assert bucket == -(-params // 2) + (-(-params // 2)) % 2
    assert (
        "reduce_bucket_size" not in deepspeed_config.generate(cfg.replace(training__zero_stage=0))["zero_optimization"]
    )
    # The sizes carry no flag's value: a user file may change them without a contradiction error.
    merged = deepspeed_config.build(cfg, {"zero_optimization": {"reduce_bucket_size": 1000}})
    assert merged["zero_optimization"]["reduce_bucket_size"] == 1000


def test_memory_model_counts_two_buckets_at_zero1_only() -> None:
    cfg = tiny_config()
    base = MemoryInputs(
        cfg.model, micro_batch_size=1, num_micro_batches=4, precision="bf16", zero_stage=1, device="cuda"
    )
    st = stage_memory_for(base, 1, 2, 2)
    bucket = zero_bucket_elements_for(cfg.model, 2, 1)
    # The tiny model's buckets are its largest step temporary on the last stage (bf16: 2 bytes).
    assert "two reduce buckets" in st.transient_source
    assert st.total == st.params + st.grads + st.optimizer + _persistent(base, 1, 2) + 2 * bucket * 2
    zero0 = stage_memory_for(dataclasses.replace(base, zero_stage=0), 1, 2, 2)
    assert "reduce buckets" not in zero0.transient_source


def _persistent(inputs: MemoryInputs, stage: int, num_stages: int) -> float:
    from megatron_ds.estimate.transients import pipe_buffers

    return pipe_buffers(inputs, stage, num_stages)[1]


def test_optimizer_temporaries_follow_the_kernel_of_the_device() -> None:
    cfg = tiny_config()
    # bf16 without ZeRO: AdamW's two fp32 copies of the flat group outweigh the all-reduce's copy.
    cpu = MemoryInputs(cfg.model, micro_batch_size=1, num_micro_batches=1, precision="bf16", device="cpu")
    cuda = dataclasses.replace(cpu, device="cuda")
    single, fused = stage_memory_for(cpu, 0, 1, 4), stage_memory_for(cuda, 0, 1, 4)
    assert OPTIMIZER_KERNEL == {"cuda": "fused", "cpu": "single-tensor"}
    assert "fp32 temporaries" not in fused.transient_source and "temporaries" in single.transient_source
    assert single.total > fused.total


def test_optimizer_is_built_with_the_stated_kernel() -> None:
    cfg = tiny_config()
    module = torch.nn.Sequential(torch.nn.Linear(4, 4))
    add_group_placeholders(module)
    opt = build_optimizer(module, cfg.optimizer)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    expected = optimizer_kernel_options(device)
    assert all(group[k] == v for group in opt.param_groups for k, v in expected.items())
    sgd = build_optimizer(module, cfg.optimizer.__class__(optimizer="sgd", lr=0.1))
    assert all(group[k] == v for group in sgd.param_groups for k, v in expected.items())
